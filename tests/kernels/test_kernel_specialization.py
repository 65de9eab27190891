"""Every integer a Triton / Gluon kernel specialises on, with the reason it cannot start a compile in
the middle of serving.

Triton compiles a variant per distinct value class of each specialised integer argument (== 1,
divisible by 16, neither). An argument that follows a step's shape (a row, slot, chunk or loop
count) must be unspecialised (`do_not_specialize`), or a step of a new size compiles while serving:
on the H200 the prompt top-k stalled serving for 6-9 s that way (2026-12-02), and the MoE align
compiled mid-serving on a chunk count. A new specialised argument fails this test until it is
unspecialised or listed here with its reason. Pointers (`*_ptr`) and floats are not listed.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

MODEL_CONSTANT = "fixed by the model, rank and pool: one value per server"
PADDED = "padded by its caller to a multiple of 16: one value class"
FLOAT = "a float: never specialised"
DESC = "a TMA descriptor or its placeholder (tiled weights only)"

ALLOWED = {
    "gluon_sparse_mla._sparse_mla_gluon_kernel": {
        "heads": MODEL_CONSTANT,
        "idx_stride": "the top-k list width: its 16-divisibility is a warm-up bucket (odd list lengths)",
        "num_splits": "1 or a split count by batch: both classes met by the warm-up's decode batches",
        "scale_log2": FLOAT,
    },
    # The warp-specialised kernel takes the same arguments for the same reasons.
    "gluon_sparse_mla_ws._sparse_mla_ws_kernel": {
        "heads": MODEL_CONSTANT,
        "idx_stride": "the top-k list width: its 16-divisibility is a warm-up bucket (odd list lengths)",
        "num_splits": "1 or a split count by batch: both classes met by the warm-up's decode batches",
        "scale_log2": FLOAT,
    },
    "triton_sparse_mla._sparse_mla_kernel": {
        "heads": MODEL_CONSTANT,
        "idx_stride": "the top-k list width: its 16-divisibility is a warm-up bucket (odd list lengths)",
        "num_splits": "1 or a split count by batch: both classes met by the warm-up's decode batches",
        "scale_log2": FLOAT,
    },
    "triton_sparse_mla._combine_kernel": {
        "heads": MODEL_CONSTANT,
        "num_splits": "a split count > 1 by batch: both classes met by the warm-up's decode batches",
    },
    "triton_indexer._logits_kernel": {
        "out_stride": PADDED, "heads": MODEL_CONSTANT, "scale": FLOAT,
        "fit": "the model's top-k (0 outside indexer_topk_rows): a model constant",
    },  # fmt: skip
    "triton_kv_store._index_k_store_kernel": {"k_stride": MODEL_CONSTANT, "page_size": MODEL_CONSTANT},
    "triton_kv_store._index_k_prep_store_kernel": {
        "k_stride": MODEL_CONSTANT, "page_size": MODEL_CONSTANT, "cs_stride": MODEL_CONSTANT, "eps": FLOAT,
        "rot_scale": FLOAT,
    },  # fmt: skip
    "triton_kv_store._latent_store_kernel": {
        "c_stride": MODEL_CONSTANT, "pe_stride": MODEL_CONSTANT, "cs_stride": MODEL_CONSTANT, "eps": FLOAT,
    },  # fmt: skip
    "triton_moe_route._route_kernel": {"num_experts": MODEL_CONSTANT, "routed_scaling_factor": FLOAT},
    "triton_router_logits._router_logits_kernel": {"E": MODEL_CONSTANT, "stride_x": MODEL_CONSTANT},
    "triton_silu_mul._silu_mul_kernel": dict.fromkeys(
        ("n", "stride_h", "stride_out"), "an MLP's intermediate size on this rank (dense or shared): fixed by the model"
    ),
    "triton_moe_align._moe_align_count_kernel": {"first_expert": MODEL_CONSTANT, "num_local": MODEL_CONSTANT},
    "triton_moe_align._moe_align_kernel": {"first_expert": MODEL_CONSTANT, "num_local": MODEL_CONSTANT},
    "triton_moe_align._moe_align_place_kernel": {"first_expert": MODEL_CONSTANT, "num_local": MODEL_CONSTANT},
    "triton_moe_w4a16._moe_sum_kernel": {"first_expert": MODEL_CONSTANT, "num_local": MODEL_CONSTANT},
    "triton_moe_w4a16._moe_down_kernel": {"w_desc": DESC, "s_desc": DESC},
    "triton_moe_w4a16._moe_gate_up_kernel": {
        "w_desc": DESC, "s_desc": DESC, "top_k": MODEL_CONSTANT,
        "part_rows": "blocks x rows per block: always a multiple of 16",
    },  # fmt: skip
    "triton_norm_rope._rmsnorm_kernel": {
        "n_cols": MODEL_CONSTANT, "x_stride": MODEL_CONSTANT, "r_stride": MODEL_CONSTANT, "eps": FLOAT,
    },  # fmt: skip
    "triton_norm_rope._rope_kernel": {
        "heads": MODEL_CONSTANT, "x_stride_t": MODEL_CONSTANT, "x_stride_h": MODEL_CONSTANT, "cs_stride": MODEL_CONSTANT,
    },  # fmt: skip
    "triton_norm_rope._rope_rotate_kernel": {
        "heads": MODEL_CONSTANT, "x_stride_t": MODEL_CONSTANT, "x_stride_h": MODEL_CONSTANT, "cs_stride": MODEL_CONSTANT,
        "rot_scale": FLOAT,
    },  # fmt: skip
    "triton_sample_pick._sample_pick_kernel": {
        "vocab": MODEL_CONSTANT, "stride_x": MODEL_CONSTANT, "stride_u": MODEL_CONSTANT,
        "piece": "a multiple of the pick's block: one value class",
    },  # fmt: skip
    **dict.fromkeys(
        ("triton_sample_threshold._max_kernel", "triton_sample_threshold._ladder_kernel",
         "triton_sample_threshold._collect_kernel", "triton_sample_threshold._bracket_kernel",
         "triton_sample_threshold._finish_kernel"),
        {"vocab": MODEL_CONSTANT, "stride_x": MODEL_CONSTANT},
    ),  # fmt: skip
    "triton_sample_uniform._sample_uniform_kernel": {
        "vocab": MODEL_CONSTANT, "q": "a quarter of the vocabulary: " + MODEL_CONSTANT, "stride_u": MODEL_CONSTANT,
    },  # fmt: skip
    "triton_row_logsumexp._row_logsumexp_kernel": {
        "vocab": MODEL_CONSTANT, "stride": "the vocabulary (its rows are contiguous copies): " + MODEL_CONSTANT,
    },  # fmt: skip
    "triton_row_lse_topk._row_lse_topk_kernel": {
        "vocab": MODEL_CONSTANT, "stride": "the vocabulary (the sampler's rows are contiguous): " + MODEL_CONSTANT,
    },  # fmt: skip
    "triton_topk._topk_kernel": {"logits_stride": PADDED, "topk": MODEL_CONSTANT},
    "triton_topk._topk_sampled_kernel": {"logits_stride": PADDED, "topk": MODEL_CONSTANT},
    "triton_topk._topk_streamed_kernel": {"logits_stride": PADDED, "topk": MODEL_CONSTANT},
}

LIST = """
import json, sys
sys.path.insert(0, {gpu!r})
from warmup_coverage import jit_kernels
out = {{}}
for name, fn in jit_kernels().items():
    if name.endswith("_kernel"):
        out[name] = [p.name for p in fn.params
                     if not p.is_constexpr and not p.do_not_specialize and not p.name.endswith("_ptr")]
