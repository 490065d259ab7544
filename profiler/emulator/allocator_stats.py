"""``torch.cuda.memory_stats()`` of a virtual GPU: c10's ``DeviceStats``
(``c10/core/CachingDeviceAllocator.h``), every key torch's dict has, kept over a replay of the
device's allocations through the simulated caching allocator (:func:`memory_stats`).

Each statistic has its ``current``, ``peak``, ``allocated`` (all increases) and ``freed`` (all
decreases), for ``all`` blocks and for the ``small_pool`` and ``large_pool``, as c10's
``StatArray``. Allocations, active blocks and their bytes are the tensors' (their storages'
bytes rounded as the runtime's ledger rounds them, what ``torch.cuda.memory_allocated()``
answers), in the pool their rounded size falls in; segments and reserved bytes are the
simulated allocator's; the inactive split blocks are its free blocks in segments that are
split, updated where c10 updates them (``alloc_found_block``, ``free_block``): a split makes
the rest inactive, a split block taken or merged away is no longer. With expandable
segments c10 keeps no inactive-split figures: none here either. ``num_sync_all_streams``
counts the cache releases (``empty_cache`` and the out-of-memory retries), as c10's
``synchronize_and_free_events`` runs in each. Not given: ``reserved_bytes_by_private_pools``
(the CUDA graphs' and memory pools' own reserve: the pools' segments count in the rest)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dpprof.emulator.allocator import CachingAllocatorSim, SimulatedOutOfMemory
from dpprof.emulator.allocator_blocks import Block
from dpprof.emulator.allocator_config import K_SMALL_SIZE, AllocatorConfig, block_bytes
from dpprof.emulator.events import EMPTY_CACHE, OWN_STEPS

__all__ = ["POOLED", "Stat", "memory_stats"]

# c10's per-pool statistics, in the order torch's memory_stats lists them
POOLED = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
          "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
POOLS = ("all", "large_pool", "small_pool")
OVERSIZE = ("oversize_allocations", "oversize_segments")


@dataclass
class Stat:
    """c10's ``Stat``: the current value, its peak, and the sums of its rises and falls."""

    current: int = 0
    peak: int = 0
    allocated: int = 0
    freed: int = 0

    def change(self, amount: int) -> None:
        if amount > 0:
            self.allocated += amount
        else:
            self.freed -= amount
        self.current += amount
        if self.current > self.peak:
            self.peak = self.current


class _DeviceStats:
    """The statistics over one replay (per pool where c10 keeps them per pool)."""

    def __init__(self) -> None:
        self.pooled = {(name, pool): Stat() for name in POOLED for pool in POOLS}
        self.oversize = {name: Stat() for name in OVERSIZE}
        self.sync_all_streams = 0

    def change(self, name: str, small: bool, amount: int) -> None:
        if amount:
            self.pooled[(name, "all")].change(amount)
            self.pooled[(name, "small_pool" if small else "large_pool")].change(amount)

    def reset_peaks(self) -> None:
        for stat in (*self.pooled.values(), *self.oversize.values()):
            stat.peak = stat.current

    def reset_accumulated(self) -> None:
        for stat in (*self.pooled.values(), *self.oversize.values()):
            stat.allocated = stat.freed = 0
        self.sync_all_streams = 0


def memory_stats(events: Iterable[Sequence[Any]], config: AllocatorConfig) -> dict[str, int]:
    """torch's ``memory_stats()`` dict after ``events`` (:func:`dpprof.emulator.
    allocator_replay.simulate`'s events, with ``"reset_accumulated"`` for
    ``reset_accumulated_memory_stats``), its keys sorted as torch sorts them."""
    sim = CachingAllocatorSim(None, config)
    st = _DeviceStats()
    live: dict[Any, tuple[Block, int, int]] = {}
    mss = config.max_split_size
    split_stats = not config.expandable_segments
    segments = (sim.num_device_alloc, sim.num_device_free, sim.reserved_bytes)
    since = _Counts()  # the simulation's counts at the last reset_accumulated
    for ev in events:
        kind = ev[0]
        if kind == "alloc":
            try:
                block = sim.malloc(int(ev[2]), ev[3] if len(ev) > 3 else 0)
            except SimulatedOutOfMemory:
                continue
            if block is None:
                continue
            requested = int(ev[2])
            rounded = block_bytes(requested)
            small = rounded <= K_SMALL_SIZE
            live[ev[1]] = (block, rounded, requested)
            for name, amount in (("allocation", 1), ("active", 1), ("allocated_bytes", rounded),
                                 ("active_bytes", rounded), ("requested_bytes", requested)):
                st.change(name, small, amount)
            if mss is not None and block.size >= mss:
                st.oversize["oversize_allocations"].change(1)
            if split_stats:
                _taken(st, block)
        elif kind == "free":
            found = live.pop(ev[1], None)
            if found is None:
                continue
            block, rounded, requested = found
            small = rounded <= K_SMALL_SIZE
            subsumed = [b for b in (block.prev, block.next)
                        if b is not None and not b.allocated and b.mapped]
            sim.free(block)
            for name, amount in (("allocation", -1), ("active", -1),
                                 ("allocated_bytes", -rounded), ("active_bytes", -rounded),
                                 ("requested_bytes", -requested)):
                st.change(name, small, amount)
            if mss is not None and block.size >= mss:
                st.oversize["oversize_allocations"].change(-1)
            if split_stats:
                _given_back(st, block, subsumed)
        elif kind in OWN_STEPS:
            sim.own_step(ev)
            st.sync_all_streams += kind == EMPTY_CACHE[0]
        elif kind == "reset_peak":
            st.reset_peaks()
        elif kind == "reset_accumulated":
            st.reset_accumulated()
            since = _Counts(sim.num_alloc_retries, sim.num_ooms, sim.num_device_alloc,
                            sim.num_device_free)
        now = (sim.num_device_alloc, sim.num_device_free, sim.reserved_bytes)
        if now != segments:
            _segments(st, sim, mss)
            segments = now
    return _as_dict(st, sim, mss, since)


