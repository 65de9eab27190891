"""CPU workers share the cores: each of tp_size ranks takes cores // tp_size intra-op threads."""

import os
import subprocess
import sys

import pytest

PROBE = """
import argparse, os, sys, torch
from nsaserve.worker.main import share_cpu_threads
share_cpu_threads(argparse.Namespace(device=sys.argv[1], tp_size=int(sys.argv[2])))
print(torch.get_num_threads())
"""


def threads_after(device: str, tp: int) -> int:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", PROBE, device, str(tp)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_cpu_ranks_split_the_cores(tp):
    cores = len(os.sched_getaffinity(0))
    assert threads_after("cpu", tp) == max(1, cores // tp)


def test_explicit_omp_num_threads_and_gpus_are_left_alone(monkeypatch):
    import argparse

    import torch

    from nsaserve.worker.main import share_cpu_threads

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    share_cpu_threads(argparse.Namespace(device="cpu", tp_size=8))
    monkeypatch.delenv("OMP_NUM_THREADS")
    share_cpu_threads(argparse.Namespace(device="cuda", tp_size=8))
    assert calls == []
    share_cpu_threads(argparse.Namespace(device="cpu", tp_size=8))
    assert calls == [max(1, len(os.sched_getaffinity(0)) // 8)]
