"""Session-wide test setup.

Without a GPU, Triton kernels run in Triton's CPU interpreter. The switch is read when a kernel
module is imported, and any test may import one first (through the kernel registry), so it is set
here, before any test module loads.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
