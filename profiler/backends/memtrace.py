"""Allocation records from ``torch.profiler``: the allocator's own account of a step.

``record()`` runs a function under ``torch.profiler.profile(profile_memory=True)`` and
returns every allocation and free the profiler saw, in time order (walk of
``prof.profiler.kineto_results.experimental_event_tree()`` for ``_EventType.Allocation``
nodes; ``alloc_size`` is positive for an allocation, negative for a free). On CPU tensors
these come from the CPU allocator, so they include whatever a CPU kernel allocates
internally (see :data:`CPU_ONLY_ALLOCATIONS`); on CUDA tensors from the caching allocator.

:func:`peak_of` turns such a list into the peak of live bytes, relative to the start of
the recording (requested bytes; ``rounded=True`` rounds each block as the CUDA caching
allocator does, 512 B).
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

# Known differences between what a CPU kernel allocates and what a CUDA kernel (or the
# meta kernel the emulator runs) allocates, found by the checks in tests/test_fidelity.py.
CPU_ONLY_ALLOCATIONS: dict[str, str] = {
    "aten::mse_loss": (
        "the CPU kernel (reduction='mean') computes the elementwise loss into a buffer the "
        "size of the input and returns a 0-dim view of it: the 4-byte loss keeps the whole "
        "buffer alive until it dies (meta and CUDA return a 4-byte storage); the CPU kernel "
        "also allocates a second input-sized temporary during the call"
    ),
    "mkldnn convolution scratch": (
        "the CPU (oneDNN) convolution and its backward allocate reordered copies and "
        "scratch inside the kernel (e.g. a contiguous copy of grad_output); on a GPU cuDNN "
        "takes a workspace from the caching allocator instead (modelled separately)"
    ),
    "CPU batch_norm scratch": (
        "the CPU batch_norm kernel allocates per-channel temporaries inside the kernel"
    ),
    "CPU layer_norm backward scratch": (
        "the CPU layer_norm backward resizes per-row buffers inside the kernel"
    ),
    "CPU flash attention scratch": (
        "the CPU flash-attention kernel and its backward allocate per-thread query/key "
        "blocks and accumulators inside the kernel (on a GPU the kernel uses shared memory)"
    ),
    "freed unseen": (
        "a free the profiler did not record, made on a thread it does not see (gloo's worker "
        "threads destroy their work objects and the tensors they hold), put back when the "
        "address was handed out again (with_unseen_frees): when it really happened is "
        "unknown, so it is not matched"
    ),
    "wrapped scalars": (
        "0-dim CPU tensors made from Python or C++ numbers outside the dispatcher "
        "(c10::scalar_to_tensor, e.g. the reducer's 1/world_size in mul_out, the scalar of "
        "div_/mul_ by a number): 4 or 8 bytes each, host memory on a GPU"
    ),
}


# Records and events this small are wrapped scalars or 0-dim tensors: the CPU makes 0-dim
# wrapped scalars (4-8 B) outside the dispatcher, in patterns that cannot be told apart from
# the 4-8 byte tensors both sides make (losses, DDP's bucket-count tensors); the checks
# leave them out on both sides.
SCALAR_BYTES = 8


@dataclass(frozen=True)
class Alloc:
    """One allocator event: ``size`` > 0 allocates, < 0 frees."""

    t_ns: int
    size: int
    op: str  # the enclosing profiler ops, innermost first, joined by " < " ("" if none)
    ptr: int = 0  # the block's address (pairs an allocation with its free)


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null for a moment: libkineto prints a
    ``USDT: ... profiler_start`` / ``profiler_stop`` line on every profiler start and stop,
    which is noise in dpprof's output. Python-level errors raised meanwhile still propagate."""
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to silence
        yield
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 2)
        finally:
            os.close(devnull)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def start_profiler(prof: Any) -> None:
    with quiet_stderr():
        prof.__enter__()


def stop_profiler(prof: Any) -> None:
    with quiet_stderr():
        prof.__exit__(None, None, None)


