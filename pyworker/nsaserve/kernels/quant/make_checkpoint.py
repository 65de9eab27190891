"""Quantise a bf16/float Hugging Face checkpoint into a ModelOpt-style NVFP4 or a block-FP8 checkpoint.

    python -m nsaserve.kernels.quant.make_checkpoint --src DIR --dst DIR --format nvfp4 \
        [--exclude GLOB ...] [--scope linear|experts] [--device cuda] [--max-shard-gb 4]

What gets quantised: every 2-D ``*.weight`` of a Linear module, except modules in ``ALWAYS_BF16``
(router, indexer weights_proj, lm_head, embeddings), modules matching ``--exclude`` and, for NVFP4,
weights whose input dimension is not a multiple of 16, and the MTP layers (``model.layers.{i}`` with
i >= config.json's ``num_hidden_layers``; released NVFP4 checkpoints ship them in bf16 or not at all;
``--quantize-mtp`` overrides). ``--scope experts`` quantises only routed
experts (``*.mlp.experts.*``), which is what the GLM-5 NVFP4 release does; the default ``linear``
also quantises attention, shared experts and dense MLPs, like NVIDIA's DeepSeek-V3.2 NVFP4.
Everything else (norms, biases, the router's correction bias, 1-D tensors) is copied unchanged.

Written per quantised module:
  nvfp4:     weight (uint8), weight_scale (e4m3), weight_scale_2 (fp32), input_scale (fp32)
  fp8_block: weight (e4m3), weight_scale_inv (fp32 128x128 blocks)
For NVFP4, gate_proj and up_proj of one MLP share one weight_scale_2 (the larger of their two),
because fused gate-up kernels apply a single global scale; ModelOpt exports do the same.
``input_scale`` is a static activation scale that ModelOpt calibrates on data; this tool sees no
activations, so it writes the value of ``--input-scale`` (default 1.0) to keep the tensor set of a
real export. Only W4A4 kernels read it; our W4A16 path ignores it.

config.json gets a ``quantization_config`` (plus hf_quant_config.json for NVFP4) whose exclusion list
names every Linear module kept in bf16, so ``load_quant_scheme(dst).precision_of`` reproduces exactly
what was written. Other files of the source directory (tokenizer, generation config, ...) are copied.

Tensors are read, quantised (on ``--device``) and written one at a time; at most one output shard is
held in host memory.
"""

import argparse
import json
import os
import re
import shutil

import torch

from .checkpoint_io import INDEX_FILE, CheckpointReader, ShardedWriter
from .fp8_block import quantize_fp8_block
from .nvfp4 import NVFP4_GROUP_SIZE, nvfp4_global_scale, quantize_nvfp4
from .precision import ALWAYS_BF16, FP8_BLOCK, NVFP4, module_matches

_FLOAT_DTYPES = {"BF16", "F16", "F32", "F64"}
_PRODUCER = {"name": "nsaserve.kernels.quant.make_checkpoint", "version": "1"}


def _is_linear_weight(reader: CheckpointReader, name: str) -> bool:
    return name.endswith(".weight") and len(reader.shape(name)) == 2 and reader.dtype_name(name) in _FLOAT_DTYPES


def _wants_quantisation(module: str, shape: list[int], fmt: str, exclude: list[str], scope: str) -> bool:
    if module_matches(module, ALWAYS_BF16) or module_matches(module, exclude):
        return False
    if scope == "experts" and ".mlp.experts." not in module + ".":
        return False
    return not (fmt == NVFP4 and shape[1] % NVFP4_GROUP_SIZE)


def _mtp_layers(names, config: dict) -> list[str]:
    """Module names of the layers past ``num_hidden_layers`` (the multi-token-prediction layers)."""
    n_layers = config.get("num_hidden_layers")
    if n_layers is None:
        return []
    found = {int(m.group(1)) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    return [f"model.layers.{i}" for i in sorted(found) if i >= n_layers]


def _gate_up_partner(module: str) -> str | None:
    """The module whose NVFP4 global scale must equal this one's, if any."""
    for a, b in ((".gate_proj", ".up_proj"), (".up_proj", ".gate_proj")):
        if module.endswith(a):
            return module[: -len(a)] + b
    return None


def _quantization_config(fmt: str, ignore: list[str]) -> tuple[dict, dict | None]:
    """(config.json quantization_config, hf_quant_config.json contents or None)."""
    if fmt == FP8_BLOCK:
        qc = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ignore,
        }
        return qc, None
    group = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_GROUP_SIZE}
    qc = {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": NVFP4_GROUP_SIZE,
        "config_groups": {"group_0": {"input_activations": dict(group), "weights": dict(group), "targets": ["Linear"]}},
        "ignore": ignore,
        "producer": _PRODUCER,
    }
    hf = {
        "producer": _PRODUCER,
        "quantization": {
            "quant_algo": "NVFP4",
            "group_size": NVFP4_GROUP_SIZE,
            "kv_cache_quant_algo": None,
            "exclude_modules": ignore,
        },
    }
    return qc, hf


