"""The sparse MLA work plan (kernels/mla_work.py) in the model: with NSASERVE_MLA_WORK on, a step
whose lists are whole contexts is planned once (not once a layer), every layer's attention runs
the plan, and the logits are those of the plain split (the same sums cut at other points)."""

import pytest
import torch
from model_helpers import VOCAB, Session, make_checkpoint

from nsaserve.kernels import mla_work
from nsaserve.model.runner import ModelRunner

pytest.importorskip("triton")

REAL_PLAN = mla_work.plan_mla_work

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def decode(path, monkeypatch, on: bool):
    from nsaserve.kernels import triton_sparse_mla as tsm

    monkeypatch.setattr(tsm, "MLA_WORK", "on" if on else "off")
    plans = []
    monkeypatch.setattr(mla_work, "plan_mla_work", lambda *a, **k: plans.append(a) or REAL_PLAN(*a, **k))
    r = ModelRunner(
        path, device=DEV, dtype=torch.float32, kv_cache_dtype="fp8_e4m3", num_pages=64, page_size=4, show_progress=False
    )
    for kind in ("attention", "indexer"):
        r.set_backend(kind, "triton")
    g = torch.Generator().manual_seed(2)
    # Contexts of 3 and 5 tokens growing to 6 and 8: within the tiny model's top-k of 8, so every
    # step's lists are whole contexts.
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 5)]
    session = Session(r, seed=1)
    last = session.step(list(enumerate(prompts)))
    out = []
    for _ in range(3):
        last = session.step([(i, [int(lg.argmax())]) for i, lg in enumerate(last)])
        out.append(torch.stack(last).cpu())
    return torch.stack(out), plans


def test_the_plan_is_built_once_a_step_and_changes_no_result(tmp_path, monkeypatch):
    path = str(tmp_path / "m")
    make_checkpoint("glm_moe_dsa", path, seed=3, initializer_range=0.06, confident_embedding=0.12)
    plain, none = decode(path, monkeypatch, on=False)
    planned, plans = decode(path, monkeypatch, on=True)
    assert not none
    # The prompt step (2 rows of 3 and 5 tokens) and three decode steps: one plan each.
    assert len(plans) == 4, len(plans)
    err = (planned - plain).abs().amax() / plain.abs().amax()
    assert float(err) < 1e-3, float(err)
