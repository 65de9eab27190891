"""Tensor-parallel slices of quantised Linear weights, at sizes where FP8's 128x128 blocks matter (the
tiny models are smaller than one block): a split on scale-group boundaries is read as packed slices
of the weight and its scales, one off them is loaded whole and dequantised into a dense slice; either
way the rank's weight equals the matching slice of the whole dequantised weight, exactly."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nsaserve.kernels.quant import dequantize_fp8_block, dequantize_nvfp4, quantize_fp8_block, quantize_nvfp4
from nsaserve.model.linear import Linear
from nsaserve.model.loader import _read
from nsaserve.model.quant_linear import Fp8BlockLinear, Nvfp4Linear, quantized_linear

# (precision, out, in, shard_dim, start, length, class this rank ends up with)
CASES = [
    ("nvfp4", 24, 64, 1, 16, 32, Nvfp4Linear),  # 16-input groups = 8 packed bytes
    ("nvfp4", 24, 64, 0, 5, 7, Nvfp4Linear),  # one scale row per output row: any row split
    ("nvfp4", 24, 64, 1, 8, 8, Linear),  # cuts a 16-input group
    ("fp8_block", 384, 200, 0, 128, 128, Fp8BlockLinear),
    ("fp8_block", 96, 320, 1, 256, 64, Fp8BlockLinear),  # the partial last block ends at the tensor's end
    ("fp8_block", 256, 200, 0, 64, 128, Linear),  # straddles two row blocks
]


@pytest.mark.parametrize("precision, out, inp, dim, start, length, cls", CASES)
def test_rank_slice_equals_slice_of_dequantized(tmp_path, precision, out, inp, dim, start, length, cls):
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(out + inp))
    if precision == "nvfp4":
        tensors = quantize_nvfp4(w)._asdict()
        full = dequantize_nvfp4(*tensors.values())
    else:
        tensors = quantize_fp8_block(w)._asdict()
        full = dequantize_fp8_block(*tensors.values())
    save_file(tensors, tmp_path / "w.safetensors")

    module = quantized_linear(
        precision, inp, out, dtype=torch.float32, device="cpu", shard_dim=dim, start=start, length=length
    )
    with safe_open(tmp_path / "w.safetensors", framework="pt") as f:
        for name, p in module.named_parameters():
            p.data.copy_(_read(f, name, p.tp_shard))
    if module.slice_after_load is not None:
        module = module.to_dense_slice()
    assert type(module) is cls
    assert torch.equal(module.dense_weight(), full.narrow(dim, start, length))
    x = torch.randn(3, module.dense_weight().shape[1])
    assert torch.allclose(module(x), x @ full.narrow(dim, start, length).T, atol=1e-5)
