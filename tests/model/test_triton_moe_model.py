"""The tiny GLM-5 model with NVFP4 routed experts gives the same logits with the triton MoE
backends (fused routing; fused W4A16 kernels on the quantised stacks) as with the torch ones (dequantise, then
per-expert matmuls). The triton kernels round activations and the intermediate to bf16, hence the
tolerance; a wrong expert, scale or routing weight moves the logits by far more."""

import pytest
import torch
from model_helpers import VOCAB, Session, make_checkpoint, quantize_checkpoint, rel_err

from nsaserve.model.runner import ModelRunner

pytest.importorskip("triton")

TOL = 2e-2


@pytest.mark.parametrize("layout", ["checkpoint", "relayout", "tiled"])
def test_triton_moe_backend_matches_torch(tmp_path, monkeypatch, layout):
    """Choosing the triton backend puts the NVFP4 stacks in the layout in place, once; the torch
    reference afterwards reads them back to the same logits."""
    from nsaserve.kernels import triton_moe_w4a16

    monkeypatch.setattr(triton_moe_w4a16, "STACK_LAYOUT", layout)
    # hidden and moe_intermediate 128: the kernels' smallest K block (8 partial MMAs of K 16); the
    # tiled layout needs whole tiles of 256 inputs.
    size = 256 if layout == "tiled" else 128
    make_checkpoint("glm_moe_dsa", str(tmp_path / "float"), seed=9, hidden_size=size, moe_intermediate_size=size)
    quantize_checkpoint(str(tmp_path / "float"), str(tmp_path / "q"), "nvfp4", "experts")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    runner = ModelRunner(str(tmp_path / "q"), device=device, dtype=None, num_pages=40, page_size=4, show_progress=False)
    assert runner.model.model.layers[1].mlp.w13.precision == "nvfp4"

    tokens = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(4)).tolist()
    logits = {}
    for backend in ("torch", "triton", "torch again"):
        name = backend.split()[0]
        runner.set_backend("moe_route", name)
        runner.set_backend("moe_experts", name)
        session = Session(runner, seed=1)
        prefill = session.step([(0, tokens)], all_logits=True)[0]
        decode = session.step([(0, [tokens[0]])])[0]
        logits[backend] = (prefill, decode)
    assert runner.model.model.layers[1].mlp.w13.kernel_layout == layout
    assert runner.model.model.layers[1].mlp.w2.kernel_layout == layout
    for ours, ref in zip(logits["triton"], logits["torch"]):
        assert torch.isfinite(ours).all()
        assert rel_err(ours, ref) < TOL
    for again, ref in zip(logits["torch again"], logits["torch"]):
        assert torch.equal(again, ref)
