"""The model configuration, read from config.json as transformers writes it (no transformers import).

Both `glm_moe_dsa` (GLM-5.x) and `deepseek_v32` (DeepSeek-V3.2) are accepted. Derived per-layer
facts (dense vs MoE MLP, full vs shared indexer, RoPE layouts) are resolved here once so the layers
never look at raw config keys.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from ..kernels.quant import QuantScheme, parse_quant_scheme

SUPPORTED = {
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    rope_parameters: dict
    mlp_layer_types: list[str]  # "dense" | "sparse" per layer
    indexer_types: list[str]  # "full" | "shared" per layer
    mla_rope_interleave: bool
    indexer_rope_interleave: bool
    torch_dtype: torch.dtype
    quant: QuantScheme  # which Linear modules the checkpoint stores in bf16 / NVFP4 / FP8-block
    raw: dict = field(repr=False, default_factory=dict)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _rope_parameters(cfg: dict) -> dict:
    """One flat dict: rope_type, rope_theta and the scaling keys (new `rope_parameters` or old
    `rope_scaling` + `rope_theta` layout)."""
    params = dict(cfg.get("rope_parameters") or {})
    if not params:
        params = dict(cfg.get("rope_scaling") or {})
        if "rope_theta" in cfg:
            params.setdefault("rope_theta", cfg["rope_theta"])
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if params["rope_type"] not in ("default", "yarn"):
        raise NotImplementedError(f"rope_type {params['rope_type']!r} is not supported (default, yarn)")
    if params["rope_type"] == "yarn":
        params.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
    return params


def _indexer_types(cfg: dict, model_type: str, num_layers: int) -> list[str]:
    """Explicit `indexer_types`, else GLM-5.2's pattern / freq+offset schedule, else all "full"."""
    if cfg.get("indexer_types") is not None:
        types = list(cfg["indexer_types"])
    elif cfg.get("index_topk_pattern") is not None:
        pat = cfg["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}[c] for c in pat] if isinstance(pat, str) else list(pat)
    elif model_type == "glm_moe_dsa":
        freq = max(int(cfg.get("index_topk_freq", 1)), 1)
        offset = int(cfg.get("index_skip_topk_offset", 2))
        types = ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(num_layers)]
    else:
        types = ["full"] * num_layers
    types = types[:num_layers]
    if len(types) != num_layers or any(t not in ("full", "shared") for t in types):
        raise ValueError(f"indexer_types must be {num_layers} entries of 'full'/'shared', got {types}")
    if num_layers and types[0] != "full":
        raise ValueError("the first layer's indexer must be 'full': a 'shared' layer reuses an earlier top-k")
    return types


def _quant_scheme(cfg: dict, hf_quant_config: dict | None) -> QuantScheme:
    """The checkpoint's per-module precisions; formats other than ModelOpt NVFP4 and 128x128 block
    FP8 (or variants of them we do not run) are refused here, before any weight is allocated."""
    try:
        return parse_quant_scheme(cfg, hf_quant_config)
    except ValueError as e:
        quant = cfg.get("quantization_config")
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "modelopt"
        raise NotImplementedError(f"quantised checkpoint ({method}) is not supported: {e}") from None


def parse_config(cfg: dict, hf_quant_config: dict | None = None) -> ModelConfig:
    """config.json (parsed), plus hf_quant_config.json (parsed) when the checkpoint has one."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(SUPPORTED)}")
    quant = _quant_scheme(cfg, hf_quant_config)
    if cfg.get("q_lora_rank") is None:
        raise NotImplementedError("q_lora_rank = null (no query LoRA) is not supported")
    if cfg.get("attention_bias", False):
        raise NotImplementedError("attention_bias = true is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (silu)")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise NotImplementedError(f"scoring_func {cfg.get('scoring_func')!r} is not supported (sigmoid)")
    n_layers = int(cfg["num_hidden_layers"])
    if cfg.get("mlp_layer_types") is not None:
        mlp_types = list(cfg["mlp_layer_types"])[:n_layers]
    else:
        n_dense = min(int(cfg.get("first_k_dense_replace", 3)), n_layers)
        mlp_types = ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense)
    if len(mlp_types) != n_layers or any(t not in ("dense", "sparse") for t in mlp_types):
        raise ValueError(f"mlp_layer_types must be {n_layers} entries of 'dense'/'sparse', got {mlp_types}")
    # Indexer RoPE: interleaved for GLM, half-split (NeoX) for DeepSeek-V3.2, unless the config says.
    idx_interleave = cfg.get("indexer_rope_interleave")
    if idx_interleave is None:
        idx_interleave = model_type == "glm_moe_dsa"
    dtype_name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    if dtype_name not in _DTYPES:
        raise ValueError(f"unsupported checkpoint dtype {dtype_name!r}")
    n_experts = int(cfg.get("n_routed_experts", cfg.get("num_experts", 256)))
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        num_hidden_layers=n_layers,
        num_attention_heads=int(cfg["num_attention_heads"]),
        q_lora_rank=int(cfg["q_lora_rank"]),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        n_routed_experts=n_experts,
        n_shared_experts=int(cfg.get("n_shared_experts") or 0),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        n_group=int(cfg.get("n_group") or 1),
        topk_group=int(cfg.get("topk_group") or 1),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        index_topk=int(cfg["index_topk"]),
        index_n_heads=int(cfg["index_n_heads"]),
        index_head_dim=int(cfg["index_head_dim"]),
        rope_parameters=_rope_parameters(cfg),
        mlp_layer_types=mlp_types,
        indexer_types=_indexer_types(cfg, model_type, n_layers),
        mla_rope_interleave=bool(cfg.get("rope_interleave", True)),
        indexer_rope_interleave=bool(idx_interleave),
        torch_dtype=_DTYPES[dtype_name],
        quant=quant,
        raw=cfg,
    )


def load_config(model_path: str) -> ModelConfig:
    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    hf_quant_config = None
    # Older ModelOpt exports describe the quantisation only in this side file.
    side = os.path.join(model_path, "hf_quant_config.json")
    if os.path.exists(side):
        with open(side) as f:
            hf_quant_config = json.load(f)
    return parse_config(cfg, hf_quant_config)
