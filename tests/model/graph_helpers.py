"""Shared by the decode CUDA graph tests (single rank and tensor parallel): a runner on a tiny
checkpoint, and the check that a graph (or, off CUDA, its static batch run eagerly) gives the
logits of the plan's own batch over random decode batches."""

import os
import random
from dataclasses import replace

import numpy as np
import torch
from model_helpers import VOCAB, Session, rel_err

from nsaserve.model.runner import ModelRunner
from nsaserve.worker.batch import InputPatch


def graph_runner(path, device, dtype=torch.float32, kv="auto", backends=(), **tp):
    """tp: tp_rank / tp_size, inside a process group."""
    r = ModelRunner(
        path, device=torch.device(device), dtype=dtype, kv_cache_dtype=kv, num_pages=160, page_size=4,
        show_progress=False, **tp,
    )  # fmt: skip
    for kind, name in dict(backends).items():
        r.set_backend(kind, name)
    return r


def _decode_batches(session, rng, reqs, steps):
    """Random decode batches: each step a random subset of the requests, in random order."""
    for _ in range(steps):
        chosen = rng.sample(reqs, rng.randint(1, len(reqs)))
        yield [(rid, [rng.randrange(VOCAB)]) for rid in chosen]


def compare_graph_to_eager(r, graphs, steps, exact, seed=None, dp_size=1):
    """Random decode batches (`seed`: the same ones on every rank of a group). float32: the same
    logits to rounding and the same argmax everywhere. bf16: matmuls over the padded batch may
    round differently from those over the real rows (another M), so logits agree to bf16
    precision and argmaxes nearly always. Returns the graphs' logits, concatenated.
    dp_size > 1 (data-parallel attention): the requests alternate between the ranks. Each step
    runs once more with some input tokens left wrong in the plan and patched on the device (the
    worker pipeline's references): graph and eager forward both give the same logits again."""
    assert graphs.bs_buckets == [1, 2, 4, 8] and graphs.len_buckets == [128]
    rng = random.Random(int.from_bytes(os.urandom(4), "little") if seed is None else seed)
    s = Session(r, seed=rng.randrange(100), dp_size=dp_size)
    reqs = list(range(7))
    prompts = [(i, [rng.randrange(VOCAB) for _ in range(rng.randint(3, 40))]) for i in reqs]
    s.step(prompts, ranks={i: i % dp_size for i in reqs})  # prefill, eager
    same = rows = 0
    outputs = []
    for work in _decode_batches(s, rng, reqs, steps):
        plan = s.plan(work, all_logits=False)
        assert graphs.fits(plan)
        got = graphs.run(plan)
        outputs.append(got.cpu())
        want = r.forward_plan(plan)
        assert got.shape == want.shape == (len(work), r.vocab_size)
        assert got.dtype == want.dtype == torch.float32  # (the graphs keep the model's dtype inside)
        assert rel_err(got, want) < (1e-4 if exact else 3e-2), work
        at = np.array(sorted(rng.sample(range(len(work)), max(1, len(work) // 2))), dtype=np.int64)
        wrong = replace(plan, input_ids=plan.input_ids.copy())
        wrong.input_ids[at] = (plan.input_ids[at] + 1) % VOCAB
        patch = InputPatch(at, torch.from_numpy(plan.input_ids[at].astype(np.int64)).to(r.device))
        assert torch.equal(graphs.run(wrong, patch), got), work
        assert torch.equal(r.forward_plan(wrong, patch), want), work
        same += int((got.argmax(-1) == want.argmax(-1)).sum())
        rows += len(work)
        for rid, toks in work:
            s.reqs[rid].cached += len(toks)
    assert same == rows if exact else same >= 0.95 * rows
    return torch.cat(outputs)
