"""A list of allocations and frees replayed through the simulated caching allocator
(:class:`dpprof.emulator.allocator.CachingAllocatorSim`): :func:`simulate` and what it
reports (:class:`AllocatorStats`: peaks allocated and reserved, ``cudaMalloc`` calls,
retries, a timeline, whether the step runs out of memory)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dpprof.emulator.allocator import CachingAllocatorSim, SimulatedOutOfMemory
from dpprof.emulator.allocator_blocks import Block
from dpprof.emulator.allocator_config import AllocatorConfig
from dpprof.emulator.events import OWN_STEPS

# --------------------------------------------------------------------------- the replay


@dataclass
class AllocatorStats:
    """What :func:`simulate` predicts for one device (bytes are bytes)."""

    num_events: int = 0  # events processed (the failing one included on OOM)
    capacity_bytes: int | None = None
    peak_allocated_bytes: int = 0  # torch.cuda.max_memory_allocated()
    peak_reserved_bytes: int = 0  # torch.cuda.max_memory_reserved()
    peak_requested_bytes: int = 0  # bytes asked for, before rounding
    peak_segments: int = 0
    final_allocated_bytes: int = 0
    final_reserved_bytes: int = 0
    final_requested_bytes: int = 0
    num_segments: int = 0  # segments held at the end
    num_cudamalloc: int = 0  # stats.num_device_alloc
    num_cudafree: int = 0  # stats.num_device_free
    num_alloc_retries: int = 0  # "cudaMalloc retries" in torch.cuda.memory_summary()
    num_ooms: int = 0
    oom: bool = False
    oom_event_index: int | None = None  # first OOM: index into the events
    oom_requested_bytes: int | None = None  # ... the storage size that was asked for
    oom_alloc_bytes: int | None = None  # ... the segment size cudaMalloc could not get
    oom_reserved_bytes: int | None = None  # ... reserved after the cache was released
    oom_allocated_bytes: int | None = None
    # (event_index, allocated_bytes, reserved_bytes): the maximum of each over a bucket of
    # events ending at event_index; at most ``timeline_points`` entries.
    timeline: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.oom

    @property
    def peak_unallocated_reserved_bytes(self) -> int:
        """Peak reserved minus peak allocated: what caching and fragmentation cost at most."""
        return self.peak_reserved_bytes - self.peak_allocated_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["timeline"] = [list(p) for p in self.timeline]
        return d


def simulate(
    events: Iterable[Sequence[Any]],
    capacity_bytes: int | None = None,
    *,
    config: AllocatorConfig | None = None,
    timeline_points: int | None = 512,
    stop_on_oom: bool = True,
) -> AllocatorStats:
    """Replay ``events`` through :class:`CachingAllocatorSim` and return the statistics.

    Each event is ``(kind, block_id, size_bytes[, stream])``: ``"alloc"`` with the requested bytes
    of a storage and the stream current at the request (an int; 0, or left out: the default stream),
    ``"free"`` with the same ``block_id`` (size and stream ignored: a block goes back to its own
    stream's pool), ``"empty_cache"`` (``torch.cuda.empty_cache()``), ``"release_pool"`` with
    a CUDA graph's private pool id (no graph uses it any more) or ``"reset_peak"``
    (``torch.cuda.reset_peak_memory_stats()``). An allocation of 0 bytes takes no block.

    With ``capacity_bytes``, a segment that would push reserved memory past it fails as
    ``cudaMalloc`` would; after the retries an out-of-memory is recorded (``oom``,
    ``oom_event_index``, ``oom_requested_bytes``, ``oom_alloc_bytes``). The replay stops there
    unless ``stop_on_oom`` is False, in which case the failed allocation is skipped (and its
    later free ignored), as if the program caught the error and went on.

    ``timeline_points`` caps the downsampled timeline (``None`` or 0: no timeline).
    """
    evs = events if isinstance(events, Sequence) else list(events)
    n = len(evs)
    sim = CachingAllocatorSim(capacity_bytes, config)
    stats = AllocatorStats(capacity_bytes=capacity_bytes)
    live: dict[Any, Block | None] = {}
    failed: set[Any] = set()
    malloc = sim.malloc
    free = sim.free

    timeline: list[tuple[int, int, int]] = []
    use_timeline, width = _timeline_buckets(n, timeline_points)
    bucket_end = width - 1
    b_alloc = b_res = 0

    processed = 0
    for i, ev in enumerate(evs):
        kind = ev[0]
        if kind == "alloc":
            bid = ev[1]
            if bid in live:
                raise ValueError(f"event {i}: block {bid!r} allocated again while still live")
            try:
                live[bid] = malloc(int(ev[2]), ev[3] if len(ev) > 3 else 0)
            except SimulatedOutOfMemory as err:
                _note_oom(stats, i, err)
                if stop_on_oom:
                    processed = i + 1
                    break
                failed.add(bid)
        elif kind == "free":
            bid = ev[1]
            try:
                block = live.pop(bid)
            except KeyError:
                _forget_failed(failed, bid, i)
            else:
                free(block)
        elif kind in OWN_STEPS:
            sim.own_step(ev)
        elif kind == "reset_peak":
            sim.reset_peak_stats()
        else:
            raise _unknown_kind(i, kind)
        processed = i + 1
        if use_timeline:
            if sim.allocated_bytes > b_alloc:
                b_alloc = sim.allocated_bytes
            if sim.reserved_bytes > b_res:
                b_res = sim.reserved_bytes
            if i >= bucket_end:
                timeline.append((i, b_alloc, b_res))
                bucket_end += width
                b_alloc = b_res = 0
    if use_timeline:
        _close_timeline(timeline, processed, b_alloc, b_res, sim)
    _copy_totals(stats, sim, processed, timeline)
    return stats


def _timeline_buckets(n: int, timeline_points: int | None) -> tuple[bool, int]:
    """Whether :func:`simulate` keeps a timeline of ``n`` events, and how many events each
    of its points covers."""
    use_timeline = bool(timeline_points) and n > 0
    width = max(1, math.ceil(n / timeline_points)) if use_timeline and timeline_points else n + 1
    return use_timeline, width


def _forget_failed(failed: set[Any], bid: Any, i: int) -> None:
    """The free (event ``i``) of a block whose allocation failed: nothing to free; of an
    unknown block: an error."""
    if bid in failed:
        failed.discard(bid)
    else:
        raise ValueError(f"event {i}: free of unknown block {bid!r}") from None


def _close_timeline(timeline: list[tuple[int, int, int]], processed: int, b_alloc: int,
                    b_res: int, sim: CachingAllocatorSim) -> None:
    """The timeline's last point: the last event processed, where its bucket was cut short."""
    if (not timeline or timeline[-1][0] != processed - 1) and processed:
        timeline.append(
            (processed - 1, max(b_alloc, sim.allocated_bytes), max(b_res, sim.reserved_bytes))
        )


def _note_oom(stats: AllocatorStats, i: int, err: SimulatedOutOfMemory) -> None:
    """Record the first out-of-memory (at event ``i``) in ``stats``."""
    if not stats.oom:
        stats.oom = True
        stats.oom_event_index = i
        stats.oom_requested_bytes = err.requested_bytes
        stats.oom_alloc_bytes = err.alloc_bytes
        stats.oom_reserved_bytes = err.reserved_bytes
        stats.oom_allocated_bytes = err.allocated_bytes


def _unknown_kind(i: int, kind: Any) -> ValueError:
    return ValueError(
        f"event {i}: unknown kind {kind!r} (expected 'alloc', 'free', "
        "'empty_cache', 'release_pool' or 'reset_peak')"
    )


def _copy_totals(stats: AllocatorStats, sim: CachingAllocatorSim, processed: int,
                 timeline: list[tuple[int, int, int]]) -> None:
    """The events processed, the simulator's peaks, final figures and counts, and the
    timeline, into ``stats``."""
    stats.num_events = processed
    stats.peak_allocated_bytes = sim.peak_allocated_bytes
    stats.peak_reserved_bytes = sim.peak_reserved_bytes
    stats.peak_requested_bytes = sim.peak_requested_bytes
    stats.peak_segments = sim.peak_segments
    stats.final_allocated_bytes = sim.allocated_bytes
    stats.final_reserved_bytes = sim.reserved_bytes
    stats.final_requested_bytes = sim.requested_bytes
    stats.num_segments = sim.segments
    stats.num_cudamalloc = sim.num_device_alloc
    stats.num_cudafree = sim.num_device_free
    stats.num_alloc_retries = sim.num_alloc_retries
    stats.num_ooms = sim.num_ooms
    stats.timeline = timeline