def record(fn: Callable[[], T]) -> tuple[T, list[Alloc]]:
    """Run ``fn`` under the profiler; its result and the allocation events, in time order."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
    start_profiler(prof)
    try:
        out = fn()
    finally:
        stop_profiler(prof)
    return out, allocations(prof)


def allocations(prof: Any) -> list[Alloc]:
    """The ``_EventType.Allocation`` nodes of a finished profile, in time order."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int, Alloc]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    order = 0
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            names = []
            parent = node.parent
            while parent is not None:
                names.append(parent.name)
                parent = parent.parent
            events.append((node.start_time_ns, order, Alloc(
                node.start_time_ns, int(node.extra_fields.alloc_size), " < ".join(names),
                int(node.extra_fields.ptr),
            )))
            order += 1
        stack.extend(node.children)
    events.sort(key=lambda e: (e[0], e[1]))
    return with_unseen_frees([e[2] for e in events])


UNSEEN_FREE = "[freed on a thread the profiler does not see]"


def with_unseen_frees(events: Sequence[Alloc]) -> list[Alloc]:
    """``events`` with the frees the profiler could not record put back.

    The profiler records an allocator event only on a thread where it is enabled (its state
    is thread-local): a block whose last reference dies on another thread (gloo's worker
    threads, started before the profiler, destroy their work objects and the tensors they
    hold) has its allocation recorded and its free not, so it would count as live for
    ever. When an address is handed out again while its block still counts as live, that
    block was freed before: its free (``op`` :data:`UNSEEN_FREE`) is put just before the
    new allocation, the latest moment it can have happened. A block freed unseen whose
    address is never reused stays live."""
    out: list[Alloc] = []
    live: dict[int, int] = {}
    for e in events:
        if e.size > 0 and e.ptr:
            old = live.pop(e.ptr, None)
            if old is not None:
                out.append(Alloc(e.t_ns, -old, UNSEEN_FREE, e.ptr))
            live[e.ptr] = e.size
        elif e.size < 0:
            live.pop(e.ptr, None)
        out.append(e)
    return out


