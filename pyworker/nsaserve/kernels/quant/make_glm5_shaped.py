"""Write a GLM-5-shaped checkpoint with random weights, NVFP4 routed experts and BF16 everything
else, as a ModelOpt export would store it (what the GLM-5 NVFP4 release quantises).

    python -m nsaserve.kernels.quant.make_glm5_shaped --dst DIR --moe-layers 6 [--device cuda]
        [--dense-layers 3] [--seed 0] [--set hidden_size=256 ...] [--tiny] [--max-shard-gb 4] [--config-only]

Shapes are GLM-5's (hidden 6144, 64 heads, q_lora 2048, kv_lora 512, nope/rope/v 192/64/256,
indexer 32 x 128 with top-k 2048, 256 experts top-8 of intermediate 2048 plus one shared expert,
dense intermediate 12288, vocabulary 154880); only the depth differs: ``--dense-layers`` dense
layers then ``--moe-layers`` MoE layers. ``--set key=value`` overrides any config field and
``--tiny`` applies TINY_OVERRIDES, a scale-down for CPU tests.

Weights are drawn on ``--device``, one tensor at a time: normal with std 1/sqrt(fan_in) for every
Linear (so each projection keeps unit-scale activations), unit norms, embeddings of std 1, a small
random router correction bias. Routed experts are drawn in bf16 and quantised with the
repository's NVFP4 quantiser (gate and up of one expert share weight_scale_2, as ModelOpt exports
do). Every tensor has its own generator, seeded from (seed, tensor name), and every routed expert
one, seeded from (seed, layer, expert): any tensor can be drawn alone, in any order, and equals the
written one (on the same device type). That is what ``--load-format random`` relies on
(model/weight_source.py): each rank draws the tensors it owns on its own GPU, no checkpoint on
disk. ``--config-only`` writes the model directory for it: config and tokenizer, no tensors.

Output: config.json with a ModelOpt ``quantization_config``,
hf_quant_config.json, sharded safetensors with an index, and a generated tokenizer: the embedded
model's byte-level BPE widened to the vocabulary size with plain word tokens (every id decodes;
benchmarks send token ids, so nothing needs to encode to the added ones).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import zlib
from pathlib import Path

import torch

from .checkpoint_io import ShardedWriter
from .make_checkpoint import _quantization_config
from .nvfp4 import nvfp4_global_scale, quantize_nvfp4
from .precision import ALWAYS_BF16, BF16, NVFP4

EMBEDDED_MODEL = Path(__file__).resolve().parents[2] / "embedded_model"

# GLM-5 (zai-org/GLM-5 config.json, transformers' GlmMoeDsaConfig defaults); num_hidden_layers,
# mlp_layer_types and indexer_types are filled in from the requested depth.
GLM5_CONFIG = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "dtype": "bfloat16",
    "hidden_act": "silu",
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "head_dim": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "qk_head_dim": 256,
    "v_head_dim": 256,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "index_topk": 2048,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 202752,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "rope_interleave": True,
    "indexer_rope_interleave": True,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "use_cache": True,
    "bos_token_id": 2,
    "eos_token_id": [0, 4, 5],
    "pad_token_id": 0,
}

# Small enough for a CPU test in seconds, with every structural feature kept: MLA with absorbed
# decode, indexer with top-k below the context, NVFP4 experts (dims multiples of 16), shared expert.
TINY_OVERRIDES = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "q_lora_rank": 64,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "qk_head_dim": 48,
    "v_head_dim": 32,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "index_topk": 32,
    "index_n_heads": 16,
    "index_head_dim": 32,
    "max_position_embeddings": 4096,
}

_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}


class _BackgroundShardWriter(ShardedWriter):
    """ShardedWriter whose shards are written by background threads, in the safetensors format
    written directly (8-byte header length, JSON header, raw bytes): file writes release the GIL,
    so drawing and quantising the next tensors on the GPU overlaps the disk, and several shards
    are copied into the page cache at once. At most `in_flight` shards wait in host memory."""

    def __init__(self, directory: str, max_shard_bytes: int, in_flight: int = 3):
        super().__init__(directory, max_shard_bytes)
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=in_flight)
        self._in_flight = in_flight
        self._jobs = []

    def _flush(self) -> None:
        while len(self._jobs) >= self._in_flight:
            self._jobs.pop(0).result()
        temp_name = f"partial-{len(self._shards):05d}.safetensors"
        self._shards.append((temp_name, list(self._pending)))
        self._jobs.append(self._pool.submit(_write_safetensors, os.path.join(self.directory, temp_name), self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        if self._pending or not self._shards:
            self._flush()
        for job in self._jobs:
            job.result()
        self._pool.shutdown()
        self._jobs, self._pending = [], {}
        return super().close()


def _write_safetensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    header, offset = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors.values():
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")


def glm5_config(moe_layers: int, dense_layers: int = 3, overrides: dict | None = None) -> dict:
    """config.json contents (without quantization_config) for the requested depth."""
    if moe_layers < 0 or dense_layers < 0 or moe_layers + dense_layers < 1:
        raise ValueError(f"need at least one layer, got {dense_layers} dense + {moe_layers} MoE")
    cfg = dict(GLM5_CONFIG) | dict(overrides or {})
    n = dense_layers + moe_layers
    cfg["num_hidden_layers"] = n
    cfg["first_k_dense_replace"] = dense_layers
    cfg["mlp_layer_types"] = ["dense"] * dense_layers + ["sparse"] * moe_layers
    cfg["layer_types"] = ["indexed_attention"] * n
    cfg["indexer_types"] = ["full"] * n
    cfg["qk_head_dim"] = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    return cfg


def dense_tensor_shapes(cfg: dict) -> list[tuple[str, list[int], str]]:
    """(name, shape, kind) of every tensor except the routed experts, in file order. kind is
    "linear" (normal, std 1/sqrt(fan_in)), "ones", "zeros", "embed" (std 1) or "bias" (router
    correction bias, float32)."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    heads, qk, v = cfg["num_attention_heads"], cfg["qk_head_dim"], cfg["v_head_dim"]
    nope, rope, rank, qr = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["kv_lora_rank"], cfg["q_lora_rank"]
    ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
    out = [("model.embed_tokens.weight", [V, H], "embed")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out += [
            (p + "input_layernorm.weight", [H], "ones"),
            (p + "post_attention_layernorm.weight", [H], "ones"),
            (a + "q_a_proj.weight", [qr, H], "linear"),
            (a + "q_a_layernorm.weight", [qr], "ones"),
            (a + "q_b_proj.weight", [heads * qk, qr], "linear"),
            (a + "kv_a_proj_with_mqa.weight", [rank + rope, H], "linear"),
            (a + "kv_a_layernorm.weight", [rank], "ones"),
            (a + "kv_b_proj.weight", [heads * (nope + v), rank], "linear"),
            (a + "o_proj.weight", [H, heads * v], "linear"),
            (a + "indexer.wq_b.weight", [ih * idim, qr], "linear"),
            (a + "indexer.wk.weight", [idim, H], "linear"),
            (a + "indexer.k_norm.weight", [idim], "ones"),
            (a + "indexer.k_norm.bias", [idim], "zeros"),
            (a + "indexer.weights_proj.weight", [ih, H], "linear"),
        ]
        m = p + "mlp."
        if cfg["mlp_layer_types"][i] == "dense":
            inter = cfg["intermediate_size"]
            out += [
                (m + "gate_proj.weight", [inter, H], "linear"),
                (m + "up_proj.weight", [inter, H], "linear"),
                (m + "down_proj.weight", [H, inter], "linear"),
            ]
        else:
            inter = cfg["moe_intermediate_size"] * cfg["n_shared_experts"]
            out += [
                (m + "gate.weight", [cfg["n_routed_experts"], H], "linear"),
                (m + "gate.e_score_correction_bias", [cfg["n_routed_experts"]], "bias"),
                (m + "shared_experts.gate_proj.weight", [inter, H], "linear"),
                (m + "shared_experts.up_proj.weight", [inter, H], "linear"),
                (m + "shared_experts.down_proj.weight", [H, inter], "linear"),
            ]
    out.append(("model.norm.weight", [H], "ones"))
    if not cfg.get("tie_word_embeddings"):  # tied: the checkpoint has no lm_head
        out.append(("lm_head.weight", [V, H], "linear"))
    return out


def tensor_layout(cfg: dict) -> list[tuple[str, list[int], str] | int]:
    """The checkpoint in file order: dense_tensor_shapes' entries, and after each MoE layer's
    shared-expert tensors that layer's index, standing for all its routed experts."""
    if "sparse" in cfg["mlp_layer_types"] and not cfg["n_shared_experts"]:
        raise ValueError("n_shared_experts = 0 is not supported by the GLM-5-shaped generator")
    out = []
    for entry in dense_tensor_shapes(cfg):
        out.append(entry)
        if entry[0].endswith("shared_experts.down_proj.weight"):
            out.append(int(entry[0].split(".")[2]))
    return out


def tensor_seed(seed: int, key: str) -> int:
    """The generator seed of one tensor (key = its name) or one expert: a stable function of both
    (crc32, never Python's per-process salted hash()), so every process draws the same values."""
    return zlib.crc32(f"{seed}:{key}".encode())


def _generator(seed: int, key: str, device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(tensor_seed(seed, key))


def draw_tensor(name: str, shape: list[int], kind: str, seed: int, device) -> torch.Tensor:
    """One tensor of dense_tensor_shapes, drawn alone from its own generator."""
    return _draw(shape, kind, _generator(seed, name, device), device)


def expert_tensor_names(layer: int, expert: int, precision: str = NVFP4) -> list[str]:
    """The tensors one routed expert has on disk, in file order: per part its weight, and for
    NVFP4 its two scales and the (unused by W4A16) input_scale."""
    suffixes = (".weight", ".weight_scale", ".weight_scale_2", ".input_scale") if precision == NVFP4 else (".weight",)
    prefix = f"model.layers.{layer}.mlp.experts.{expert}."
    return [prefix + part + s for part in EXPERT_PARTS for s in suffixes]


def draw_expert(cfg: dict, layer: int, expert: int, seed: int, device, precision: str = NVFP4) -> dict:
    """name -> tensor for every tensor of one routed expert (expert_tensor_names order), from one
    generator seeded by (seed, layer, expert): gate+up drawn as one [2I, H] block, then down.
    NVFP4 (what the generator writes) or BF16 (the same draw, stored as a bf16 checkpoint would)."""
    if precision not in (NVFP4, BF16):
        raise ValueError(f"routed experts can be drawn as {NVFP4} or {BF16}, not {precision}")
    H, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    gen = _generator(seed, f"model.layers.{layer}.mlp.experts.{expert}", device)
    prefix = f"model.layers.{layer}.mlp.experts.{expert}."
    gate_up = (torch.randn([2 * inter, H], generator=gen, device=device) * H**-0.5).to(torch.bfloat16)
    down = (torch.randn([H, inter], generator=gen, device=device) * inter**-0.5).to(torch.bfloat16)
    rows = {"gate_proj": slice(0, inter), "up_proj": slice(inter, None), "down_proj": slice(None)}
    out = {}
    if precision == BF16:
        for part, w in (("gate_proj", gate_up), ("up_proj", gate_up), ("down_proj", down)):
            out[prefix + part + ".weight"] = w[rows[part]].clone()
        return out
    # gate and up share one global scale (fused gate-up kernels apply one); quantising them
    # as one [2I, H] tensor gives exactly that, and rows split back without touching scales.
    q13 = quantize_nvfp4(gate_up, nvfp4_global_scale(gate_up))
    q2 = quantize_nvfp4(down)
    for part, q in (("gate_proj", q13), ("up_proj", q13), ("down_proj", q2)):
        # clone: slices (and the shared scale) must not share storage in one safetensors file
        out[prefix + part + ".weight"] = q.weight[rows[part]].clone()
        out[prefix + part + ".weight_scale"] = q.weight_scale[rows[part]].clone()
        out[prefix + part + ".weight_scale_2"] = q.weight_scale_2.clone()
        out[prefix + part + ".input_scale"] = torch.ones((), dtype=torch.float32, device=device)
    return out


def _draw(shape: list[int], kind: str, gen: torch.Generator, device) -> torch.Tensor:
    if kind == "ones":
        return torch.ones(shape, dtype=torch.bfloat16, device=device)
    if kind == "zeros":
        return torch.zeros(shape, dtype=torch.bfloat16, device=device)
    if kind == "bias":
        return 0.01 * torch.randn(shape, generator=gen, dtype=torch.float32, device=device)
    std = 1.0 if kind == "embed" else shape[-1] ** -0.5
    return (torch.randn(shape, generator=gen, dtype=torch.float32, device=device) * std).to(torch.bfloat16)


def write_tokenizer(dst: str, vocab_size: int) -> None:
    """tokenizer.json / tokenizer_config.json / generation_config.json: the embedded model's
    byte-level BPE (its special tokens, merges and chat template) with plain tokens "Ġw<id>"
    appended up to `vocab_size` ids ("Ġ" is the byte-level space)."""
    with open(EMBEDDED_MODEL / "tokenizer.json") as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in tok["added_tokens"]}
    if vocab_size < len(taken):
        raise ValueError(f"vocab_size {vocab_size} is below the base tokenizer's {len(taken)} tokens")
    for i in range(vocab_size):
        if i not in taken:
            word = f"\u0120w{i}"
            if word in vocab:
                raise ValueError(f"generated token {word!r} is already in the base vocabulary")
            vocab[word] = i
    with open(os.path.join(dst, "tokenizer.json"), "w") as f:
        json.dump(tok, f, ensure_ascii=False)
    for name in ("tokenizer_config.json", "generation_config.json"):
        shutil.copy2(EMBEDDED_MODEL / name, os.path.join(dst, name))


def checkpoint_bytes_estimate(cfg: dict) -> int:
    """Bytes the checkpoint will take (bf16 tensors plus NVFP4 experts), for a disk-space check."""
    dense = sum(2 * _numel(shape) for _, shape, _ in dense_tensor_shapes(cfg))
    H, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    per_expert = 3 * H * inter * (0.5 + 1 / 16) + 3 * 8
    n_moe = cfg["mlp_layer_types"].count("sparse")
    return int(dense + n_moe * cfg["n_routed_experts"] * per_expert)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def write_model_files(dst: str, cfg: dict) -> None:
    """Everything of the model directory but the tensors: config.json with the ModelOpt
    quantization_config, hf_quant_config.json and the tokenizer files."""
    # Every Linear outside the routed experts is bf16: name them the way the release does
    # (ALWAYS_BF16 + globs for attention, dense MLPs and shared experts).
    ignore = list(ALWAYS_BF16) + ["*self_attn*", "*shared_experts*"]
    ignore += [f"model.layers.{i}.mlp" for i, t in enumerate(cfg["mlp_layer_types"]) if t == "dense"]
    qc, hf = _quantization_config("nvfp4", ignore)
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg | {"quantization_config": qc}, f, indent=2)
    with open(os.path.join(dst, "hf_quant_config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    write_tokenizer(dst, cfg["vocab_size"])


def _refuse_existing_checkpoint(dst: str) -> None:
    if os.path.isdir(dst) and any(n.endswith(".safetensors") for n in os.listdir(dst)):
        raise FileExistsError(f"{dst} already holds a checkpoint")


def make_glm5_config_dir(dst: str, moe_layers: int, dense_layers: int = 3, *, overrides: dict | None = None) -> dict:
    """The model directory without tensors (for ``--load-format random``, which draws them on the
    workers' devices); returns the config written."""
    _refuse_existing_checkpoint(dst)
    cfg = glm5_config(moe_layers, dense_layers, overrides)
    tensor_layout(cfg)  # a config the generator cannot draw fails here, not at serve time
    write_model_files(dst, cfg)
    return cfg


def make_glm5_shaped(
    dst: str,
    moe_layers: int,
    dense_layers: int = 3,
    *,
    overrides: dict | None = None,
    device: str = "cpu",
    seed: int = 0,
    max_shard_bytes: int = 4 << 30,
    progress: bool = False,
) -> dict:
    """Write the checkpoint to `dst` (must not hold one); returns the config written."""
    _refuse_existing_checkpoint(dst)
    cfg = glm5_config(moe_layers, dense_layers, overrides)
    os.makedirs(dst, exist_ok=True)
    need = checkpoint_bytes_estimate(cfg)
    free = shutil.disk_usage(dst).free
    if need > free:
        raise OSError(f"{dst}: the checkpoint needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
    layout = tensor_layout(cfg)
    writer = _BackgroundShardWriter(dst, max_shard_bytes)
    t0 = time.perf_counter()
    with torch.no_grad():
        for entry in layout:
            if not isinstance(entry, int):
                name, shape, kind = entry
                writer.add(name, draw_tensor(name, shape, kind, seed, device))
                continue
            for e in range(cfg["n_routed_experts"]):
                for name, t in draw_expert(cfg, entry, e, seed, device).items():
                    writer.add(name, t)
            if progress:
                print(f"layer {entry}: experts written, {writer.total_bytes / 1e9:.1f} GB, "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)  # fmt: skip
    writer.close()
    write_model_files(dst, cfg)
    if progress:
        print(f"wrote {writer.total_bytes / 1e9:.2f} GB to {dst} in {time.perf_counter() - t0:.1f} s", flush=True)
    return cfg


def _parse_set(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--set wants key=value, got {item!r}")
        out[key] = json.loads(value)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m nsaserve.kernels.quant.make_glm5_shaped",
        description="Write a GLM-5-shaped random checkpoint: NVFP4 routed experts, bf16 elsewhere.",
    )
    p.add_argument("--dst", required=True, help="output directory")
    p.add_argument("--moe-layers", type=int, required=True, help="MoE layers after the dense ones")
    p.add_argument("--dense-layers", type=int, default=3, help="dense layers first (GLM-5: 3)")
    p.add_argument("--device", default="cpu", help="device drawing and quantising the weights, e.g. cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="apply the tiny scale-down (for CPU tests)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="override a config field")
    p.add_argument("--max-shard-gb", type=float, default=4.0, help="largest output shard in GiB")
    p.add_argument("--quiet", action="store_true")
    p.add_argument(
        "--config-only",
        action="store_true",
        help="write config and tokenizer but no tensors: a model directory for `serve --load-format random`",
    )
    args = p.parse_args(argv)
    overrides = (dict(TINY_OVERRIDES) if args.tiny else {}) | _parse_set(args.set)
    if args.config_only:
        make_glm5_config_dir(args.dst, args.moe_layers, args.dense_layers, overrides=overrides)
        return
    make_glm5_shaped(
        args.dst,
        args.moe_layers,
        args.dense_layers,
        overrides=overrides,
        device=args.device,
        seed=args.seed,
        max_shard_bytes=int(args.max_shard_gb * (1 << 30)),
        progress=not args.quiet,
    )


if __name__ == "__main__":
    main()
