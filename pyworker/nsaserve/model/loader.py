"""Load checkpoints (bf16/float32, NVFP4, block FP8) into the model, each rank reading only its
slices, from a weight source (weight_source.py: the safetensors files, or tensors drawn by the
GLM-5-shaped generator for `--load-format random`).

Every tensor of the checkpoint must map to a parameter and every parameter must be filled; either
failure is an error naming the tensors. The exceptions are the tensors the model declares ignorable
(NVFP4 input_scale: accepted when present, never required). Layers at index >= num_hidden_layers
(the MTP/NextN layer) are skipped, as transformers does. Quantised tensors keep their stored dtype
(a dtype mismatch is an error, never a conversion); float tensors are cast to the parameter's dtype.
After the last tensor, modules whose tensor-parallel slice is off their scale-group boundaries are
dequantised and sliced (quant_linear.py).
"""

from __future__ import annotations

import re

import torch
from tqdm import tqdm

from .quant_linear import QuantLinear
from .weight_source import SafetensorsSource, _read, checkpoint_files  # noqa: F401  (re-exported)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _check_and_copy(name: str, t: torch.Tensor, dst: torch.Tensor) -> None:
    if dst.dim() == 0 and t.numel() == 1:
        t = t.reshape(())  # per-tensor scales: some exports write shape [1], others []
    # Checked before the shape: a module stored in another precision than the quantisation config
    # says shows up here first, and this message says what is wrong.
    quantized = (torch.uint8, torch.float8_e4m3fn)
    if (dst.dtype in quantized or t.dtype in quantized) and t.dtype != dst.dtype:
        raise ValueError(
            f"tensor {name}: checkpoint dtype {t.dtype} != expected {dst.dtype} (quantised data is never "
            "converted; do the quantisation config and the stored tensors agree on this module's precision?)"
        )
    if tuple(t.shape) != tuple(dst.shape):
        raise ValueError(f"tensor {name}: checkpoint shape {tuple(t.shape)} != expected {tuple(dst.shape)}")
    dst.copy_(t.to(dst.dtype))


def _dequantize_unaligned_slices(model) -> None:
    """Replace every quantised Linear loaded whole (its TP split cuts scale groups) by a dense Linear
    holding this rank's slice."""
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantLinear) and module.slice_after_load is not None:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, module.to_dense_slice())


def load_weights(model, model_path: str | None = None, *, source=None, show_progress: bool = True) -> None:
    """Fill `model` from `source` (default: the safetensors files in model_path). A source has
    names() (every tensor it holds, in order) and read(name, tp_shard) (that tensor, or this rank's
    slice of it); only tensors this rank keeps are read."""
    if source is None:
        source = SafetensorsSource(model_path)
    cfg = model.cfg
    targets = model.weight_targets()
    ignorable = model.ignored_tensors()
    tied = cfg.tie_word_embeddings
    filled: set[str] = set()
    unexpected: list[str] = []
    try:
        entries = source.names()
        names = set(entries)
        if tied and "lm_head.weight" not in names:
            targets.pop("lm_head.weight")
        for name in tqdm(entries, desc="Loading weights", unit="tensor", disable=not show_progress):
            m = _LAYER.match(name)
            if m and int(m.group(1)) >= cfg.num_hidden_layers:
                continue  # MTP / NextN layer: not part of the main model
            if name in ignorable:
                continue
            if name not in targets:
                unexpected.append(name)
                continue
            filled.add(name)
            target = targets[name]
            if target is None:
                continue  # owned by another tensor-parallel rank
            param, index = target
            t = source.read(name, getattr(param, "tp_shard", None))
            _check_and_copy(name, t, param.data[index] if index else param.data)
    finally:
        source.close()
    if unexpected:
        raise ValueError(f"unexpected tensors in checkpoint ({len(unexpected)}): {sorted(unexpected)[:20]}")
    missing = sorted(set(targets) - filled)
    if missing:
        raise ValueError(f"tensors missing from checkpoint ({len(missing)}): {missing[:20]}")
    _dequantize_unaligned_slices(model)
    if tied and "lm_head.weight" not in names:
        v0, vn = model.lm_head.weight.tp_shard[1:]
        model.lm_head.weight.data.copy_(model.model.embed_tokens.weight.data[v0 : v0 + vn])
