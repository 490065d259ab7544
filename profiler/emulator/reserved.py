"""The one model of a device's memory outside the tensors, over an emulated step.

Every emulated figure of reserved memory and context comes from here (meta, --compute,
--count-reserved, --maxbatch): the caching allocator simulated over the device's own
allocation sequence, the long-lived cuBLAS workspaces first, and the context beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from dpprof.emulator.allocator_config import AllocatorConfig
from dpprof.emulator.allocator_replay import simulate
from dpprof.emulator.context import ContextModel
from dpprof.emulator.events import RELEASE_POOL, EventLog
from dpprof.emulator.virtual_devices import (
    BLAS_BACKWARD,
    BLAS_FORWARD,
    BLAS_LT,
    BLAS_WORKER,
)

__all__ = ["AllocationEvent", "GpuOverheads", "ModelledDevice", "gpu_overheads",
           "workspace_inserts"]


class AllocationEvent(Protocol):
    """What the model reads of an emulated allocation (``StorageLedger.events``)."""

    @property
    def device(self) -> int: ...  # < 0: a host storage

    @property
    def serial(self) -> int: ...

    @property
    def requested(self) -> int: ...  # > 0: an allocation of that size, < 0: a free


class ModelledDevice(Protocol):
    """What the model reads of a device's result (``dpprof.result.DeviceResult``)."""

    @property
    def index(self) -> int: ...

    @property
    def used(self) -> bool: ...

    @property
    def rank(self) -> int | None: ...  # DDP: the rank, else None

    @property
    def transient_bytes(self) -> Mapping[str, int]: ...  # a warm-up's blocks alive at the peak


@dataclass(frozen=True)
class GpuOverheads:
    """One used device's memory outside its tensors, as the model figures it."""

    peak_reserved_bytes: int  # the caching allocator's reserve, the workspaces included
    workspace_bytes: int  # the library workspaces the allocator serves (in the reserve)
    context_bytes: int  # outside the allocator: the CUDA context, libraries, NCCL
    # context_bytes by component, in the context model's order
    context_breakdown_bytes: tuple[tuple[str, int], ...]
    # the reserve once the transients are freed where the steady state frees them (None:
    # no transient at the device's peak, or none given)
    steady_peak_reserved_bytes: int | None
    # the limit the allocator ran out of memory at (set_per_process_memory_fraction's
    # share of the GPU), None: no limit, or within it
    out_of_limit_bytes: int | None = None


Device = TypeVar("Device", bound=ModelledDevice)


def gpu_overheads(devices: Sequence[Device], events: Iterable[AllocationEvent],
                  ctx: ContextModel,
                  source: Callable[[Device], int] | None = None,
                  nccl: bool | None = None,
                  blas_first: Mapping[tuple[int, str], int] | None = None,
                  blas_side: Mapping[tuple[int, str, int], tuple[int, int]] | None = None,
                  transients: Mapping[int, tuple[int, str]] | None = None,
                  config: AllocatorConfig | None = None,
                  limits: Mapping[int, int] | None = None,
                  own_nccl_bytes: Mapping[int, int] | None = None,
                  ) -> list[GpuOverheads | None]:
    """Per device, in order, its :class:`GpuOverheads` (None: an unused device): the
    caching allocator's reserve (a simulation of its pools over the device's allocation
    sequence, cuBLAS workspaces included) and the context.

    ``source``: the event log's device whose sequence a result's device stands for
    (default: its index; DDP ranks: rank 0's device; a mirror: the device it mirrors).
    ``nccl``: whether the devices hold an NCCL communicator (default: DDP ranks do).
    ``blas_first``: where each device first ran cuBLAS, by thread
    (:attr:`dpprof.emulator.virtual_devices.VirtualDevices.blas_first`): each workspace enters
    the sequence there, as a handle allocates it at its first use; a workspace whose
    thread ran no cuBLAS op (or without ``blas_first``) goes first. ``blas_side``: where a
    handle first ran cuBLAS on a side stream or in a capture, and under which key.
    ``transients``: storages kept past the point where the steady state frees them
    (:attr:`~dpprof.emulator.storage_ledger.StorageLedger.transients`): a device whose peak
    counts some (``transient_bytes``) also gets the reserve with each freed there
    (``steady_peak_reserved_bytes``). ``config``: the caching allocator's (default: torch's
    defaults). ``limits``: what the allocator of a source device may reserve
    (``set_per_process_memory_fraction``): there the simulation runs under it, releasing its
    cache to stay within it as c10 does, and says whether it ran out
    (``out_of_limit_bytes``). ``own_nccl_bytes``: NCCL's memory on a source device from the
    process's own communicators (``torch.cuda.nccl``'s: DataParallel's broadcast and reduce),
    counted beside a rank's process group's.
    """
    sequences = _DeviceSequences(events)
    simulated: dict[Any, Any] = {}  # one simulation per distinct sequence
    steady: dict[int, int] = {}  # source device -> its steady state's reserve
    keys: dict[int, Any] = {}
    library = tuple((k, v) for k, v in ctx.components().items()
                    if v and k in ("cuda_context", "cudnn_library"))
    out: list[GpuOverheads | None] = []
    for d in devices:
        if not d.used:
            out.append(None)
            continue
        src = source(d) if source is not None else d.index
        key = keys.get(src)
        inserts = workspace_inserts(ctx, src, blas_first or {}, blas_side or {})
        limit = (limits or {}).get(src)
        if key is None:
            key = keys[src] = (sequences.key(src, inserts), limit)
        stats = simulated.get(key)
        if stats is None:
            stats = simulated[key] = simulate(sequences.sequence(src, inserts), limit,
                                              timeline_points=None, stop_on_oom=False,
                                              config=config)
        steady_reserved = None
        if d.transient_bytes and transients:
            if src not in steady:
                moved = sequences.sequence(src, inserts, frees_at=transients)
                steady[src] = simulate(moved, limit, timeline_points=None,
                                       stop_on_oom=False, config=config).peak_reserved_bytes
            steady_reserved = steady[src]
        # a DDP rank (or as told) holds an NCCL communicator, where the model gives it bytes
        communicator = (d.rank is not None if nccl is None else nccl) and ctx.nccl_bytes > 0
        nccl_bytes = (ctx.nccl_bytes if communicator else 0) + (own_nccl_bytes or {}).get(src, 0)
        out.append(GpuOverheads(
            peak_reserved_bytes=stats.peak_reserved_bytes,
            # the context's workspaces and any further handle's or stream's
            workspace_bytes=sum(size for _, _, size, _ in inserts),
            context_bytes=ctx.outside_allocator_bytes + nccl_bytes,
            context_breakdown_bytes=(
                (*library, ("nccl", nccl_bytes)) if nccl_bytes else library),
            steady_peak_reserved_bytes=steady_reserved,
            out_of_limit_bytes=limit if stats.oom else None))
    return out


