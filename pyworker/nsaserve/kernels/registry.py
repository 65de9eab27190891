"""A small registry of kernel backends: get_backend("attention", "torch").

Kernels are picked by (kind, name). The torch references register themselves when their module is
imported; GPU backends (Triton, FlashMLA, DeepGEMM, ...) add one file and one `@register` each and
become selectable by name without the model changing.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

# Kinds used by the model:
#   "attention": sparse MLA over the paged latent cache  (sparse_mla.py)
#   "indexer":   lightning-indexer scores + causal top-k over paged index keys  (indexer.py)
#   "moe_route": sigmoid / bias / group-limited expert choice  (moe.py)
#   "moe_experts": routed expert MLPs for the experts this rank owns  (moe.py). The torch reference
#                  takes dense weights (the MoE dequantises quantised experts for it); every other
#                  backend takes the two ExpertStacks (model/expert_stack.py) and reads their
#                  checkpoint layout itself.
#   "rmsnorm", "rope", "kv_store", "index_key_store": the small per-layer ops  (small_ops.py)
#   "silu_mul": a gated MLP's silu(gate) * up from its stacked gate/up output  (small_ops.py)
#   "router_logits": the MoE router's float32 logits  (router_logits.py; "bf16x3" on the tensor cores)
#   "sample_pick": the sampler's argmax(logits + Gumbel noise) per row  (sample_pick.py; used by the
#                  worker's sampler, not the model)
#   "sample_threshold": the sampler's top-k / top-p / min-p as one threshold per row
#                  (sample_threshold.py; the worker's sampler, not the model)
#   "sample_uniform": the sampler's uniforms, one Philox stream per row's seed  (sample_uniform.py)
#   "row_logsumexp": each row's log-sum-exp, the logprobs' normaliser  (row_logsumexp.py)
#   "penalties": repetition / frequency / presence penalties in place on float32 logits  (penalties.py)
#   "row_lse_topk": the log-sum-exp and the k largest logits of each row, for top logprobs  (row_logsumexp.py)
#   "indexer_rows": the indexer with its per-row metadata on the device (a fixed per-request KV
#                   layout, as CUDA graphs need): the backend of the same name as "indexer"'s
#                   serves it  (indexer_rows.py). Every "indexer" backend also takes plan=, the
#                   step's IndexerPlan (indexer_plan.py, built once per forward in StepMeta).
#                   "_fp8q" names: the query rounded to fp8 against an fp8 index-key cache, as
#                   DeepSeek-V3.2's inference does (not float32-exact; see indexer.py)
_BACKENDS: dict[tuple[str, str], Callable] = {}

# Modules holding the built-in torch references; imported on first lookup so that importing the
# registry alone stays cheap and free of cycles.
_BUILTIN_MODULES = (
    "sparse_mla", "indexer", "moe", "small_ops", "indexer_rows", "moe_dense", "router_logits", "sample_pick",
    "sample_threshold", "sample_uniform", "row_logsumexp", "penalties",
)  # fmt: skip
_builtins_loaded = False

# Triton backends: (kind, name) -> "module:function". Registered only where Triton is installed,
# and imported on first call, so that importing the registry (or the model) never imports Triton
# and tests can still choose Triton's CPU interpreter before the kernels are built.
_TRITON_BACKENDS = {
    ("indexer", "triton"): "triton_indexer:indexer_topk_triton",
    ("attention", "triton"): "triton_sparse_mla:sparse_mla_triton",
    ("moe_experts", "triton"): "triton_moe_w4a16:moe_experts_triton",
    ("moe_route", "triton"): "triton_moe_route:route_noaux_tc_triton",
    ("rmsnorm", "triton"): "triton_norm_rope:rmsnorm_triton",
    ("rope", "triton"): "triton_norm_rope:rope_triton",
    ("kv_store", "triton"): "triton_kv_store:kv_store_triton",
    ("index_key_store", "triton"): "triton_kv_store:index_key_store_triton",
    ("silu_mul", "triton"): "triton_silu_mul:silu_mul_triton",
    ("router_logits", "triton"): "triton_router_logits:router_logits_triton",
    ("indexer_rows", "triton"): "triton_indexer:indexer_topk_rows",
    ("indexer", "triton_fp8q"): "triton_indexer:indexer_topk_triton_fp8q",
    ("indexer_rows", "triton_fp8q"): "triton_indexer:indexer_topk_rows_fp8q",
    ("sample_pick", "triton"): "triton_sample_pick:sample_pick_triton",
    ("sample_threshold", "triton"): "triton_sample_threshold:sample_threshold_triton",
    ("sample_uniform", "triton"): "triton_sample_uniform:sample_uniform_triton",
    ("row_logsumexp", "triton"): "triton_row_logsumexp:row_logsumexp_triton",
    ("row_lse_topk", "triton"): "triton_row_lse_topk:row_lse_topk_triton",
    ("penalties", "triton"): "triton_penalties:penalties_triton",
}

# Backends whose calls neither synchronise with the host nor size a tensor from device data, so a
# CUDA graph may capture them (the worker's decode graphs check every backend the model uses).
# "indexer" is captured through its "indexer_rows" form. Not here: the torch "moe_experts"
# reference (torch.unique / nonzero pick the experts that got tokens).
_GRAPH_SAFE = {
    ("attention", "torch"), ("attention", "triton"),
    ("indexer", "torch"), ("indexer", "triton"), ("indexer", "torch_fp8q"), ("indexer", "triton_fp8q"),
    ("moe_route", "torch"), ("moe_route", "triton"),
    ("moe_experts", "torch_dense"), ("moe_experts", "triton"),
    ("rmsnorm", "torch"), ("rmsnorm", "triton"), ("rope", "torch"), ("rope", "triton"),
    ("kv_store", "torch"), ("kv_store", "triton"), ("index_key_store", "torch"), ("index_key_store", "triton"),
    ("router_logits", "torch"), ("router_logits", "bf16x3"), ("router_logits", "triton"),
    ("silu_mul", "torch"), ("silu_mul", "triton"),
}  # fmt: skip


def register(kind: str, name: str) -> Callable[[Callable], Callable]:
    def deco(fn: Callable) -> Callable:
        key = (kind, name)
        if key in _BACKENDS and _BACKENDS[key] is not fn:
            raise ValueError(f"kernel backend {kind}/{name} is already registered")
        _BACKENDS[key] = fn
        return fn

    return deco


def _lazy(target: str) -> Callable:
    mod_name, fn_name = target.split(":")
    fn: Callable | None = None

    def load() -> Callable:
        nonlocal fn
        if fn is None:
            fn = getattr(importlib.import_module(f"{__package__}.{mod_name}"), fn_name)
        return fn

    def call(*args, **kwargs):
        return (fn or load())(*args, **kwargs)

    call.__name__ = fn_name
    call.load = load
    return call


def _have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules[module] is None (import blocked)
        return False


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        for mod in _BUILTIN_MODULES:
            importlib.import_module(f"{__package__}.{mod}")
        if _have("triton"):
            for (kind, name), target in _TRITON_BACKENDS.items():
                register(kind, name)(_lazy(target))
        _builtins_loaded = True


def get_backend(kind: str, name: str = "torch") -> Callable:
    _load_builtins()
    try:
        return _BACKENDS[(kind, name)]
    except KeyError:
        have = sorted(n for k, n in _BACKENDS if k == kind)
        raise KeyError(f"no kernel backend {name!r} for {kind!r}; registered: {have}") from None


def load_backend(kind: str, name: str = "torch") -> Callable:
    """get_backend, with a lazily imported backend imported now and returned itself (no wrapper
    left in the call path): for callers that resolve their kernels once, e.g. at model build."""
    fn = get_backend(kind, name)
    load = getattr(fn, "load", None)
    return load() if load is not None else fn


def graph_safe(kind: str, name: str) -> bool:
    """Whether backend `name` of `kind` may run inside a CUDA graph."""
    return (kind, name) in _GRAPH_SAFE


def available(kind: str) -> list[str]:
    _load_builtins()
    return sorted(n for k, n in _BACKENDS if k == kind)


# The "auto" backend of a kind on CUDA for 16-bit models, where it is not torch (tested and measured
# there against the torch references: tests/kernels/test_triton_*.py, tests/model/test_triton_backend.py,
# tests/kernels/test_*router_logits.py); torch elsewhere. A float32 model keeps torch: these feed the
# tensor cores bf16 operands. A Triton backend counts only where Triton is installed.
AUTO_ON_CUDA = {
    **dict.fromkeys(("attention", "indexer", "rmsnorm", "rope", "kv_store", "index_key_store", "silu_mul",
                      "sample_pick", "sample_threshold", "sample_uniform", "row_logsumexp", "row_lse_topk",
                      "penalties"), "triton"),
    "router_logits": "triton",
}


def resolve(kind: str, name: str, device_type: str, model_bits: int = 16) -> str:
    """A backend name for `kind`, with "auto" replaced by the choice for this device type and
    model dtype width."""
    if name != "auto":
        return name
    choice = AUTO_ON_CUDA.get(kind)
    if device_type == "cuda" and model_bits <= 16 and choice in available(kind):
        return choice
    return "torch"
