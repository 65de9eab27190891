"""Host-to-device copies of a step's host arrays that never wait for the GPU.

A copy from pageable host memory drains the stream first (the driver stages it through its own
buffer), so a step that uploaded its plan that way waited for every kernel queued before it: the
worker pipeline could only launch step N+1 once step N had run. Writing the array into pinned
memory and copying from there queues the copy behind the running step instead; PyTorch's caching
host allocator keeps the pinned block until the copy that reads it has run.
"""

from __future__ import annotations

import numpy as np
import torch


def upload(a: np.ndarray, device: torch.device | str, dtype: type | np.dtype | None = None) -> torch.Tensor:
    """`a` as a fresh tensor on `device`, of numpy `dtype` (default: a's own), queued without
    waiting. Always a copy: plan arrays are read-only views of the received message."""
    host = torch.from_numpy(np.array(a, dtype=dtype))
    if torch.device(device).type != "cuda":
        return host
    pinned = torch.empty_like(host, pin_memory=True)
    pinned.copy_(host)
    return pinned.to(device, non_blocking=True)
