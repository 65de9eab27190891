"""Load BF16/float32 safetensors checkpoints into the model, each rank reading only its slices.

Every tensor of the checkpoint must map to a parameter and every parameter must be filled; either
failure is an error naming the tensors. Layers at index >= num_hidden_layers (the MTP/NextN layer)
are skipped, as transformers does.
"""

from __future__ import annotations

import glob
import json
import os
import re

import torch
from safetensors import safe_open
from tqdm import tqdm

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def checkpoint_files(model_path: str) -> list[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_path, n) for n in names]
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_path}")
    return files


def _read(handle, name: str, shard) -> torch.Tensor:
    """The tensor, or only this rank's slice of it (tp_shard = (dim, start, length))."""
    if shard is None:
        return handle.get_tensor(name)
    dim, start, length = shard
    sl = handle.get_slice(name)
    index = [slice(None)] * len(sl.get_shape())
    index[dim] = slice(start, start + length)
    return sl[tuple(index)]


def load_weights(model, model_path: str, *, show_progress: bool = True) -> None:
    cfg = model.cfg
    targets = model.weight_targets()
    tied = cfg.tie_word_embeddings
    filled: set[str] = set()
    unexpected: list[str] = []
    entries = []
    for path in checkpoint_files(model_path):
        with safe_open(path, framework="pt") as f:
            entries += [(path, n) for n in f.keys()]
    names = {n for _, n in entries}
    if tied and "lm_head.weight" not in names:
        targets.pop("lm_head.weight")
    handles = {}
    try:
        for path, name in tqdm(entries, desc="Loading weights", unit="tensor", disable=not show_progress):
            m = _LAYER.match(name)
            if m and int(m.group(1)) >= cfg.num_hidden_layers:
                continue  # MTP / NextN layer: not part of the main model
            if name not in targets:
                unexpected.append(name)
                continue
            filled.add(name)
            target = targets[name]
            if target is None:
                continue  # owned by another tensor-parallel rank
            param, index = target
            if path not in handles:
                handles[path] = safe_open(path, framework="pt")
            t = _read(handles[path], name, getattr(param, "tp_shard", None))
            dst = param.data[index] if index else param.data
            if tuple(t.shape) != tuple(dst.shape):
                raise ValueError(f"tensor {name}: checkpoint shape {tuple(t.shape)} != expected {tuple(dst.shape)}")
            dst.copy_(t.to(dst.dtype))
    finally:
        handles.clear()
    if unexpected:
        raise ValueError(f"unexpected tensors in checkpoint ({len(unexpected)}): {sorted(unexpected)[:20]}")
    missing = sorted(set(targets) - filled)
    if missing:
        raise ValueError(f"tensors missing from checkpoint ({len(missing)}): {missing[:20]}")
    if tied and "lm_head.weight" not in names:
        v0, vn = model.lm_head.weight.tp_shard[1:]
        model.lm_head.weight.data.copy_(model.model.embed_tokens.weight.data[v0 : v0 + vn])
