"""Recognise CUDA out-of-memory errors in a program's output (for ``dpprof watch``).

The formats, from PyTorch's source (``c10/cuda/CUDACachingAllocator.cpp``,
``DeviceCachingAllocator::malloc``, and ``format_size``):

- PyTorch 2.1 and newer (one line; ``proc_info`` and ``allowed_info`` are optional)::

    CUDA out of memory. Tried to allocate 1.95 GiB. GPU 0 has a total capacity of 14.57 GiB
    of which 1.58 GiB is free. Process 2493055 has 12.02 GiB memory in use. Including
    non-PyTorch memory, this process has 966.00 MiB memory in use. [8.00 GiB allowed; ]Of the
    allocated memory 734.07 MiB is allocated by PyTorch, [with X allocated in private pools
    (e.g., CUDA Graphs), ]and 33.93 MiB is reserved by PyTorch but unallocated. If reserved
    but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=...

  raised as ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` before 2.5,
  ``RuntimeError`` before 1.13).
- PyTorch 1.x to 2.0::

    CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 11.17 GiB total capacity;
    10.50 GiB already allocated; 3.81 MiB free; [8.00 GiB allowed; ]10.76 GiB reserved in
    total by PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb

  and, before 1.5, ``...; 2.56 MiB free; 9.76 MiB cached)``.
- Without a size: ``CUDA error: out of memory`` (a ``cudaMalloc`` outside the caching
  allocator, context creation, a kernel's workspace), NCCL's ``Cuda failure 'out of memory'``,
  cuBLAS/cuDNN ``*_STATUS_ALLOC_FAILED``.

``format_size`` prints "N bytes" up to 1 KiB, then two decimals of KiB, MiB or GiB (1024-based),
so the sizes read back are exact only to that precision.

``GPU N`` is the CUDA device index *inside the program*, i.e. counted after its
``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import dataclasses
import re

from dpprof.result import WatchOom
from dpprof.units import UNIT_BYTES

__all__ = ["MAX_TEXT", "parse_oom_line", "parse_size"]

MAX_TEXT = 1000

_SIZE = r"([0-9]+(?:\.[0-9]+)?) ?(bytes|B|KiB|MiB|GiB|TiB)"
_SIZE_RE = re.compile(rf"^{_SIZE}$")

_EXC = r"(?:(?P<exc>[A-Za-z_][\w.]*(?:Error|Exception)): )?"
_V2 = re.compile(
    _EXC + rf"CUDA out of memory\. Tried to allocate {_SIZE}\. GPU (?P<dev>[0-9]+) has a total "
    rf"capacity of {_SIZE} of which {_SIZE} is free\."
)
_V2_ALLOCATED = re.compile(rf"Of the allocated memory {_SIZE} is allocated by PyTorch")
_V2_RESERVED = re.compile(rf"and {_SIZE} is reserved by PyTorch but unallocated")
_V1 = re.compile(
    _EXC + rf"CUDA out of memory\. Tried to allocate {_SIZE} \(GPU (?P<dev>[0-9]+); {_SIZE} "
    rf"total capacity; {_SIZE} already allocated; {_SIZE} free;"
)
_V1_RESERVED = re.compile(rf"{_SIZE} (?:reserved in total by PyTorch|cached)\)")
_ANY_ALLOCATOR = re.compile(_EXC + r"CUDA out of memory\.")
_CUDA_ERROR = re.compile(
    _EXC + r"(CUDA error: out of memory|Cuda failure '?out of memory'?"
    r"|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED)"
)


def parse_size(text: str) -> int:
    """``"1.95 GiB"`` -> bytes, as PyTorch's ``format_size`` printed it (1024-based)."""
    m = _SIZE_RE.match(text.strip())
    if not m:
        raise ValueError(f"not a PyTorch size: {text!r}")
    return _size(m.group(1), m.group(2))


def _size(num: str, unit: str) -> int:
    return round(float(num) * UNIT_BYTES[unit.lower()])


def parse_oom_line(
    line: str, *, stream: str = "stderr", t_s: float | None = None
) -> WatchOom | None:
    """The out-of-memory error in one line of output, or None when there is none."""
    if "memory" not in line and "ALLOC_FAILED" not in line:
        return None  # the fast path for ordinary output
    m = _V2.search(line)
    if m:
        g = m.groups()
        start = m.start("exc") if m.group("exc") else m.start()
        oom = WatchOom(
            t_s=t_s, stream=stream, text=line[start:][:MAX_TEXT].rstrip(),
            format="caching-allocator", exception=m.group("exc"),
            cuda_index=int(m.group("dev")), requested_bytes=_size(g[1], g[2]),
            total_bytes=_size(g[4], g[5]), free_bytes=_size(g[6], g[7]),
        )
        rest = line[m.end():]
        a = _V2_ALLOCATED.search(rest)
        r = _V2_RESERVED.search(rest)
        return dataclasses.replace(
            oom, allocated_by_pytorch_bytes=_size(a.group(1), a.group(2)) if a else None,
            reserved_unallocated_bytes=_size(r.group(1), r.group(2)) if r else None)
    m = _V1.search(line)
    if m:
        g = m.groups()
        start = m.start("exc") if m.group("exc") else m.start()
        oom = WatchOom(
            t_s=t_s, stream=stream, text=line[start:][:MAX_TEXT].rstrip(),
            format="caching-allocator-1.x", exception=m.group("exc"),
            cuda_index=int(m.group("dev")), requested_bytes=_size(g[1], g[2]),
            total_bytes=_size(g[4], g[5]), allocated_by_pytorch_bytes=_size(g[6], g[7]),
            free_bytes=_size(g[8], g[9]),
        )
        r = _V1_RESERVED.search(line[m.end():])
        if r and oom.allocated_by_pytorch_bytes is not None:
            reserved = _size(r.group(1), r.group(2))
            return dataclasses.replace(oom, reserved_unallocated_bytes=max(
                reserved - oom.allocated_by_pytorch_bytes, 0))
        return oom
    m = _ANY_ALLOCATOR.search(line) or _CUDA_ERROR.search(line)
    if m:
        start = m.start("exc") if m.group("exc") else m.start()
        kind = "caching-allocator" if m.re is _ANY_ALLOCATOR else "cuda-error"
        return WatchOom(
            t_s=t_s, stream=stream, text=line[start:][:MAX_TEXT].rstrip(), format=kind,
            exception=m.group("exc"),
        )
    return None
