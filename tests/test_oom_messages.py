"""Recognising PyTorch's CUDA out-of-memory messages, in every format PyTorch has printed."""

from __future__ import annotations

import pytest

from dpprof.backends.oom_messages import parse_oom_line, parse_size

GIB = 2**30
MIB = 2**20

# PyTorch 2.5+ (torch.OutOfMemoryError), with the process report (reportProcessMemoryInfo).
V2 = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.95 GiB. GPU 0 has a total "
    "capacity of 14.57 GiB of which 1.58 GiB is free. Process 2493055 has 12.02 GiB memory in "
    "use. Including non-PyTorch memory, this process has 966.00 MiB memory in use. Of the "
    "allocated memory 734.07 MiB is allocated by PyTorch, and 33.93 MiB is reserved by PyTorch "
    "but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
    "documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
# 2.1-2.4 (torch.cuda.OutOfMemoryError), with a memory fraction and CUDA-graph private pools.
V2_FRACTION = (
    "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 KiB. GPU 3 has "
    "a total capacity of 79.15 GiB of which 10.00 GiB is free. 40.00 GiB allowed; Of the "
    "allocated memory 39.50 GiB is allocated by PyTorch, with 1.00 GiB allocated in private "
    "pools (e.g., CUDA Graphs), and 100 bytes is reserved by PyTorch but unallocated. If "
    "reserved but unallocated memory is large try setting ..."
)
# 1.x to 2.0.
V1 = (
    "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 1; 11.17 GiB total "
    "capacity; 10.50 GiB already allocated; 3.81 MiB free; 10.76 GiB reserved in total by "
    "PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb to "
    "avoid fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
)
# Before 1.5.
V1_CACHED = (
    "RuntimeError: CUDA out of memory. Tried to allocate 2.00 MiB (GPU 0; 11.00 GiB total "
    "capacity; 8.63 GiB already allocated; 2.56 MiB free; 9.76 MiB cached)"
)


def test_sizes_as_format_size_prints_them() -> None:
    assert parse_size("1024 bytes") == 1024
    assert parse_size("512.00 KiB") == 512 * 1024
    assert parse_size("1.95 GiB") == round(1.95 * GIB)
    assert parse_size("20.00 MiB") == 20 * MIB
    with pytest.raises(ValueError):
        parse_size("20 MB")  # format_size never prints decimal units


def test_pytorch_2_message() -> None:
    oom = parse_oom_line("Traceback ... " + V2, stream="stderr", t_s=3.5)
    assert oom is not None
    assert oom.format == "caching-allocator"
    assert oom.exception == "torch.OutOfMemoryError"
    assert oom.text.startswith("torch.OutOfMemoryError: CUDA out of memory.")
    assert (oom.cuda_index, oom.t_s, oom.stream) == (0, 3.5, "stderr")
    assert oom.requested_bytes == round(1.95 * GIB)
    assert oom.total_bytes == round(14.57 * GIB)
    assert oom.free_bytes == round(1.58 * GIB)
    assert oom.allocated_by_pytorch_bytes == round(734.07 * MIB)
    assert oom.reserved_unallocated_bytes == round(33.93 * MIB)


def test_pytorch_2_with_fraction_and_private_pools() -> None:
    oom = parse_oom_line(V2_FRACTION)
    assert oom is not None
    assert oom.exception == "torch.cuda.OutOfMemoryError"
    assert (oom.cuda_index, oom.requested_bytes) == (3, 512 * 1024)
    assert oom.free_bytes == 10 * GIB
    assert oom.allocated_by_pytorch_bytes == round(39.5 * GIB)
    assert oom.reserved_unallocated_bytes == 100


def test_pytorch_1_messages() -> None:
    oom = parse_oom_line(V1)
    assert oom is not None
    assert oom.format == "caching-allocator-1.x"
    assert (oom.cuda_index, oom.requested_bytes, oom.free_bytes) == (
        1, 20 * MIB, round(3.81 * MIB)
    )
    assert oom.total_bytes == round(11.17 * GIB)
    assert oom.allocated_by_pytorch_bytes == round(10.5 * GIB)
    assert oom.reserved_unallocated_bytes == round(10.76 * GIB) - round(10.5 * GIB)
    old = parse_oom_line(V1_CACHED)
    assert old is not None and old.cuda_index == 0 and old.requested_bytes == 2 * MIB


@pytest.mark.parametrize(
    "line",
    [
        "RuntimeError: CUDA error: out of memory",
        "node1:123:456 [0] NCCL WARN Cuda failure 'out of memory'",
        "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "torch.OutOfMemoryError: CUDA out of memory. (a format dpprof does not know)",
    ],
)
def test_messages_without_sizes(line: str) -> None:
    oom = parse_oom_line(line)
    assert oom is not None
    assert oom.cuda_index is None and oom.requested_bytes is None
    assert oom.format in ("cuda-error", "caching-allocator")


@pytest.mark.parametrize(
    "line",
    [
        "epoch 3: loss 0.25, memory 12.3 GiB",
        "we are out of memory ideas",
        "INFO using 2 GPUs with 80 GiB memory each",
        "",
    ],
)
def test_ordinary_lines_are_not_oom(line: str) -> None:
    assert parse_oom_line(line) is None


def test_text_is_bounded() -> None:
    oom = parse_oom_line(V2 + " " + "x" * 5000)
    assert oom is not None and len(oom.text) == 1000