def workspace_inserts(ctx: ContextModel, device: int,
                      blas_first: Mapping[tuple[int, str], int],
                      blas_side: Mapping[tuple[int, str, int], tuple[int, int]] | None = None,
                      used_only: bool = False) -> list[tuple[int, int, int, int]]:
    """The long-lived workspaces of ``device`` as (event index, block id, bytes, allocator
    key), in the order the allocator gets them: the forward thread's cuBLAS workspace at its
    first cuBLAS op, then (same op) cuBLASLt's at the first addmm, autograd's at its first;
    any further ones (more streams) and those of a thread with no cuBLAS op first (index 0);
    where the program's thread and a thread it started (DataParallel's replica's) both ran
    cuBLAS on the device, one handle each, the second's workspace at its first op.
    A handle's first op on a side stream adds that (handle, stream)'s workspace there, under
    the stream's key, or a capturing CUDA graph's private pool's (``blas_side``:
    :attr:`dpprof.emulator.virtual_devices.VirtualDevices.blas_side`). ``used_only``: those
    of the handles that ran cuBLAS so far only (what the allocator holds now, mid-run)."""
    # the forward's handle is the program thread's, or where only threads it started ran
    # cuBLAS on the device (DataParallel's replicas), theirs; where both did, the second
    # handle's workspace comes at its first op
    forward = [at for at in (blas_first.get((device, BLAS_FORWARD)),
                             blas_first.get((device, BLAS_WORKER))) if at is not None]
    firsts = [min(forward) if forward else None, blas_first.get((device, BLAS_BACKWARD))]
    out: list[tuple[int, int, int, int]] = []
    block = -1
    for k in range(ctx.cublas_workspaces):
        at = firsts[k] if k < len(firsts) else None
        if at is not None or not used_only:
            out.append((0 if at is None else at, block, ctx.cublas_workspace_bytes, 0))
        block -= 1
    if len(forward) == 2 and ctx.cublas_workspaces:
        out.append((max(forward), block, ctx.cublas_workspace_bytes, 0))
        block -= 1
    if ctx.cublaslt_workspace_bytes:
        for _ in range(ctx.cublaslt_workspaces):
            at = blas_first.get((device, BLAS_LT))
            if at is not None or not used_only:
                out.append((0 if at is None else at, block, ctx.cublaslt_workspace_bytes, 0))
            block -= 1
    for (d, role, _), (at, key) in sorted((blas_side or {}).items(),
                                          key=lambda kv: (kv[1][0], kv[0][1])):
        if d != device:
            continue
        size = ctx.cublaslt_workspace_bytes if role == BLAS_LT else ctx.cublas_workspace_bytes
        if size:
            out.append((at, block, size, key))
            block -= 1
    return sorted(out, key=lambda r: r[0])  # stable: the cuBLAS workspace before Lt's


