"""The sparse MLA step plans in the model, each built once a step (not once a layer) and read by
every layer, with the logits of the plain launch (the same sums, cut at other points or run in
other programs):
- the work plan (kernels/mla_work.py, NSASERVE_MLA_WORK=on), for steps of whole contexts;
- the row order (kernels/mla_rows.py, NSASERVE_MLA_ROW_ORDER=on), for every step whose attention
  runs over all of its rows, whole contexts and top-k lists alike."""

import pytest
import torch
from model_helpers import VOCAB, Session, make_checkpoint

from nsaserve.kernels import mla_rows, mla_work
from nsaserve.model.runner import ModelRunner

pytest.importorskip("triton")

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The planners as imported (each decode wraps them afresh).
REAL = {"plan_mla_work": mla_work.plan_mla_work, "plan_row_order": mla_rows.plan_row_order}


def decode(path, monkeypatch, prompt_lens, switch: str, planner, on: bool):
    """Logits of a prompt step and three greedy decode steps with the triton backends, the
    backend's `switch` on or off; and the arguments of every call of `planner` (module, name)."""
    from nsaserve.kernels import triton_sparse_mla as tsm

    monkeypatch.setattr(tsm, switch, "on" if on else "off")
    module, name = planner
    real, plans = REAL[name], []
    monkeypatch.setattr(module, name, lambda *a, **k: plans.append(a) or real(*a, **k))
    r = ModelRunner(
        path, device=DEV, dtype=torch.float32, kv_cache_dtype="fp8_e4m3", num_pages=64, page_size=4, show_progress=False
    )
    for kind in ("attention", "indexer"):
        r.set_backend(kind, "triton")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in prompt_lens]
    session = Session(r, seed=1)
    last = session.step(list(enumerate(prompts)))
    out = []
    for _ in range(3):
        last = session.step([(i, [int(lg.argmax())]) for i, lg in enumerate(last)])
        out.append(torch.stack(last).cpu())
    return torch.stack(out), plans


def planned_against_plain(tmp_path, monkeypatch, prompt_lens, switch, planner):
    path = str(tmp_path / "m")
    make_checkpoint("glm_moe_dsa", path, seed=3, initializer_range=0.06, confident_embedding=0.12)
    plain, none = decode(path, monkeypatch, prompt_lens, switch, planner, on=False)
    planned, plans = decode(path, monkeypatch, prompt_lens, switch, planner, on=True)
    assert not none
    err = (planned - plain).abs().amax() / plain.abs().amax()
    assert float(err) < 1e-3, float(err)
    return plans


def test_the_work_plan_is_built_once_a_step_and_changes_no_result(tmp_path, monkeypatch):
    # Contexts of 3 and 5 tokens growing to 6 and 8: within the tiny model's top-k of 8, so every
    # step's lists are whole contexts. The prompt step and three decode steps: one plan each.
    plans = planned_against_plain(tmp_path, monkeypatch, (3, 5), "MLA_WORK", (mla_work, "plan_mla_work"))
    assert len(plans) == 4, len(plans)


@pytest.mark.parametrize(
    "prompt_lens",
    [
        (3, 5),  # whole contexts, as above
        (3, 12),  # a prompt past the top-k: its rows' lists are the indexer's top-k
    ],
)
def test_the_row_order_is_built_once_a_step_and_changes_no_result(tmp_path, monkeypatch, prompt_lens):
    orders = planned_against_plain(tmp_path, monkeypatch, prompt_lens, "ROW_ORDER", (mla_rows, "plan_row_order"))
    # The prompt step (every prompt token a row) and three decode steps: one order each.
    assert [int(row_pos.numel()) for row_pos, _ in orders] == [sum(prompt_lens), 2, 2, 2]