@dataclass(frozen=True)
class _Counts:
    """The simulation's event counts (c10 resets its own with the accumulated stats)."""

    alloc_retries: int = 0
    ooms: int = 0
    device_alloc: int = 0
    device_free: int = 0


def _taken(st: _DeviceStats, block: Block) -> None:
    """``alloc_found_block``'s inactive-split changes: ``block`` was just allocated, from a
    free block that it split (the rest follows it, free) or took whole."""
    rest = block.next if block.next is not None and not block.next.allocated else None
    if rest is not None:  # split: free neighbours never stay beside a freed block
        if block.prev is not None or rest.next is not None:  # the block was a split one
            st.change("inactive_split_bytes", block.small, -block.size)
        else:
            st.change("inactive_split", block.small, 1)
            st.change("inactive_split_bytes", block.small, rest.size)
    elif block.prev is not None or block.next is not None:
        st.change("inactive_split", block.small, -1)
        st.change("inactive_split_bytes", block.small, -block.size)


def _given_back(st: _DeviceStats, block: Block, subsumed: list[Block]) -> None:
    """``free_block``'s: each free neighbour merged in stops being an inactive split block;
    the merged block is one if its segment is still split."""
    for b in subsumed:
        st.change("inactive_split", block.small, -1)
        st.change("inactive_split_bytes", block.small, -b.size)
    if block.prev is not None or block.next is not None:
        st.change("inactive_split", block.small, 1)
        st.change("inactive_split_bytes", block.small, block.size)


def _segments(st: _DeviceStats, sim: CachingAllocatorSim, mss: int | None) -> None:
    """The segments and reserved bytes per pool, moved to the simulation's (after it
    allocated or released segments)."""
    held = {(name, small): 0 for name in ("segment", "reserved_bytes") for small in (0, 1)}
    oversize = 0
    for s in sim.snapshot():
        small = int(not s["is_large"])
        held[("segment", small)] += 1
        held[("reserved_bytes", small)] += s["total_size"]
        oversize += mss is not None and s["total_size"] >= mss
    for (name, small), value in held.items():
        pool = "small_pool" if small else "large_pool"
        st.change(name, bool(small), value - st.pooled[(name, pool)].current)
    seg = st.oversize["oversize_segments"]
    seg.change(oversize - seg.current)


def _as_dict(st: _DeviceStats, sim: CachingAllocatorSim, mss: int | None,
             since: _Counts) -> dict[str, int]:
    out: dict[str, int] = {}
    for (name, pool), stat in st.pooled.items():
        for metric in ("current", "peak", "allocated", "freed"):
            out[f"{name}.{pool}.{metric}"] = getattr(stat, metric)
    for name, stat in st.oversize.items():
        for metric in ("current", "peak", "allocated", "freed"):
            out[f"{name}.{metric}"] = getattr(stat, metric)
    retries = sim.num_alloc_retries - since.alloc_retries
    out["num_alloc_retries"] = retries
    out["num_ooms"] = sim.num_ooms - since.ooms
    # c10 synchronises every stream at each release of the cache: an empty_cache, a retry
    out["num_sync_all_streams"] = st.sync_all_streams + retries
    out["num_device_alloc"] = sim.num_device_alloc - since.device_alloc
    out["num_device_free"] = sim.num_device_free - since.device_free
    out["max_split_size"] = -1 if mss is None else mss
    # throw_on_cudamalloc_oom's refusals: not modelled (never set here)
    out["num_oom_rejections"] = 0
    return dict(sorted(out.items()))