print(json.dumps(out))
"""


def specialised() -> dict[str, list[str]]:
    """Launchable kernels -> their specialised non-pointer arguments (in a process without the
    Triton interpreter, whose kernels keep no parameter list)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "pyworker"), env.get("PYTHONPATH", "")])
    code = LIST.format(gpu=str(ROOT / "bench" / "gpu"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_every_specialised_argument_has_a_reason():
    pytest.importorskip("triton")
    found = specialised()
    # The listing (bench/gpu/warmup_coverage.jit_kernels, which the coverage check counts compiles
    # of) reaches the kernels of every family.
    for kernel in ("triton_topk._topk_streamed_kernel", "triton_moe_w4a16._moe_gate_up_kernel",
                   "triton_indexer._logits_kernel", "triton_sample_pick._sample_pick_kernel",
                   "gluon_sparse_mla._sparse_mla_gluon_kernel", "triton_moe_align._moe_align_runs_kernel"):  # fmt: skip
        assert kernel in found, kernel
    unexplained = {k: [p for p in params if p not in ALLOWED.get(k, {})] for k, params in found.items()}
    unexplained = {k: v for k, v in unexplained.items() if v}
    assert not unexplained, (
        "kernel arguments specialised by Triton without a reason: if one follows a step's shape, "
        f"add it to do_not_specialize; else list it in ALLOWED: {unexplained}"
    )
    # The arguments that follow a step's shape stay unspecialised (the two serving-time compiles of
    # 2026-12-02 were such arguments).
    for kernel, arg in [("triton_topk._topk_streamed_kernel", "width"), ("triton_moe_align._moe_align_runs_kernel", "n_chunks"),
                        ("triton_moe_align._moe_align_count_kernel", "n_chunks"), ("triton_topk._topk_kernel", "nchunk")]:  # fmt: skip
        assert arg not in found[kernel], (kernel, arg)
