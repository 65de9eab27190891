"""Test helpers: tiny random GLM-5 / DeepSeek-V3.2 checkpoints, plans, and a mini "router".

`Session` plays the router's part: it hands out KV pages from a shuffled free list (so every
request's pages are scattered and out of order), tracks cached lengths, and builds a protocol Plan
per step, which goes through the worker's own build_forward_batch (runner.forward_plan). With
dp_size > 1 (data-parallel attention) it keeps one free list per rank, global page ids (rank r owns
[r * P, (r + 1) * P)), and places each new request on the rank it is told.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from nsaserve.protocol.builder import RequestSpec, build_plan
from nsaserve.protocol.messages import Plan

VOCAB = 96


def tiny_config(model_type: str, **over):
    """A tiny config with >= 16 indexer heads (fewer make ReLU'd scores tie at exactly 0, and then
    even transformers' own cached and uncached paths disagree) and index_topk far below the
    context, so sparse selection really happens."""
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        index_n_heads=16, index_head_dim=32, index_topk=8, max_position_embeddings=128,
        initializer_range=0.1, routed_scaling_factor=2.5, tie_word_embeddings=False,
    )  # fmt: skip
    if model_type == "glm_moe_dsa":
        from transformers import GlmMoeDsaConfig

        # Layer 2 reuses layer 1's top-k (GLM-5.2 IndexCache).
        common.update(n_group=1, topk_group=1, indexer_types=["full", "full", "shared"])
        common.update(over)
        return GlmMoeDsaConfig(**common)
    from transformers import DeepseekV32Config

    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
                beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)  # fmt: skip
    common.update(n_group=4, topk_group=2, rope_parameters=rope)
    common.update(over)
    return DeepseekV32Config(**common)


def make_checkpoint(model_type: str, path: str, seed: int = 0, confident_embedding: float = 0.0, **over):
    """Save a random tiny model to `path`; return the transformers model (eval, float32, eager)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(model_type, **over)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        # Norm weights, the router's correction bias and LayerNorm biases start as constants;
        # randomise them so that a wrong eps, a missing bias or a swapped weight shows.
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
        if confident_embedding:
            # A random model's greedy tokens are near coin flips that even bf16 rounding changes.
            # An lm_head that is a permutation of the embedding gives predictions real margins,
            # while attention still moves them (tests check that the top-k changes tokens).
            g = torch.Generator().manual_seed(seed)
            emb = torch.randn(model.model.embed_tokens.weight.shape, generator=g) * confident_embedding
            model.model.embed_tokens.weight.copy_(emb)
            model.lm_head.weight.copy_(emb[torch.randperm(emb.shape[0], generator=g)])
    model.save_pretrained(path)
    return model.eval()


def hf_prefill_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decode with transformers' own KV cache: (generated tokens, logits of every step)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), cache=cache, use_cache=True)
        logits = [out.logits[0, -1].float()]
        tokens = []
        for _ in range(steps):
            tok = int(logits[-1].argmax())
            tokens.append(tok)
            out = model(torch.tensor([[tok]]), cache=cache, use_cache=True)
            logits.append(out.logits[0, -1].float())
    return tokens, logits


def prompts_then_decodes(runner, lengths: tuple[int, int], decodes: int, seed: int, offset: int) -> torch.Tensor:
    """Float32 logits (on the CPU) of two random prompts of `lengths` (every position), then
    `decodes` steps of both requests (tokens k and k + offset), stacked."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    session = Session(runner, seed=1)
    out = [torch.cat(session.step(list(enumerate(prompts)), all_logits=True)).float().cpu()]
    for k in range(decodes):
        out.append(torch.stack(session.step([(0, [k]), (1, [k + offset])])).float().cpu())
    return torch.cat(out)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@dataclass
class Request:
    rid: int
    pages: list[int] = field(default_factory=list)
    cached: int = 0
    rank: int = 0


class Session:
    """Allocates scattered pages and builds plans, like the router would."""

    def __init__(self, runner, seed: int = 0, dp_size: int = 1):
        self.runner = runner
        self.ps = runner.page_size
        # At most the first 4096 pages (a pool sized from GPU memory can have millions).
        self.free_by_rank = []
        for rank in range(dp_size):
            free = [rank * runner.num_pages + p for p in range(min(runner.num_pages, 4096))]
            random.Random(seed + rank).shuffle(free)
            self.free_by_rank.append(free)
        self.free = self.free_by_rank[0]
        self.reqs: dict[int, Request] = {}

    def step(
        self,
        work: list[tuple[int, list[int]]],
        all_logits: bool | set[int] = False,
        ranks: dict[int, int] | None = None,
    ) -> list[torch.Tensor]:
        """work = [(request id, tokens to run now)]. Returns per request the logits of its last
        token ([V]), or of all its tokens ([n, V]) with all_logits (True, or the set of request ids
        that want them). ranks: request id -> rank, for requests new in this step (default 0)."""
        plan = self.last_plan = self.plan(work, all_logits, ranks)
        logits = self.last_logits = self.runner.forward_plan(plan)
        for rid, toks in work:
            self.reqs[rid].cached += len(toks)
        return split_logits(logits, work, all_logits)

    def plan(self, work, all_logits: bool | set[int], ranks: dict[int, int] | None = None) -> Plan:
        """Allocates pages for the new tokens and builds the step's plan with the protocol's builder."""
        specs = []
        for rid, toks in work:
            r = self.reqs.setdefault(rid, Request(rid, rank=(ranks or {}).get(rid, 0)))
            while len(r.pages) * self.ps < r.cached + len(toks):
                r.pages.append(self.free_by_rank[r.rank].pop())
            every = wants_all(all_logits, rid)
            specs.append(
                RequestSpec(
                    id=rid,
                    input_ids=toks,
                    cached_len=r.cached,
                    pages=list(r.pages),
                    sample=not every,
                    prompt_logprobs=every,
                )  # fmt: skip
            )
        return build_plan(0, self.ps, specs)


def wants_all(all_logits: bool | set[int], rid: int) -> bool:
    return all_logits is True or (not isinstance(all_logits, bool) and rid in all_logits)


def split_logits(logits: torch.Tensor, work, all_logits: bool | set[int]) -> list[torch.Tensor]:
    """A step's logit rows (sampling rows of the requests in order, then the prompt-logprob rows)
    -> per request of `work`: [V] for one that samples, [n, V] for one that wants all its rows."""
    out: list[torch.Tensor | None] = [None] * len(work)
    row = 0
    for i, (rid, _) in enumerate(work):
        if not wants_all(all_logits, rid):
            out[i], row = logits[row], row + 1
    for i, (rid, toks) in enumerate(work):
        if wants_all(all_logits, rid):
            out[i], row = logits[row : row + len(toks)], row + len(toks)
    assert row == logits.shape[0], (row, logits.shape)
    return out


def quantize_checkpoint(src: str, dst: str, fmt: str, scope: str = "linear", **kw) -> None:
    """A quantised copy of the float checkpoint `src` (kernels.quant.make_checkpoint, ModelOpt-style;
    `kw` goes to it, e.g. exclude=[globs])."""
    from nsaserve.kernels.quant.make_checkpoint import make_checkpoint as quantize

    quantize(src, dst, fmt, scope=scope, **kw)


def dequantized_checkpoint(src: str, dst: str) -> None:
    """The float32 checkpoint transformers runs as the oracle for the quantised checkpoint `src`: every
    quantised weight dequantised with the kernels.quant references, scales dropped, and config.json
    without its quantization_config. Each module's precision is read from its tensors and must agree
    with the checkpoint's quantisation scheme."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    from nsaserve.kernels.quant import FP8_BLOCK, NVFP4, dequantize_fp8_block, dequantize_nvfp4, load_quant_scheme

    scheme = load_quant_scheme(src)
    tensors = {}
    for name in sorted(os.listdir(src)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, name)))
    scale_suffixes = (".weight_scale", ".weight_scale_2", ".weight_scale_inv", ".input_scale")
    out = {}
    for name, t in tensors.items():
        if name.endswith(scale_suffixes):
            continue
        module = name.removesuffix(".weight")
        if module + ".weight_scale" in tensors:
            assert scheme.precision_of(module) == NVFP4, module
            t = dequantize_nvfp4(t, tensors[module + ".weight_scale"], tensors[module + ".weight_scale_2"])
        elif module + ".weight_scale_inv" in tensors:
            assert scheme.precision_of(module) == FP8_BLOCK, module
            t = dequantize_fp8_block(t, tensors[module + ".weight_scale_inv"])
        out[name] = t
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config")
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)


def load_hf(path: str):
    """A saved checkpoint as a transformers model (eval, float32, eager attention)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
