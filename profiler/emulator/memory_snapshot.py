"""``torch.cuda``'s memory snapshot of the virtual GPUs: what PyTorch's memory visualizer
(pytorch.org/memory_viz) reads, as the program asks for it.

``torch.cuda.memory._record_memory_history()`` starts the record of each allocator action,
``_snapshot()`` (and ``_dump_snapshot(path)``, which pickles it; ``memory_snapshot()``, its
segments) gives the caching allocator's segments and blocks now and, while recording, the
trace of its actions since. On a CPU build torch has none of these (``torch._C`` lacks
them: the script failed at its first call). Here each device's allocations and frees so far
(the runtime's event log) are replayed through the simulated caching allocator
(:class:`dpprof.emulator.allocator.CachingAllocatorSim`, as ``torch.cuda.memory_reserved``
is answered): its segments in address order, each block at its address with its state and
requested size; the trace's ``alloc`` / ``free_requested`` / ``free_completed`` of each
block and ``segment_alloc`` of each new segment, in order. The virtual GPUs record no call
stacks: every ``frames`` is empty.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dpprof.emulator.allocator import CachingAllocatorSim, SimulatedOutOfMemory, stream_of_key
from dpprof.emulator.allocator_blocks import Block
from dpprof.emulator.allocator_config import DEFAULT_CONFIG, AllocatorConfig
from dpprof.emulator.cuda_devices import CudaDevices
from dpprof.emulator.events import EMPTY_CACHE

__all__ = ["MemoryHistory"]

_NO_LIMIT = 2**63 - 1  # torch's default max_entries


class MemoryHistory:
    """The record ``_record_memory_history`` keeps for the devices of ``rt``: from which
    event of the log it records (None: not recording), and how many entries it keeps."""

    def __init__(self, rt: CudaDevices, devices: Callable[[], list[int]],
                 config: Callable[[], AllocatorConfig] = lambda: DEFAULT_CONFIG,
                 workspaces: Callable[[int], list[tuple[int, int, int, int]]] = lambda i: []
                 ) -> None:
        self.rt = rt
        self.devices = devices  # the runtime index of each device the program sees, in order
        # a device's cuBLAS workspaces as (event index, block, bytes, allocator key): each
        # allocated there, as its handle takes it (dpprof.emulator.cuda_memory)
        self.workspaces = workspaces
        self.config = config  # the caching allocator's configuration
        self.since: int | None = None
        self.max_entries = _NO_LIMIT

    def record(self, enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
        """``torch.cuda.memory._record_memory_history(enabled, ...)``: None (or False, the
        old API's) stops the record; anything else starts it now, keeping the last
        ``max_entries`` actions of each device."""
        if enabled is None or enabled is False:
            self.since = None
            return
        if self.since is None or kwargs.get("clear_history"):
            self.since = len(self.rt.storages.events)
        self.max_entries = int(kwargs.get("max_entries", _NO_LIMIT))

    def snapshot(self, device: Any = None, augment_with_fx_traces: bool = False
                 ) -> dict[str, Any]:
        """``torch.cuda.memory._snapshot()``: every device's segments, and each device's
        trace (empty where nothing was recorded)."""
        segments: list[dict[str, Any]] = []
        traces: list[list[dict[str, Any]]] = []
        for index, runtime in enumerate(self.devices()):
            device_segments, trace = self._replay(runtime)
            segments += [{**s, "device": index} for s in device_segments]
            traces.append(trace[-self.max_entries:] if self.max_entries else [])
        return {"segments": segments, "device_traces": traces}

    def segments(self, mempool_id: Any = None, include_traces: bool = True
                 ) -> list[dict[str, Any]]:
        """``torch.cuda.memory_snapshot()``: the segments alone (one pool: the default)."""
        return list(self.snapshot()["segments"])

    def _replay(self, runtime: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The device's allocations and frees so far through the simulated allocator: its
        segments now, and the actions recorded since :attr:`since`."""
        sim = CachingAllocatorSim(config=self.config())
        log = self.rt.storages.events
        live: dict[int, Block] = {}
        trace: list[dict[str, Any]] = []
        since = self.since
        marks = [*log.marks, (len(log) + 1, EMPTY_CACHE)]
        workspaces = sorted(self.workspaces(runtime))

        def alloc(serial: int, nbytes: int, key: int, recording: bool) -> None:
            stream = stream_of_key(key)
            segments_before = sim.segments
            try:
                block = sim.malloc(nbytes, key)
            except SimulatedOutOfMemory:
                return
            if block is None:
                return
            live[serial] = block
            if recording:
                if sim.segments > segments_before:
                    trace.append(_entry("segment_alloc", _segment_of(block), stream))
                trace.append(_entry("alloc", (block.addr, block.size), stream))

        for k, ev in enumerate([*log, None]):  # a workspace may follow the last event
            while marks[0][0] <= k:  # the allocator's own steps: cached segments go back
                _play(sim, marks.pop(0)[1], trace if since is not None and k >= since
                      else None)
            while workspaces and workspaces[0][0] <= k:
                _, block_id, nbytes, key = workspaces.pop(0)
                alloc(block_id, nbytes, key, since is not None and k >= since)
            if ev is None or ev.device != runtime or ev.requested == 0:
                continue
            recording = since is not None and k >= since
            key = log.stream_of(k)  # a stream, or a CUDA graph's private pool
            stream = stream_of_key(key)
            if ev.requested > 0:
                alloc(ev.serial, ev.requested, key, recording)
            else:
                block = live.pop(ev.serial, None)
                if block is None:
                    continue
                if recording:
                    trace.append(_entry("free_requested", (block.addr, block.size), stream))
                    trace.append(_entry("free_completed", (block.addr, block.size), stream))
                sim.free(block)
        for _, row in marks[:-1]:
            _play(sim, row, trace if since is not None else None)
        graphs = getattr(self.rt.cuda, "graphs", None)
        return [_segment(s, graphs.handle_of(s["private_pool"]) if graphs and s["private_pool"]
                         else (0, 0))
                for s in sim.snapshot()], trace


def _play(sim: CachingAllocatorSim, row: tuple[str, int, int],
          trace: list[dict[str, Any]] | None) -> None:
    """One of the allocator's own steps (a log's mark) in the simulation, each segment it
    releases a ``segment_free`` in ``trace`` (None: not recording)."""
    if trace is None:
        sim.own_step(row)
        return
    before = {(s["address"], s["total_size"], s["stream"]) for s in sim.snapshot()}
    sim.own_step(row)
    after = {(s["address"], s["total_size"], s["stream"]) for s in sim.snapshot()}
    for address, size, stream in sorted(before - after):
        trace.append(_entry("segment_free", (address, size), stream))


def _segment_of(block: Block) -> tuple[int, int]:
    """(address, size) of the segment that holds ``block``: its slices, linked."""
    head = block
    while head.prev is not None:
        head = head.prev
    size = 0
    b: Block | None = head
    while b is not None:
        size += b.size
        b = b.next
    return head.addr, size


def _entry(action: str, where: tuple[int, int], stream: int) -> dict[str, Any]:
    addr, size = where
    return {"action": action, "addr": addr, "size": size, "stream": stream, "frames": []}


def _segment(s: dict[str, Any], pool: tuple[int, int]) -> dict[str, Any]:
    """One segment of the simulation in torch's snapshot format: its blocks at their
    addresses (contiguous from the segment's); ``pool``: its pool's handle ((0, 0): the
    ordinary pools, else a CUDA graph's private pool)."""
    addr = s["address"]
    blocks = []
    for b in s["blocks"]:
        blocks.append({"address": addr, "size": b["size"],
                       "requested_size": b["requested_size"] if b["allocated"] else 0,
                       "state": "active_allocated" if b["allocated"] else "inactive",
                       "frames": []})
        addr += b["size"]
    allocated = s["allocated_size"]
    return {"address": s["address"], "total_size": s["total_size"], "stream": s["stream"],
            "segment_type": "large" if s["is_large"] else "small",
            "segment_pool_id": pool, "allocated_size": allocated, "active_size": allocated,
            "requested_size": sum(b["requested_size"] for b in blocks),
            "is_expandable": s["expandable"], "frames": [], "blocks": blocks}
