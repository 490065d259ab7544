"""Host zeros that cost no memory until written: the stand-ins of large values read from a
virtual GPU.

A model's state copied to the host (``.cpu()``, a state dict with ``cpu_offload``) has no
values under the emulation: each tensor is a stand-in of zeros. ``torch.zeros`` writes every
byte, so a 7B model's sharded state took its whole size in host memory (the run was killed
at 24 GB) for bytes nothing reads. A large stand-in is instead a fresh anonymous mapping:
the kernel gives its pages zeroed, and only when they are touched.
"""

from __future__ import annotations

import math
import mmap

import torch

__all__ = ["host_zeros"]

# below this a tensor is torch's own (resizable, in the allocator's pool): a page-granular
# mapping of its own is worth it only where the bytes are many
ZERO_PAGES_FROM_BYTES = 4 << 20


def host_zeros(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous host tensor of zeros; from :data:`ZERO_PAGES_FROM_BYTES` on, over
    pages not yet touched (its storage then is not resizable)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < ZERO_PAGES_FROM_BYTES:
        return torch.zeros(shape, dtype=dtype, device="cpu")
    pages = mmap.mmap(-1, nbytes)  # kept alive by the tensor over it
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)