class _DeviceSequences:
    """Each device's allocation sequence (host storages and 0-byte storages left out: they
    take no block) as ("alloc", serial, bytes[, stream]) and ("free", serial, 0) rows (an
    allocation on a side stream names it: ``EventLog.streams``, or an event's ``stream``
    attribute), with the workspaces inserted where they are allocated
    (:func:`workspace_inserts`), and a key per sequence equal for two devices exactly when
    their sequences are equal up to the names of their storages (DataParallel's replicas on
    equal shards, DDP's ranks): they simulate alike.
    Over an :class:`EventLog` the columns are read as arrays, so the cost of a device's key
    is not a Python step per event."""

    def __init__(self, events: Iterable[AllocationEvent]) -> None:
        if isinstance(events, EventLog):
            dev = events.column("device")
            req = events.column("requested")
            keep = (dev >= 0) & (req != 0)
            self.device, self.serial, self.requested, self.stream = (
                dev[keep], events.column("serial")[keep], req[keep],
                events.column("stream")[keep])
            self.index = np.flatnonzero(keep)
            self.marks: list[tuple[int, tuple[str, int, int]]] = list(events.marks)
        else:
            rows = [(ev.device, ev.serial, ev.requested, getattr(ev, "stream", 0), i)
                    for i, ev in enumerate(events) if ev.device >= 0 and ev.requested != 0]
            self.device, self.serial, self.requested, self.stream, self.index = (
                np.array([r[i] for r in rows], dtype=np.int64) for i in range(5))
            self.marks = []  # no marks outside an EventLog
        self._rows: dict[int, np.ndarray] = {}

    def _of(self, device: int) -> np.ndarray:
        rows = self._rows.get(device)
        if rows is None:
            rows = self._rows[device] = np.flatnonzero(self.device == device)
        return rows

    def _offsets(self, device: int, inserts: Sequence[tuple[int, int, int, int]]) -> list[int]:
        """Where each insert goes among the device's rows (before the first row at or
        after its event index)."""
        at = self.index[self._of(device)]
        return [int(np.searchsorted(at, insert[0])) for insert in inserts]

    def key(self, device: int, inserts: Sequence[tuple[int, int, int, int]] = ()
            ) -> tuple[bytes, ...]:
        """The sequence with its serials renumbered in order of first appearance."""
        rows = self._of(device)
        serials = self.serial[rows]
        _, first, inverse = np.unique(serials, return_index=True, return_inverse=True)
        rank = np.empty(len(first), dtype=np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(len(first), dtype=np.int64)
        sizes = self.requested[rows]
        placed = np.array([(o, size, key) for o, (_, _, size, key) in
                           zip(self._offsets(device, inserts), inserts, strict=True)],
                          dtype=np.int64)
        marks = np.array([(o, row[0] == RELEASE_POOL, row[1]) for o, (_, row) in zip(
            np.searchsorted(self.index[rows], [at for at, _ in self.marks]).tolist(),
            self.marks, strict=True)], dtype=np.int64)
        # (kind, bytes) as one number: an allocation's size, or -1 for a free
        return (np.where(sizes > 0, sizes, -1).tobytes(), rank[inverse.reshape(-1)].tobytes(),
                self.stream[rows].tobytes(), placed.tobytes(), marks.tobytes())

    def sequence(self, device: int, inserts: Sequence[tuple[int, int, int, int]] = (),
                 frees_at: Mapping[int, tuple[int, str]] | None = None
                 ) -> list[tuple[Any, ...]]:
        """The device's rows with ``inserts`` (workspaces) allocated where they go; with
        ``frees_at`` (serial -> (event index, ...)), each of those storages of the device
        freed at that index instead of where it was."""
        rows = self._of(device)
        serials = self.serial[rows].tolist()
        out: list[tuple[Any, ...]] = [
            (("alloc", serial, size, stream) if stream else ("alloc", serial, size))
            if size > 0 else ("free", serial, 0)
            for serial, size, stream in zip(serials, self.requested[rows].tolist(),
                                            self.stream[rows].tolist(), strict=True)]
        at = self.index[rows]
        placed = [(int(np.searchsorted(at, index)), k,
                   ("alloc", block, size, key) if key else ("alloc", block, size))
                  for k, (index, block, size, key) in enumerate(inserts)]
        # the allocator's own steps (the cache emptied, a graph's pool released), in their
        # order, before what the workspaces' first use put at the same place
        placed += [(int(np.searchsorted(at, index)), k - len(self.marks), row)
                   for k, (index, row) in enumerate(self.marks)]
        if frees_at:
            mine = set(serials) & set(frees_at)
            out = [r if r[0] != "free" or r[1] not in mine else None for r in out]  # type: ignore[misc]
            placed += [(int(np.searchsorted(at, frees_at[s][0])), len(inserts) + k,
                        ("free", s, 0)) for k, s in enumerate(sorted(mine))]
        # from the last: an insert does not move the offsets of those before it (two at
        # one offset keep their order)
        for offset, _, row in sorted(placed, reverse=True):
            out.insert(offset, row)
        return [r for r in out if r is not None]