def peak_of(events: Sequence[Alloc], rounded: bool = False) -> int:
    """Peak of live bytes over ``events`` (0 at the start; frees of older blocks count)."""
    live = peak = 0
    for e in events:
        if rounded:
            mag = ((abs(e.size) + 511) // 512) * 512
            live += mag if e.size > 0 else -mag
        else:
            live += e.size
        peak = max(peak, live)
    return peak


def relative_peak(deltas: Sequence[int]) -> int:
    """Peak of the running sum of ``deltas`` (bytes, signed), starting from 0."""
    live = peak = 0
    for d in deltas:
        live += d
        if live > peak:
            peak = live
    return peak


def step_span(prof: Any, name: str) -> tuple[int, int] | None:
    """(start, end) in the profiler's clock of the first event called ``name``
    (a ``torch.profiler.record_function``), or None."""
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.name == name:
            return int(node.start_time_ns), int(node.end_time_ns)
        stack.extend(node.children)
    return None


# CPU kernels (a record inside one of these, with no counterpart at the dispatcher, is the
# kernel's own scratch; a CUDA kernel allocates differently or through cuDNN's workspace).
_CPU_KERNELS: dict[str, str] = {
    "mse_loss": "aten::mse_loss",
    "MseLoss": "aten::mse_loss",
    "mkldnn_convolution": "mkldnn convolution scratch",
    "convolution_backward": "mkldnn convolution scratch",
    "native_batch_norm": "CPU batch_norm scratch",
    "native_layer_norm_backward": "CPU layer_norm backward scratch",
    "flash_attention_for_cpu": "CPU flash attention scratch",
}


def cpu_only_reason(e: Alloc) -> str | None:
    """Why a profiler record with no emulator counterpart is expected (a key of
    :data:`CPU_ONLY_ALLOCATIONS`), or None when it should have had one."""
    if e.op == UNSEEN_FREE:
        return "freed unseen"
    for needle, why in _CPU_KERNELS.items():
        if needle in e.op:
            return why
    if abs(e.size) <= 8:
        return "wrapped scalars"
    return None


@dataclass
class Alignment:
    """The emulator's events matched, in order, against the profiler's records."""

    matched: int  # emulator events found in the records, same size, same order
    missing: list[int]  # emulator events with no record
    unexplained: list[Alloc]  # records with no emulator event and no known reason
    cpu_only: dict[str, int]  # reason -> number of records it explains
    kept: list[Alloc]  # the records less the explained ones (their peak is comparable)


def _kernel_frames(op: str) -> str:
    """``op``'s call chain without the allocating frames (``aten::empty < ...``): the kernel
    an allocation was made in."""
    frames = op.split(" < ")
    while len(frames) > 1 and frames[0].startswith("aten::empty"):
        frames.pop(0)
    return " < ".join(frames)


def _is_scratch(measured: Sequence[Alloc], j: int) -> bool:
    """Whether the allocation ``measured[j]`` is freed inside the kernel that made it (a
    kernel's scratch; a result outlives its kernel)."""
    e = measured[j]
    for f in measured[j + 1:]:
        if f.ptr == e.ptr and f.size == -e.size:
            return _kernel_frames(f.op) == _kernel_frames(e.op)
    return False


# How far (in records) a result may sit from where the alignment left its emulated event
# missing and still be taken for it: a swap of neighbours, never a block met elsewhere.
_REORDER_RECORDS = 4


def _reordered_counterparts(gaps: Sequence[tuple[Sequence[int], int, int]],
                            measured: Sequence[Alloc], left_over: Sequence[int]) -> set[int]:
    """The left-over records (indices) that are the emulator's missing events after all:
    an allocation that outlives its kernel, of the size of a missing event whose place
    (``gaps``: the events left missing and the records ``[j1, j2)`` in their place) is within
    :data:`_REORDER_RECORDS` records of it, and the free of such an allocation where a free
    of that size is missing too. difflib matches in order, and a CPU kernel may make its
    results in another order than the GPU's, with its scratch between them (oneDNN's
    convolution backward on AVX2 makes the bias's gradient before the weight's, on AVX-512
    after)."""
    want = [Counter(x for x in sizes if x > 0) for sizes, _, _ in gaps]
    frees = Counter(x for sizes, _, _ in gaps for x in sizes if x < 0)
    rescued: set[int] = set()
    ptrs: set[int] = set()
    for j in left_over:
        e = measured[j]
        if e.size > 0:
            near = next((k for k, (_, j1, j2) in enumerate(gaps)
                         if want[k][e.size] > 0
                         and j1 - _REORDER_RECORDS <= j < j2 + _REORDER_RECORDS), None)
            if near is not None and not _is_scratch(measured, j):
                want[near][e.size] -= 1
                rescued.add(j)
                ptrs.add(e.ptr)
        elif e.ptr in ptrs and frees[e.size] > 0:
            frees[e.size] -= 1
            rescued.add(j)
            ptrs.discard(e.ptr)
    return rescued


def align(emulated: Sequence[int], measured: Sequence[Alloc]) -> Alignment:
    """Match the emulator's signed sizes against the profiler's (``difflib`` longest
    matching blocks, no junk heuristic); classify what is left over. A free whose
    allocation was explained (same address) is explained with it."""
    import difflib

    a = [x for x in emulated if x]  # a 0-byte storage takes no block
    b = [e.size for e in measured]
    sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
    missing: list[int] = []
    unexplained: list[Alloc] = []
    cpu_only: dict[str, int] = {}
    explained_ptrs: dict[int, str] = {}
    drop: set[int] = set()
    matched = 0
    left_over: list[int] = []
    gaps: list[tuple[Sequence[int], int, int]] = []
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            matched += i2 - i1
            continue
        missing += a[i1:i2]
        gaps.append((a[i1:i2], j1, j2))
        left_over += range(j1, j2)
    rescued = _reordered_counterparts(gaps, measured, left_over)
    matched += len(rescued)
    found = Counter(measured[j].size for j in rescued)
    still_missing: list[int] = []
    for x in missing:
        if found[x] > 0:
            found[x] -= 1
        else:
            still_missing.append(x)
    missing = still_missing
    for j in left_over:
        if j in rescued:
            continue
        e = measured[j]
        why = explained_ptrs.pop(e.ptr, None) if e.size < 0 else None
        why = why or cpu_only_reason(e)
        if why is None:
            unexplained.append(e)
            continue
        if e.size > 0:
            explained_ptrs[e.ptr] = why
        cpu_only[why] = cpu_only.get(why, 0) + 1
        drop.add(j)
    kept = [e for j, e in enumerate(measured) if j not in drop]
    return Alignment(matched, missing, unexplained, cpu_only, kept)
