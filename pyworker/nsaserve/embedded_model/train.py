"""Trains the embedded default model and writes it as a Hugging Face model directory.

    python -m nsaserve.embedded_model.train --out pyworker/nsaserve/embedded_model

Deterministic (fixed seeds, deterministic kernels, fixed thread count); a few minutes on two CPU cores.
Schedule: a dense warm-up (every causal token attended, the indexer fitted to the attention), then sparse
training with the indexer's top-k selection active, as it is at serving time. See dsa_training.py for the
auxiliary losses and the robustness noise.
"""

import argparse
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, GlmMoeDsaForCausalLM

from . import dsa_training
from .corpus import training_sample, zen_text
from .recital import check_all
from .tiny_config import tiny_config
from .tokenizer_build import build_hf_tokenizer, stop_token_ids

SEED = 1234
THREADS = 2
STEPS = 240
DENSE_STEPS = 60  # dense warm-up before the indexer's selection is switched on
BATCH = 8
MICRO_BATCH = 4  # rows padded together
LR = 3e-3
WARMUP = 30
MARGIN = 12.0  # hinge target for (expected logit - best other logit)
MARGIN_WEIGHT = 0.2
KL_WEIGHT = 1.0
ROUTER_WEIGHT = 1.0
BALANCE_WEIGHT = 0.5
GUMBEL_SCALE = 0.5
FP8_EVERY = 2  # every other sparse step simulates an FP8 KV cache


def encode_sample(rng: random.Random, tokenizer, text: str) -> tuple[list[int], list[int]]:
    """Token ids and labels; labels are -100 on the prompt (the model only learns to produce the target)."""
    sample = training_sample(rng, text)
    prompt = tokenizer.encode(sample.prompt, add_special_tokens=False)
    target = tokenizer.encode(sample.target, add_special_tokens=False)
    return prompt + target, [-100] * len(prompt) + target


def pad(rows: list[tuple[list[int], list[int]]], pad_id: int):
    length = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), length), pad_id)
    labels = torch.full((len(rows), length), -100)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, (ids, row_labels) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.tensor(row_labels)
        attention_mask[i, : len(ids)] = 1
    return input_ids, labels, attention_mask


def micro_batches(rng: random.Random, tokenizer, text: str) -> list:
    """One step's samples, sorted by length and split in groups of similar length to pad less."""
    rows = sorted((encode_sample(rng, tokenizer, text) for _ in range(BATCH)), key=lambda row: len(row[0]))
    return [pad(rows[i : i + MICRO_BATCH], tokenizer.pad_token_id) for i in range(0, BATCH, MICRO_BATCH)]


def lm_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross entropy and a margin hinge: CE alone grows margins only logarithmically."""
    logits = logits[:, :-1].float()
    labels = labels[:, 1:]
    keep = labels != -100
    logits, labels = logits[keep], labels[keep]
    ce = F.cross_entropy(logits, labels)
    expected = logits.gather(-1, labels[:, None]).squeeze(-1)
    others = logits.scatter(-1, labels[:, None], float("-inf")).amax(-1)
    hinge = F.relu(MARGIN - (expected - others)).mean()
    return ce, hinge


def learning_rate(step: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, STEPS - WARMUP)
    return LR * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def build_model(tokenizer) -> GlmMoeDsaForCausalLM:
    eos_ids = stop_token_ids(tokenizer)
    config = tiny_config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
    )
    config._attn_implementation = "eager"  # eager returns the attention probabilities the indexer loss needs
    model = GlmMoeDsaForCausalLM(config)
    # A fixed, non-zero expert-score correction bias (a buffer, not trained) so servers must apply it to pick
    # the same experts; zero would hide a missing bias.
    for layer in model.model.layers:
        if isinstance(layer.mlp, dsa_training.glm.GlmMoeDsaMoE):
            n = layer.mlp.gate.e_score_correction_bias.numel()
            layer.mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.05, 0.05, n))
    return model


def train(out: Path) -> None:
    torch.set_num_threads(THREADS)
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    rng = random.Random(SEED)
    tokenizer = build_hf_tokenizer()
    text = zen_text()
    model = build_model(tokenizer)
    state = dsa_training.DsaTrainingState(generator=torch.Generator().manual_seed(SEED))
    undo_training_hooks = dsa_training.attach(model, state)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    started, cpu_started = time.time(), time.process_time()
    for step in range(STEPS):
        state.sparse = step >= DENSE_STEPS
        state.gumbel_scale = GUMBEL_SCALE if state.sparse else 0.0
        state.fp8 = state.sparse and step % FP8_EVERY == 0
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step)
        optimizer.zero_grad(set_to_none=True)
        batches = micro_batches(rng, tokenizer, text)
        for input_ids, labels, attention_mask in batches:
            state.clear()
            outputs = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, output_attentions=True)
            ce, hinge = lm_losses(outputs.logits, labels)
            kl = dsa_training.indexer_kl(outputs.attentions, state, attention_mask.float())
            router = torch.stack(state.router_gap_losses).mean()
            balance = torch.stack(state.router_balance_losses).mean()
            loss = ce + MARGIN_WEIGHT * hinge + KL_WEIGHT * kl + ROUTER_WEIGHT * router + BALANCE_WEIGHT * balance
            (loss / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 10 == 0 or step == STEPS - 1:
            print(
                f"step {step:4d} {'sparse' if state.sparse else 'dense '} ce {ce.item():.4f} hinge {hinge.item():.3f}"
                f" kl {kl.item():.3f} router {router.item():.4f} balance {balance.item():.3f} ({time.time() - started:.0f}s)",
                flush=True,
            )
    for undo in undo_training_hooks:
        undo()
    model.eval()
    model.config._attn_implementation = "sdpa"
    report(model, tokenizer)
    save(model, tokenizer, out)
    print(f"trained in {time.time() - started:.0f}s wall, {time.process_time() - cpu_started:.0f}s CPU; wrote {out}")


def report(model, tokenizer) -> None:
    checks = check_all(model, tokenizer)
    for check in checks:
        print(
            f"  {check.name:10s} exact={check.exact} min_margin={check.min_margin:.2f} first_error={check.first_error}"
        )
    print(f"recital length {len(tokenizer.encode(zen_text()))} tokens; index_topk {model.config.index_topk}")
    if not all(check.exact for check in checks):
        raise SystemExit("the trained model does not recite exactly")


def save(model, tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out, save_jinja_files=False)
    generation = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=stop_token_ids(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    generation.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write the model into")
    train(parser.parse_args().out)


if __name__ == "__main__":
    main()
