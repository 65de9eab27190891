"""Which Linear modules of a checkpoint are stored in which precision, from its quantisation config.

Understood configs:

* ModelOpt NVFP4, in config.json ``quantization_config`` (``quant_method: "modelopt"``,
  ``quant_algo: "NVFP4"``, group size 16 at top level or in ``config_groups``, excluded modules in
  ``ignore``) and/or in ``hf_quant_config.json`` (``{"quantization": {"quant_algo": "NVFP4",
  "group_size": 16, "exclude_modules": [...]}}``). ``quant_algo: "MIXED_PRECISION"`` with a
  ``quantized_layers`` map of module name -> {"quant_algo": ...} is honoured too.
* Block FP8 (DeepSeek / GLM FP8 releases): ``quant_method: "fp8"`` with ``weight_block_size: [128, 128]``;
  excluded modules in ``modules_to_not_convert`` or ``ignored_layers`` when present.
* No quantisation config: everything is bf16.

Exclusion entries are shell-style globs matched against the whole dotted module name (``*`` also
crosses dots, as ModelOpt's and vLLM's fnmatch does); an entry that matches a parent module (e.g.
``model.layers.78``) excludes everything below it.

Some modules stay bf16 whatever the config says, because no engine quantises them and real
checkpoints store them unquantised: the MoE router ``mlp.gate`` (not an nn.Linear in the HF models,
so ModelOpt never sees it), the indexer's ``weights_proj``, ``lm_head`` / the MTP ``shared_head.head``
and embeddings (see ``ALWAYS_BF16``).

``precision_of`` answers for Linear modules (names without the ``.weight`` suffix); norms, biases and
other non-Linear tensors are never quantised in these formats.
"""

import json
import os
import re
from dataclasses import dataclass, field
from fnmatch import translate
from functools import lru_cache

BF16 = "bf16"
NVFP4 = "nvfp4"
FP8_BLOCK = "fp8_block"

ALWAYS_BF16 = ("*embed_tokens", "lm_head", "*shared_head.head", "*.mlp.gate", "*.indexer.weights_proj")

_NVFP4_ALGOS = {"NVFP4", "W4A16_NVFP4"}


# Tensors a Linear module has on disk in each precision: (read by the loader, present but unused).
# NVFP4's input_scale is the static activation scale of W4A4 kernels; W4A16 reads past it.
_MODULE_TENSORS = {
    BF16: (("weight",), ()),
    NVFP4: (("weight", "weight_scale", "weight_scale_2"), ("input_scale",)),
    FP8_BLOCK: (("weight", "weight_scale_inv"), ()),
}


