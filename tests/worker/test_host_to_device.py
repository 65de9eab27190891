"""upload(): a fresh, writable tensor of the asked dtype on the asked device, from a read-only array
(plan arrays are views of the received message)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nsaserve.worker.host_to_device import upload

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_upload_copies_converts_and_places(device):
    src = np.arange(-3, 7, dtype=np.int64)
    src.setflags(write=False)
    t = upload(src, device, np.int32)
    assert t.dtype == torch.int32 and t.device.type == device
    assert t.cpu().tolist() == list(range(-3, 7))
    t.add_(1)  # writable, and not the message's memory
    assert src[0] == -3
    f = upload(np.array([0.5, 2.0], dtype=np.float32), device)
    assert f.dtype == torch.float32 and f.cpu().tolist() == [0.5, 2.0]
    assert upload(np.zeros(0, dtype=np.int64), device).shape == (0,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_upload_queues_behind_running_kernels():
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)
    busy = torch.cuda.Event()
    busy.record()
    t = upload(np.arange(100_000, dtype=np.int64), "cuda")
    assert not busy.query(), "the copy waited for the kernel queued before it"
    assert int(t[-1]) == 99_999  # and it ran after it, in stream order
