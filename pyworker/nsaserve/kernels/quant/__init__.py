"""Quantised formats: NVFP4 and block-FP8 weights, the FP8 KV cache layouts, checkpoint precision.

Every function is plain torch and runs on whatever device its inputs live on (CPU or CUDA); the
dequantising functions are the references fused kernels are tested against.

Weights (names of tensors/arguments as in the checkpoints):

    quantize_nvfp4(w, weight_scale_2=None) -> Nvfp4Weight(weight, weight_scale, weight_scale_2)
    dequantize_nvfp4(weight, weight_scale, weight_scale_2, dtype=float32) -> Tensor [N, K]
    nvfp4_linear(x, weight, weight_scale, weight_scale_2, bias=None) -> x @ W.T (W4A16; input_scale unused)

    quantize_fp8_block(w) -> Fp8BlockWeight(weight, weight_scale_inv)
    dequantize_fp8_block(weight, weight_scale_inv, dtype=float32) -> Tensor [N, K]
    fp8_block_linear(x, weight, weight_scale_inv, bias=None)

KV cache (FP8; layouts in the modules' docstrings):

    MLA_KV_BYTES = 656; write_mla_kv(cache, slots, latent, rope); read_mla_kv(cache, slots) -> (latent, rope)
    encode_mla_kv(latent, rope) -> rows [N, 656]; decode_mla_kv(rows) -> (latent fp32, rope bf16)
    INDEXER_K_BYTES = 132; write_indexer_k(cache [pages, page_size, 132], slots, k);
    read_indexer_k(cache, slots) -> (values e4m3 [N, 128], scales fp32 [N])

Which modules are quantised:

    scheme = load_quant_scheme(model_dir)       # or parse_quant_scheme(config_dict, hf_quant_config_dict)
    scheme.precision_of("model.layers.3.mlp.experts.0.up_proj")  -> "bf16" | "nvfp4" | "fp8_block"

    module_tensors("nvfp4") -> (("weight", "weight_scale", "weight_scale_2"), ("input_scale",))
                                 # (suffixes to load, suffixes present on disk but unused by W4A16)

Making quantised checkpoints: ``make_checkpoint(src, dst, "nvfp4" | "fp8_block", ...)`` or
``python -m nsaserve.kernels.quant.make_checkpoint --help``.
"""

from .fp8_block import Fp8BlockWeight, dequantize_fp8_block, fp8_block_linear, quantize_fp8_block
from .indexer_k_fp8 import INDEXER_K_BYTES, encode_indexer_k, read_indexer_k, write_indexer_k
from .mla_kv_fp8 import MLA_KV_BYTES, decode_mla_kv, encode_mla_kv, read_mla_kv, write_mla_kv
from .nvfp4 import Nvfp4Weight, dequantize_nvfp4, nvfp4_linear, quantize_nvfp4
from .precision import BF16, FP8_BLOCK, NVFP4, QuantScheme, load_quant_scheme, module_tensors, parse_quant_scheme

__all__ = [
    "BF16",
    "FP8_BLOCK",
    "INDEXER_K_BYTES",
    "MLA_KV_BYTES",
    "NVFP4",
    "Fp8BlockWeight",
    "Nvfp4Weight",
    "QuantScheme",
    "decode_mla_kv",
    "dequantize_fp8_block",
    "dequantize_nvfp4",
    "encode_indexer_k",
    "encode_mla_kv",
    "fp8_block_linear",
    "load_quant_scheme",
    "module_tensors",
    "nvfp4_linear",
    "parse_quant_scheme",
    "quantize_fp8_block",
    "quantize_nvfp4",
    "read_indexer_k",
    "read_mla_kv",
    "write_indexer_k",
    "write_mla_kv",
]
