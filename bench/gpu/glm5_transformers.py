"""transformers as the side-by-side peer: the same NVFP4 checkpoint, dequantised to bf16 in GPU
memory with the repository's reference dequantiser, run by transformers' own model class
(GlmMoeDsaForCausalLM, or DeepseekV32ForCausalLM when the installed transformers predates GLM-5)
with batched model.generate.

Also: a view of a checkpoint cut to fewer layers (symlinked shards, config with a smaller
num_hidden_layers), so both engines can run the same weights at a depth whose bf16 copy fits.
Our loader skips layers at or past num_hidden_layers, as it does for MTP layers.
"""

from __future__ import annotations

import json
import os
import time

import torch

from nsaserve.kernels.quant import dequantize_nvfp4
from nsaserve.kernels.quant.checkpoint_io import CheckpointReader


def truncated_view(src: str, dst: str, num_layers: int) -> str:
    """`dst` serves the first `num_layers` layers of the checkpoint in `src` (no data copied)."""
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if num_layers > cfg["num_hidden_layers"]:
        raise ValueError(f"{src} has {cfg['num_hidden_layers']} layers, asked for {num_layers}")
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name != "config.json" and not os.path.exists(os.path.join(dst, name)):
            os.symlink(os.path.abspath(os.path.join(src, name)), os.path.join(dst, name))
    cfg["num_hidden_layers"] = num_layers
    for key in ("mlp_layer_types", "layer_types", "indexer_types"):
        if key in cfg:
            cfg[key] = cfg[key][:num_layers]
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return dst


def transformers_config(model_path: str):
    """(config, class name) for transformers: GlmMoeDsa if this transformers knows it, else the
    same shapes as DeepseekV32 (same tensors; GLM-5's interleaved indexer RoPE is the difference)."""
    import transformers
    from transformers import AutoConfig

    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    cfg.pop("architectures", None)
    model_type = cfg.pop("model_type")
    # Per-layer type lists are derivable (every layer indexed, the first first_k_dense_replace
    # dense) and their vocabulary changes between transformers versions (5.17 rejects the
    # "indexed_attention" that later versions write): leave them to the installed version.
    n, k = cfg["num_hidden_layers"], cfg.get("first_k_dense_replace", 3)
    derivable = {
        "layer_types": None,
        "indexer_types": ["full"] * n,
        "mlp_layer_types": ["dense"] * k + ["sparse"] * (n - k),
    }
    for key, default in derivable.items():
        if key in cfg and (default is None or cfg[key] == default):
            del cfg[key]
    if hasattr(transformers, "GlmMoeDsaForCausalLM"):
        return AutoConfig.for_model(model_type, **cfg), "GlmMoeDsaForCausalLM"
    if hasattr(transformers, "DeepseekV32ForCausalLM"):
        for key in ("rope_interleave", "indexer_rope_interleave"):
            cfg.pop(key, None)
        return AutoConfig.for_model("deepseek_v32", **cfg), "DeepseekV32ForCausalLM"
    raise RuntimeError(f"transformers {transformers.__version__} has neither GlmMoeDsa nor DeepseekV32")


class _Dequantizer:
    """Checkpoint tensors by name, NVFP4 modules dequantised to `dtype` on `device` (the product
    e2m1 x e4m3 x fp32 scale is rounded once, to the dtype the model computes in, as ours does)."""

    def __init__(self, reader: CheckpointReader, device, dtype):
        self.reader, self.device, self.dtype = reader, device, dtype

    def has(self, name: str) -> bool:
        return name in self.reader.file_of

    def get(self, name: str) -> torch.Tensor:
        module = name.removesuffix(".weight")
        t = self.reader.get(name).to(self.device)
        if name.endswith(".weight") and self.has(module + ".weight_scale"):
            scale = self.reader.get(module + ".weight_scale").to(self.device)
            scale_2 = self.reader.get(module + ".weight_scale_2").to(self.device)
            t = dequantize_nvfp4(t, scale, scale_2, self.dtype)
        return t


def _fit(t: torch.Tensor, target: torch.Tensor, name: str) -> torch.Tensor:
    if t.shape == target.shape:
        return t
    if t.dim() >= 2 and t.transpose(-1, -2).shape == target.shape:
        return t.transpose(-1, -2)
    raise ValueError(f"{name}: checkpoint gives {tuple(t.shape)}, transformers wants {tuple(target.shape)}")


@torch.no_grad()
def load_transformers_model(model_path: str, device: str = "cuda", dtype=torch.bfloat16):
    """transformers' model with every weight taken from the checkpoint (NVFP4 dequantised).
    Fails if a parameter or persistent buffer has no source. Returns (model, class name)."""
    from transformers import AutoModelForCausalLM

    config, cls = transformers_config(model_path)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    missing = []
    with CheckpointReader(model_path) as reader:
        src = _Dequantizer(reader, device, dtype)
        for name, target in model.state_dict(keep_vars=True).items():
            if src.has(name):
                target.data.copy_(_fit(src.get(name), target, name))
            elif name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                prefix = name.rsplit(".", 1)[0] + "."
                for e in range(target.shape[0]):
                    if name.endswith("gate_up_proj"):
                        parts = [src.get(f"{prefix}{e}.{p}.weight") for p in ("gate_proj", "up_proj")]
                        w = torch.cat(parts, dim=0)
                    else:
                        w = src.get(f"{prefix}{e}.down_proj.weight")
                    target.data[e].copy_(_fit(w, target.data[e], name))
            else:
                missing.append(name)
    if missing:
        raise ValueError(f"transformers tensors with no checkpoint source ({len(missing)}): {missing[:10]}")
    return model, cls


@torch.no_grad()
def generate_throughput(model, prompts: list[list[int]], output_len: int, pad_id: int = 0) -> dict:
    """One batched greedy model.generate over all prompts (left-padded), exactly `output_len` new
    tokens each; wall time includes prefill."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    # Warm-up, not timed (our side gets the same: the bench's warm-up requests): first-use
    # library initialisation and kernel selection land here.
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, do_sample=False,
                   pad_token_id=pad_id)  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
        do_sample=False, pad_token_id=pad_id,
    )  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    generated = (out.shape[1] - width) * len(prompts)
    inputs = sum(len(p) for p in prompts)
    return {
        "batch": len(prompts),
        "duration_s": seconds,
        "output_tokens": generated,
        "input_tokens": inputs,
        "output_throughput": generated / seconds,
        "total_throughput": (generated + inputs) / seconds,
        "first_sequence_tail": out[0, width:].tolist()[:16],
    }
