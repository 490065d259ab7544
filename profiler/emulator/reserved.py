"""The one model of a device's memory outside the tensors, over an emulated step.

Every emulated figure of reserved memory and context comes from here (meta, --compute,
--count-reserved, --maxbatch): the caching allocator simulated over the device's own
allocation sequence, the long-lived cuBLAS workspaces first, and the context beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np

from dpprof.emulator.allocator import simulate
from dpprof.emulator.context import ContextModel
from dpprof.emulator.events import EventLog

__all__ = ["AllocationEvent", "DeviceFigures", "fill_gpu_overheads"]


class AllocationEvent(Protocol):
    """What the model reads of an emulated allocation (``VirtualDevices.events``)."""

    @property
    def device(self) -> int: ...  # < 0: a host storage

    @property
    def serial(self) -> int: ...

    @property
    def requested(self) -> int: ...  # > 0: an allocation of that size, < 0: a free


class DeviceFigures(Protocol):
    index: int
    used: bool
    rank: int | None  # DDP: the rank, else None
    peak_reserved_bytes: int | None
    workspace_bytes: int | None
    context_bytes: int | None
    context_breakdown_bytes: dict[str, int]


def fill_gpu_overheads(devices: Sequence[DeviceFigures], events: Iterable[AllocationEvent],
                       ctx: ContextModel,
                       source: Callable[[DeviceFigures], int] | None = None,
                       nccl: bool | None = None) -> None:
    """Per used device: the caching allocator's reserve (a simulation of its pools over the
    device's allocation sequence, cuBLAS workspaces included) and the context.

    ``source``: the event log's device whose sequence a result's device stands for
    (default: its index; DDP ranks: rank 0's device; a mirror: the device it mirrors).
    ``nccl``: whether the devices hold an NCCL communicator (default: DDP ranks do).
    """
    workspaces = [("alloc", -1 - k, size) for k, size in enumerate(ctx.allocator_requests)]
    sequences = _DeviceSequences(events)
    simulated: dict[Any, Any] = {}  # one simulation per distinct sequence
    keys: dict[int, Any] = {}
    for d in devices:
        if not d.used:
            continue
        src = source(d) if source is not None else d.index
        key = keys.get(src)
        if key is None:
            key = keys[src] = sequences.key(src)
        stats = simulated.get(key)
        if stats is None:
            stats = simulated[key] = simulate(workspaces + sequences.sequence(src),
                                              timeline_points=None, stop_on_oom=False)
        d.peak_reserved_bytes = stats.peak_reserved_bytes
        d.workspace_bytes = ctx.workspace_bytes
        d.context_bytes = ctx.outside_allocator_bytes
        d.context_breakdown_bytes = {k: v for k, v in ctx.components().items()
                                     if v and k in ("cuda_context", "cudnn_library")}
        if (d.rank is not None if nccl is None else nccl) and ctx.nccl_bytes:
            d.context_bytes += ctx.nccl_bytes
            d.context_breakdown_bytes["nccl"] = ctx.nccl_bytes


class _DeviceSequences:
    """Each device's allocation sequence (host storages and 0-byte storages left out: they
    take no block) as ("alloc", serial, bytes[, stream]) and ("free", serial, 0) rows (an
    allocation on a side stream names it: ``EventLog.streams``, or an event's ``stream``
    attribute), and a key per sequence equal for two devices exactly when their sequences
    are equal up to the names of their storages (DataParallel's replicas on equal shards,
    DDP's ranks): they simulate alike.
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
        else:
            rows = [(ev.device, ev.serial, ev.requested, getattr(ev, "stream", 0))
                    for ev in events if ev.device >= 0 and ev.requested != 0]
            self.device, self.serial, self.requested, self.stream = (
                np.array([r[i] for r in rows], dtype=np.int64) for i in range(4))
        self._rows: dict[int, np.ndarray] = {}

    def _of(self, device: int) -> np.ndarray:
        rows = self._rows.get(device)
        if rows is None:
            rows = self._rows[device] = np.flatnonzero(self.device == device)
        return rows

    def key(self, device: int) -> tuple[bytes, bytes, bytes]:
        """The sequence with its serials renumbered in order of first appearance."""
        rows = self._of(device)
        serials = self.serial[rows]
        _, first, inverse = np.unique(serials, return_index=True, return_inverse=True)
        rank = np.empty(len(first), dtype=np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(len(first), dtype=np.int64)
        sizes = self.requested[rows]
        # (kind, bytes) as one number: an allocation's size, or -1 for a free
        return (np.where(sizes > 0, sizes, -1).tobytes(), rank[inverse.reshape(-1)].tobytes(),
                self.stream[rows].tobytes())

    def sequence(self, device: int) -> list[tuple[Any, ...]]:
        rows = self._of(device)
        return [(("alloc", serial, size, stream) if stream else ("alloc", serial, size))
                if size > 0 else ("free", serial, 0)
                for serial, size, stream in zip(self.serial[rows].tolist(),
                                                self.requested[rows].tolist(),
                                                self.stream[rows].tolist(), strict=True)]
