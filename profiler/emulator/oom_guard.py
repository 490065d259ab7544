"""The GPU's out-of-memory error, raised in the run where the GPU would raise it
(:class:`OomGuard`): a script that catches ``torch.OutOfMemoryError`` to pick its batch
(accelerate's ``find_executable_batch_size``, Lightning's ``BatchSizeFinder``, a loop that
halves the batch) goes on as it would on the GPU.

Each new block a device's tensor asks for is first given to a simulation of that device's
caching allocator (:class:`dpprof.emulator.allocator.CachingAllocatorSim`, the same the
reserved figures come from), whose capacity is what the allocator can have: the GPU, or the
script's memory fraction of it, less the CUDA context and the libraries as modelled, and less
the cuBLAS workspaces (which the reports insert where each thread first ran cuBLAS). Where it
finds no segment, after releasing its cache as c10 does, ``torch.OutOfMemoryError`` is raised
with c10's message, before the tensor is counted. The simulation starts once a device's
tensors reach a quarter of that capacity (the device's allocations so far replayed into it),
so a run far from the GPU's memory pays nothing; from then on it follows every allocation and
free."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dpprof.emulator.allocator import CachingAllocatorSim, SimulatedOutOfMemory
from dpprof.emulator.allocator_blocks import Block
from dpprof.emulator.call_sites import caller_site, relative_site
from dpprof.emulator.cuda_memory import CudaMemory
from dpprof.emulator.events import OWN_STEPS

__all__ = ["MARK", "OomGuard", "OutOfMemoryRaised", "format_size"]

# the end of the error's message: how the error is known again where it was re-raised as
# another object (DataParallel's worker threads re-raise a copy with the traceback's text)
MARK = "(dpprof: raised where the GPU would raise it, from its caching allocator simulated)"


@dataclass(frozen=True)
class OutOfMemoryRaised:
    """Where the run raised ``torch.OutOfMemoryError``, as the GPU would have."""

    site: str  # the script's line, "train.py:11"
    device: int  # the logical cuda index
    requested_bytes: int  # the tensor's bytes
    allocated_bytes: int  # the device's tensors before it
    room_bytes: int  # what the allocator can have: the GPU (or its fraction) less the context

    def words(self) -> str:
        return (f"torch.OutOfMemoryError at {self.site} on cuda:{self.device} "
                f"({format_size(self.requested_bytes)} asked for beside "
                f"{format_size(self.allocated_bytes)} of tensors, where the caching allocator "
                f"can have {format_size(self.room_bytes)})")


def format_size(nbytes: int) -> str:
    """c10's ``format_size``, as its out-of-memory message writes sizes."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    for unit, scale in (("KiB", 1 << 10), ("MiB", 1 << 20)):
        if nbytes < scale << 10:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / (1 << 30):.2f} GiB"


