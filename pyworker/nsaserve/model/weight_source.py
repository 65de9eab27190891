"""Where the loader's tensors come from: safetensors files, or the GLM-5-shaped generator.

The loader (loader.py) walks a source's tensor names, decides what each one is (this rank's
parameter, another rank's expert, an ignorable input_scale, an unexpected tensor) and asks the
source only for the tensors this rank keeps, as this rank's slice. Two sources:

- SafetensorsSource: a checkpoint on disk; each slice is read from its file alone.
- GeneratedSource (`--load-format random`): no checkpoint; every tensor is drawn on the model's
  device by kernels/quant/make_glm5_shaped.py's per-tensor / per-expert generators, so it equals
  what that script would have written for this config and seed, without the disk (a full-depth
  GLM-5-NVFP4 is ~470 GB). Everything after the draw (name mapping, slicing, dtype and shape checks,
  dequantising unaligned slices, tied embeddings) is the loader's normal path.
"""

from __future__ import annotations

import glob
import json
import os
import re

import torch
from safetensors import safe_open

from ..kernels.quant import BF16, NVFP4
from ..kernels.quant import make_glm5_shaped as gen

LOAD_FORMATS = ("safetensors", "random")


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


class SafetensorsSource:
    """The checkpoint's *.safetensors files (per the index when there is one), opened lazily."""

    def __init__(self, model_path: str):
        self._file_of: dict[str, str] = {}
        for path in checkpoint_files(model_path):
            with safe_open(path, framework="pt") as f:
                self._file_of.update((n, path) for n in f.keys())
        self._handles = {}

    def names(self) -> list[str]:
        return list(self._file_of)

    def read(self, name: str, shard) -> torch.Tensor:
        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        return _read(self._handles[path], name, shard)

    def close(self) -> None:
        self._handles.clear()


_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


class GeneratedSource:
    """make_glm5_shaped's tensors for `cfg` (a ModelConfig), drawn on demand on `device`.

    Dense tensors are drawn whole, then sliced to the rank's shard (every rank draws the same
    values: one seeded generator per tensor). A routed expert's tensors come from one draw (gate
    and up are quantised together), kept only until the next expert is asked for, so at most one
    tensor and one expert are alive beyond the model itself. Nothing is drawn that is not read:
    the loader never reads another rank's experts or the ignored input_scales.

    The generator writes NVFP4 routed experts and bf16 everything else; a config that quantises
    like that, or not at all (experts then drawn as bf16, the same draw unquantised), is
    supported. Any other precision is a ValueError naming the module."""

    def __init__(self, cfg, device: torch.device, seed: int = 0):
        self.device, self.seed = torch.device(device), seed
        self.gen_cfg = generator_config(cfg)
        self._dense: dict[str, tuple[list[int], str]] = {}
        self._expert_precision: dict[int, str] = {}
        self._names: list[str] = []
        for entry in gen.tensor_layout(self.gen_cfg):
            if isinstance(entry, int):
                precision = self._expert_precision[entry] = _expert_precision(cfg, entry)
                for e in range(cfg.n_routed_experts):
                    self._names += gen.expert_tensor_names(entry, e, precision)
            else:
                name, shape, kind = entry
                if kind == "linear" and not name.endswith(".mlp.gate.weight"):  # the router is no Linear
                    _require(cfg, name.removesuffix(".weight"), BF16)
                self._dense[name] = (shape, kind)
                self._names.append(name)
        self._expert_key: tuple[int, int] | None = None
        self._expert: dict[str, torch.Tensor] = {}
        self.experts_drawn: list[tuple[int, int]] = []  # (layer, expert), in draw order

    def names(self) -> list[str]:
        return list(self._names)

    def read(self, name: str, shard) -> torch.Tensor:
        if name in self._dense:
            shape, kind = self._dense[name]
            t = gen.draw_tensor(name, shape, kind, self.seed, self.device)
            return t if shard is None else t.narrow(shard[0], shard[1], shard[2])
        m = _EXPERT.match(name)
        if m is None:
            raise KeyError(f"{name} is not a tensor of the generated model")
        key = (int(m.group(1)), int(m.group(2)))
        if key != self._expert_key:
            self._expert = {}  # free the previous expert before drawing the next
            self._expert = self.draw_expert(*key)
            self._expert_key = key
        return self._expert.pop(name)

    def draw_expert(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        self.experts_drawn.append((layer, expert))
        precision = self._expert_precision[layer]
        return gen.draw_expert(self.gen_cfg, layer, expert, self.seed, self.device, precision)

    def close(self) -> None:
        self._expert, self._expert_key = {}, None


def generator_config(cfg) -> dict:
    """The dict make_glm5_shaped's layout functions read, from a parsed ModelConfig (GLM-5 and
    DeepSeek-V3.2 configs both: the per-layer dense/MoE split is the config's own, resolved from
    mlp_layer_types or first_k_dense_replace)."""
    keys = (
        "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
        "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
        "qk_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts", "index_n_heads", "index_head_dim",
        "tie_word_embeddings",
    )  # fmt: skip
    return {k: getattr(cfg, k) for k in keys} | {"mlp_layer_types": list(cfg.mlp_layer_types)}


def _require(cfg, module: str, precision: str) -> None:
    found = cfg.quant.precision_of(module)
    if found != precision:
        raise ValueError(
            f"--load-format random: the config stores {module} as {found}, but the GLM-5-shaped generator "
            f"draws it as {precision} (it draws NVFP4 routed experts and bf16 everything else, or all bf16)"
        )


def _expert_precision(cfg, layer: int) -> str:
    """The precision layer `layer`'s routed experts are drawn in: the config's (one per layer; the
    model's expert stacks check that), NVFP4 or BF16."""
    precision = cfg.quant.precision_of(f"model.layers.{layer}.mlp.experts.0.gate_proj")
    if precision not in (NVFP4, BF16):
        _require(cfg, f"model.layers.{layer}.mlp.experts.0.gate_proj", NVFP4)
    return precision


def open_weight_source(load_format: str, model_path: str, cfg, device: torch.device, seed: int = 0):
    """The source for `load_format` ("safetensors": the files in model_path; "random": drawn by the
    generator with `seed` for the config read from model_path)."""
    if load_format == "safetensors":
        return SafetensorsSource(model_path)
    if load_format == "random":
        return GeneratedSource(cfg, device, seed)
    raise ValueError(f"unknown load_format {load_format!r}; choose one of {LOAD_FORMATS}")
