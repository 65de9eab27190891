"""torch.distributed for the tensor-parallel group: gloo on CPU, NCCL on CUDA.

`serve` picks a free localhost port and passes `tcp://127.0.0.1:PORT` to every rank; the group
is the default process group, which the model's collectives use.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def init_distributed(args) -> None:
    if dist.is_initialized():
        return
    backend = "nccl" if args.device == "cuda" else "gloo"
    if backend == "nccl":
        # NVLink multicast (NVLS) stays off: it needs fabric setup many hosts lack, and all-reduce
        # sizes here gain nothing from it.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(args.rank % max(1, torch.cuda.device_count()))
    dist.init_process_group(
        backend=backend,
        init_method=args.dist_init_method,
        rank=args.rank,
        world_size=args.tp_size,
        timeout=datetime.timedelta(minutes=10),
    )