class OomGuard:
    """The ledger's capacity guard (:attr:`dpprof.emulator.storage_ledger.StorageLedger.
    capacity_guard`) and an event follower: a caching allocator simulated live per device
    near its memory."""

    def __init__(self, memory: CudaMemory, outside_bytes: Callable[[int], int],
                 logical: Callable[[int], int]) -> None:
        self.memory = memory
        self._outside = outside_bytes
        self._logical = logical
        self._sims: dict[int, CachingAllocatorSim] = {}
        self._blocks: dict[int, dict[int, Block | None]] = {}
        self._marks_seen = 0
        # the errors raised, in order (the errors themselves are not kept: their tracebacks
        # hold the tensors of the try the script gives up, which its handler frees)
        self.raised: list[OutOfMemoryRaised] = []
        self.listeners: list[Callable[[], None]] = []  # told before each error is raised

    def install(self) -> None:
        storages = self.memory.rt.storages
        storages.capacity_guard = self.check
        storages.followers = (*storages.followers, self)

    def simulation(self, device: int) -> CachingAllocatorSim | None:
        """Runtime ``device``'s live simulation (None: not started)."""
        return self._sims.get(device)

    def room(self, device: int) -> int:
        """What the caching allocator of runtime ``device`` can have now."""
        room = self.memory.capacity_bytes - self._outside(device)
        limit = self.memory.limit_bytes(device)
        return room if limit is None else min(room, limit)

    # ---- the guard ------------------------------------------------------------------------

    def check(self, device: int, serial: int, requested: int) -> None:
        """Before a new tensor of ``requested`` bytes (storage ``serial``) is counted on
        ``device``: its block from the simulation, or ``torch.OutOfMemoryError``."""
        sim = self._sims.get(device)
        if sim is None:
            live = self.memory.rt.storages.counters[device].live_allocated
            if (live + requested) * 4 <= self.memory.capacity_bytes:  # far from it: no more
                limit = self.memory.limit_bytes(device)
                if limit is None or (live + requested) * 4 <= limit:
                    return
            self._play_marks()  # the others' first: the new one's replay holds them all
            sim = self._start(device)
        self._play_marks()
        room = self.room(device)
        sim.capacity_bytes = room
        try:
            block = sim.malloc(requested, self.memory.rt.storages.tag_on(device))
        except SimulatedOutOfMemory:
            self._refuse(device, requested, room, sim)
        self._blocks[device][serial] = block

    def _refuse(self, device: int, requested: int, room: int, sim: CachingAllocatorSim) -> None:
        live = self.memory.rt.storages.counters[device].live_allocated
        raised = OutOfMemoryRaised(relative_site(caller_site()), self._logical(device),
                                   requested, live, room)
        capacity = self.memory.capacity_bytes
        free = max(capacity - sim.reserved_bytes - self._outside(device), 0)
        err = torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {format_size(requested)}. GPU "
            f"{raised.device} has a total capacity of {format_size(capacity)} of which "
            f"{format_size(free)} is free. Including non-PyTorch memory, this process has "
            f"{format_size(capacity - free)} memory in use. Of the allocated memory "
            f"{format_size(sim.allocated_bytes)} is allocated by PyTorch, and "
            f"{format_size(max(sim.reserved_bytes - sim.allocated_bytes, 0))} is reserved by "
            f"PyTorch but unallocated. {MARK}")
        self.raised.append(raised)
        for listener in self.listeners:
            listener()
        err.dpprof_raised = raised  # type: ignore[attr-defined]
        raise err

    def _start(self, device: int) -> CachingAllocatorSim:
        """The device's simulation, its allocations so far replayed into it."""
        sim = CachingAllocatorSim(None, self.memory.allocator_config())
        blocks: dict[int, Block | None] = {}
        for row in self.memory.events_of(device):
            kind = row[0]
            if kind == "alloc":
                blocks[row[1]] = sim.malloc(row[2], row[3] if len(row) > 3 else 0)
            elif kind == "free":
                sim.free(blocks.pop(row[1], None))
            elif kind in OWN_STEPS:
                sim.own_step(row)
        self._sims[device] = sim
        self._blocks[device] = blocks
        self._marks_seen = len(self.memory.rt.storages.events.marks)
        return sim

    def _play_marks(self) -> None:
        """The allocator's own steps since the last look (the cache emptied, a graph's pool
        released), in every simulation."""
        marks = self.memory.rt.storages.events.marks
        for _, row in marks[self._marks_seen:]:
            for sim in self._sims.values():
                sim.own_step(row)
        self._marks_seen = len(marks)

    # ---- the follower ---------------------------------------------------------------------

    def following(self) -> bool:
        return bool(self._sims)

    def follow(self, device: int, serial: int, requested: int, allocated: int) -> None:
        """An event on a simulated device: a free gives its block back; an allocation the
        guard did not see (a kernel's own buffer, a storage resized in place, a mirrored
        replica's) takes one, unchecked."""
        sim = self._sims.get(device)
        if sim is None:
            return
        self._play_marks()
        blocks = self._blocks[device]
        if requested < 0:
            sim.free(blocks.pop(serial, None))
        elif requested > 0 and serial not in blocks:
            sim.capacity_bytes = None
            blocks[serial] = sim.malloc(requested, self.memory.rt.storages.tag_on(device))

    # ---- after the run --------------------------------------------------------------------

    def raised_by(self, exc: BaseException | None) -> OutOfMemoryRaised | None:
        """The out-of-memory error of the run that ``exc`` is or came from (its cause or
        context, as a script that wraps it raises it), None: not one of them."""
        seen: set[int] = set()
        while exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            raised: Any = getattr(exc, "dpprof_raised", None)
            if isinstance(raised, OutOfMemoryRaised):
                return raised
            if MARK in str(exc) and self.raised:  # a copy: the last one raised
                return self.raised[-1]
            exc = exc.__cause__ or exc.__context__
        return None