def make_checkpoint(
    src: str,
    dst: str,
    fmt: str,
    exclude: list[str] | tuple[str, ...] = (),
    scope: str = "linear",
    device: str = "cpu",
    max_shard_bytes: int = 4 << 30,
    input_scale: float = 1.0,
    quantize_mtp: bool = False,
    progress: bool = False,
) -> dict:
    """Write the quantised copy of ``src`` to ``dst`` (which must not hold a checkpoint yet).

    Returns the ``quantization_config`` written to dst/config.json.
    """
    if fmt not in (NVFP4, FP8_BLOCK):
        raise ValueError(f"format must be {NVFP4!r} or {FP8_BLOCK!r}, got {fmt!r}")
    if scope not in ("linear", "experts"):
        raise ValueError(f"scope must be 'linear' or 'experts', got {scope!r}")
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if config.get("quantization_config"):
        raise ValueError(f"{src} is already quantised ({config['quantization_config'].get('quant_method')})")
    if os.path.isdir(dst) and any(n.endswith(".safetensors") or n == INDEX_FILE for n in os.listdir(dst)):
        raise FileExistsError(f"{dst} already holds a checkpoint")
    exclude = list(exclude)

    writer = ShardedWriter(dst, max_shard_bytes)
    kept_linear: list[str] = []  # Linear modules left in bf16 that no pattern already covers
    done: set[str] = set()
    with CheckpointReader(src) as reader:
        names = reader.names()
        if not quantize_mtp:
            exclude += [m for m in _mtp_layers(names, config) if m not in exclude]
        if progress:
            from tqdm import tqdm

            names = tqdm(names, desc=f"quantising to {fmt}", unit="tensor")

        def quantise(module: str) -> bool:
            return _is_linear_weight(reader, module + ".weight") and _wants_quantisation(
                module, reader.shape(module + ".weight"), fmt, exclude, scope
            )

        def load(name: str) -> torch.Tensor:
            return reader.get(name).to(device)

        for name in names:
            if name in done:
                continue
            module = name[: -len(".weight")] if name.endswith(".weight") else None
            if module is None or not quantise(module):
                if module is not None and _is_linear_weight(reader, name):
                    if not (module_matches(module, ALWAYS_BF16) or module_matches(module, exclude)):
                        kept_linear.append(module)
                writer.add(name, reader.get(name))
                continue
            if fmt == FP8_BLOCK:
                q = quantize_fp8_block(load(name))
                writer.add(name, q.weight)
                writer.add(module + ".weight_scale_inv", q.weight_scale_inv)
                continue
            group = [module]
            partner = _gate_up_partner(module)
            if partner is not None and partner + ".weight" in reader.file_of and quantise(partner):
                group.append(partner)
            weights = {m: load(m + ".weight") for m in group}
            shared_scale_2 = torch.stack([nvfp4_global_scale(w) for w in weights.values()]).max()
            for m, w in weights.items():
                q = quantize_nvfp4(w, shared_scale_2)
                writer.add(m + ".weight", q.weight)
                writer.add(m + ".weight_scale", q.weight_scale)
                writer.add(m + ".weight_scale_2", q.weight_scale_2)
                writer.add(m + ".input_scale", torch.tensor(input_scale, dtype=torch.float32))
                done.add(m + ".weight")
            del weights

    writer.close()
    ignore = list(ALWAYS_BF16) + [p for p in exclude if p not in ALWAYS_BF16] + sorted(set(kept_linear))
    qc, hf = _quantization_config(fmt, ignore)
    _write_side_files(src, dst, config | {"quantization_config": qc}, hf)
    return qc


def _write_side_files(src: str, dst: str, config: dict, hf_quant_config: dict | None) -> None:
    """config.json (with the quantization_config), hf_quant_config.json, and the source's other files."""
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if hf_quant_config is not None:
        with open(os.path.join(dst, "hf_quant_config.json"), "w") as f:
            json.dump(hf_quant_config, f, indent=2)
    skip = {"config.json", "hf_quant_config.json", INDEX_FILE}
    for entry in os.listdir(src):
        path = os.path.join(src, entry)
        if os.path.isfile(path) and entry not in skip and not entry.endswith(".safetensors"):
            shutil.copy2(path, os.path.join(dst, entry))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m nsaserve.kernels.quant.make_checkpoint",
        description="Quantise a bf16/float Hugging Face safetensors checkpoint to ModelOpt NVFP4 or 128x128 block FP8.",
    )
    parser.add_argument("--src", required=True, help="source checkpoint directory (config.json + safetensors)")
    parser.add_argument("--dst", required=True, help="output directory")
    parser.add_argument("--format", required=True, choices=[NVFP4, FP8_BLOCK])
    parser.add_argument(
        "--exclude", action="append", default=[], metavar="GLOB", help="module name glob to keep in bf16 (repeatable)"
    )
    parser.add_argument(
        "--scope",
        default="linear",
        choices=["linear", "experts"],
        help="quantise all Linear weights or routed experts only",
    )
    parser.add_argument("--device", default="cpu", help="device that does the quantisation, e.g. cuda or cuda:1")
    parser.add_argument("--max-shard-gb", type=float, default=4.0, help="largest output shard in GiB")
    parser.add_argument(
        "--input-scale", type=float, default=1.0, help="value written as the (uncalibrated) NVFP4 input_scale"
    )
    parser.add_argument("--quantize-mtp", action="store_true", help="quantise the MTP layers too (default: bf16)")
    parser.add_argument("--progress", action="store_true", help="show a progress bar")
    args = parser.parse_args(argv)
    make_checkpoint(
        args.src,
        args.dst,
        args.format,
        exclude=args.exclude,
        scope=args.scope,
        device=args.device,
        max_shard_bytes=int(args.max_shard_gb * (1 << 30)),
        input_scale=args.input_scale,
        quantize_mtp=args.quantize_mtp,
        progress=args.progress,
    )


if __name__ == "__main__":
    main()