def module_tensors(precision: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tensor suffixes to load, suffixes that may be present and are to be skipped) of a Linear module
    stored in ``precision``; e.g. NVFP4 -> (("weight", "weight_scale", "weight_scale_2"), ("input_scale",))."""
    return _MODULE_TENSORS[precision]


@lru_cache(maxsize=64)
def _compile(patterns: tuple[str, ...]) -> tuple[frozenset[str], re.Pattern | None]:
    """Exact names (set lookup) and one regex for the real globs: exports can list thousands of
    module names, and a loader asks for every one of tens of thousands of modules."""
    literals = frozenset(p for p in patterns if not any(c in p for c in "*?["))
    globs = [translate(p) for p in patterns if p not in literals]
    return literals, (re.compile("|".join(globs)) if globs else None)


def module_matches(name: str, patterns) -> bool:
    """True if ``name`` or one of its dotted parents matches one of the glob ``patterns``."""
    literals, regex = _compile(tuple(patterns))
    parts = name.split(".")
    for i in range(len(parts)):
        candidate = ".".join(parts[: i + 1])
        if candidate in literals or (regex is not None and regex.match(candidate)):
            return True
    return False


@dataclass(frozen=True)
class QuantScheme:
    """Parsed quantisation config. ``default`` applies to Linear modules not excluded."""

    default: str = BF16
    exclude: tuple[str, ...] = ()
    per_module: dict[str, str] = field(default_factory=dict)  # MIXED_PRECISION: exact names only
    kv_cache_quant_algo: str | None = None

    def precision_of(self, module_name: str) -> str:
        """ "bf16" | "nvfp4" | "fp8_block" for the Linear module ``module_name``."""
        if module_matches(module_name, ALWAYS_BF16) or module_matches(module_name, self.exclude):
            return BF16
        if self.per_module:
            return self.per_module.get(module_name, BF16)
        return self.default


def _modelopt_algo_precision(algo: str, group_size) -> str:
    if algo not in _NVFP4_ALGOS:
        raise ValueError(f"unsupported ModelOpt quant_algo {algo!r}: only NVFP4 weights are implemented")
    if group_size not in (None, 16):
        raise ValueError(f"NVFP4 group_size must be 16, got {group_size}")
    return NVFP4


def _group_size_from_config_groups(qc: dict):
    for group in (qc.get("config_groups") or {}).values():
        size = (group.get("weights") or {}).get("group_size")
        if size is not None:
            return size
    return None


def _parse_modelopt(sections: list[dict]) -> QuantScheme:
    """Merge the ModelOpt sections (config.json's and hf_quant_config.json's); they must agree."""
    algos = {s["quant_algo"] for s in sections if s.get("quant_algo")}
    if len(algos) != 1:
        raise ValueError(f"ModelOpt config must name exactly one quant_algo, found {sorted(algos)}")
    algo = algos.pop()
    exclude: list[str] = []
    per_module: dict[str, str] = {}
    kv = None
    for s in sections:
        for key in ("ignore", "exclude_modules"):
            exclude += [p for p in s.get(key) or [] if p not in exclude]
        kv = kv or s.get("kv_cache_quant_algo")
        for name, layer in (s.get("quantized_layers") or {}).items():
            per_module[name] = _modelopt_algo_precision(layer.get("quant_algo"), layer.get("group_size"))
    if algo == "MIXED_PRECISION":
        return QuantScheme(BF16, tuple(exclude), per_module, kv)
    group_size = next((s.get("group_size") for s in sections if s.get("group_size") is not None), None)
    if group_size is None:
        group_size = next((g for s in sections if (g := _group_size_from_config_groups(s)) is not None), None)
    return QuantScheme(_modelopt_algo_precision(algo, group_size), tuple(exclude), {}, kv)


def _parse_fp8(qc: dict) -> QuantScheme:
    block = qc.get("weight_block_size")
    if block is None or list(block) != [128, 128]:
        raise ValueError(f"only 128x128 block FP8 is supported, got weight_block_size={block}")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"only e4m3 FP8 weights are supported, got fmt={qc.get('fmt')!r}")
    exclude = tuple((qc.get("modules_to_not_convert") or []) + (qc.get("ignored_layers") or []))
    return QuantScheme(FP8_BLOCK, exclude)


def parse_quant_scheme(config: dict | None, hf_quant_config: dict | None = None) -> QuantScheme:
    """Scheme from a parsed config.json (whole file) and optional parsed hf_quant_config.json."""
    qc = (config or {}).get("quantization_config")
    modelopt_sections = []
    if hf_quant_config is not None:
        modelopt_sections.append(hf_quant_config.get("quantization", hf_quant_config))
    if qc is not None:
        method = qc.get("quant_method")
        if method == "fp8":
            if modelopt_sections:
                raise ValueError("config.json says block FP8 but hf_quant_config.json says ModelOpt")
            return _parse_fp8(qc)
        if method != "modelopt":
            raise ValueError(f"unsupported quant_method {method!r} (expected 'modelopt' or 'fp8')")
        modelopt_sections.append(qc)
    if not modelopt_sections:
        return QuantScheme()
    return _parse_modelopt(modelopt_sections)


def load_quant_scheme(model_dir: str) -> QuantScheme:
    """Scheme of the checkpoint directory (config.json and hf_quant_config.json if present)."""

    def read(name):
        path = os.path.join(model_dir, name)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)

    return parse_quant_scheme(read("config.json"), read("hf_quant_config.json"))
