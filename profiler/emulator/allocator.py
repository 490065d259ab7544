"""A simulation of PyTorch's CUDA caching allocator: one device, its streams.

The emulator records, per virtual device, the allocations and frees the allocator would see:
``(kind, block_id, size_bytes)`` with ``kind`` ``"alloc"`` or ``"free"`` and ``size_bytes`` the
bytes a tensor storage asked for. :func:`simulate` replays such a list through a model of
``c10/cuda/CUDACachingAllocator.cpp`` and predicts what a real GPU would report:
``torch.cuda.max_memory_allocated()`` (live blocks, rounded), ``max_memory_reserved()``
(segments obtained from ``cudaMalloc``), the number of ``cudaMalloc`` calls, retries and
whether the step runs out of memory under a given capacity.

What is mirrored (read from pytorch/pytorch ``c10/cuda/CUDACachingAllocator.cpp``, class
``DeviceCachingAllocator``; constants from ``c10/core/AllocatorConfig.h``; defaults from
``c10/core/AllocatorConfig.{h,cpp}`` / ``c10/cuda/CUDAAllocatorConfig.h``):

- ``round_size``: requests below 512 B (``kMinBlockSize``) become 512 B, others are rounded up
  to a multiple of 512 B; with ``roundup_power2_divisions`` set (off by default) larger sizes are
  rounded up to the next power-of-two division (``roundup_power2_next_division``).
- ``get_pool``: a rounded size of at most 1 MiB (``kSmallSize``) is served by the small pool,
  anything larger by the large pool; the pools never lend to each other.
- ``get_allocation_size``: a new segment is 2 MiB (``kSmallBuffer``) for small requests,
  20 MiB (``kLargeBuffer``; the ``large_segment_size_mb`` option in torch 2.13) for requests
  below 10 MiB (``kMinLargeAlloc``), otherwise the request rounded up to a multiple of 2 MiB
  (``kRoundLarge``).
- ``get_free_block``: best fit, ``std::set::lower_bound`` over free blocks ordered by
  ``(size, address)``: the smallest free block that is large enough, the lowest address among
  equal sizes. With ``max_split_size`` set, a request below it never takes a block of at least
  ``max_split_size``, and a request at or above it only takes a block smaller than
  ``request + max_non_split_rounding_size`` (20 MiB by default). ``max_split_size`` is
  unlimited by default, so neither rule bites unless configured.
- ``should_split`` / ``alloc_found_block``: the block found is split when the rest is at least
  512 B (small pool) or more than 1 MiB and the request is below ``max_split_size`` (large
  pool); the request takes the front, the rest goes back to the pool. A block that is not split
  is handed out whole, and ``allocated_bytes`` counts its whole size.
- ``free`` / ``free_block`` / ``try_merge_blocks``: a freed block merges with a free previous
  and then a free next neighbour of the same segment.
- ``malloc``'s slow path: ``alloc_block`` (cudaMalloc of the segment size), then
  ``release_available_cached_blocks`` (only with ``max_split_size`` set: free one, or several,
  cached oversize segments) and retry, then ``release_cached_blocks`` (free every cached
  segment that is not split, both pools) and retry once more, counted in
  ``num_alloc_retries``. If that fails too, the allocator raises ``OutOfMemoryError``.
- ``emptyCache`` is ``release_cached_blocks``; an event of kind ``"empty_cache"`` does that.
- Streams: every block belongs to the stream current when its segment was ``cudaMalloc``'d
  (``Block::stream``; a split keeps it), and ``BlockComparatorSize`` orders a pool's free
  blocks by stream before size, so ``get_free_block`` only takes a block of the request's
  own stream: a block freed by one stream is never reused by another, and a stream that
  finds none of its own grows the reserve even while others hold free blocks (FSDP2's
  all-gather and reduce-scatter streams). ``release_cached_blocks`` frees the cached
  segments of every stream.

What is not modelled: ``record_stream`` (events, deferred frees: a free here returns the block at
once, as it does for a block no other stream used), CUDA graph private pools,
``expandable_segments`` (off by default; asking for it raises), ``garbage_collection_threshold``
(only acts with ``set_per_process_memory_fraction``), the ``cudaMallocAsync`` backend, and
free-memory callbacks (only IPC). Segment addresses are handed out in increasing order; the real
driver's addresses only matter for tie-breaking between free blocks of equal size.

``capacity_bytes`` is what ``cudaMalloc`` can still hand to this allocator: the device's
total memory minus the CUDA context, library workspaces outside the allocator and other
processes (or ``set_per_process_memory_fraction``'s limit, which fails the same way).
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "K_LARGE_BUFFER",
    "K_MIN_BLOCK_SIZE",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "AllocatorConfig",
    "AllocatorStats",
    "CachingAllocatorSim",
    "SimulatedOutOfMemory",
    "block_bytes",
    "get_allocation_size",
    "round_size",
    "roundup_power2_next_division",
    "simulate",
]

# Constants of c10/core/AllocatorConfig.h (c10/cuda/CUDACachingAllocator.cpp in older trees).
K_MIN_BLOCK_SIZE = 512  # all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1048576  # largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2097152  # "small" allocations are packed in 2 MiB blocks
K_LARGE_BUFFER = 20971520  # "large" allocations may be packed in 20 MiB blocks
K_MIN_LARGE_ALLOC = 10485760  # allocations between 1 and 10 MiB may use kLargeBuffer
K_ROUND_LARGE = 2097152  # round up large allocations to 2 MiB

_MB = 1024 * 1024
# AllocatorConfig.cpp: roundup_power2_divisions has 16 intervals, 1 MiB ... 64 GiB.
_ROUNDUP_INTERVALS = 16
_ROUNDUP_START_LOG2 = 20  # log2(1 MiB)
_KEY_SHIFT = 64  # free-block key: size << 64 | address (orders by size, then address)


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator settings that change its decisions (``PYTORCH_ALLOC_CONF``).

    Defaults are PyTorch's (``AcceleratorAllocatorConfig``): ``max_split_size`` unlimited
    (``None``), ``max_non_split_rounding_size`` 20 MiB, ``large_segment_size`` 20 MiB
    (``large_segment_size_mb``, new in torch 2.13's ``AllocatorConfig.h``; taken to replace
    ``kLargeBuffer`` in ``get_allocation_size``, kept at 10 MiB or more here so that every
    request below 10 MiB fits its segment), no power-of-two rounding, no expandable segments.

    ``roundup_power2_divisions`` is one number for every size interval or a sequence of 16,
    one per power-of-two interval from 1 MiB (index 0: sizes below 2 MiB) to 32 GiB and up
    (index 15); 0 or 1 means plain 512 B rounding.
    """

    max_split_size: int | None = None
    max_non_split_rounding_size: int = K_LARGE_BUFFER
    large_segment_size: int = K_LARGE_BUFFER  # segment for 1-10 MiB requests (torch 2.13+)
    roundup_power2_divisions: int | tuple[int, ...] = 0
    expandable_segments: bool = False
    backend: str = "native"

    def __post_init__(self) -> None:
        if self.max_split_size is not None and self.max_split_size < K_LARGE_BUFFER:
            raise ValueError(
                f"max_split_size must be at least {K_LARGE_BUFFER // _MB} MiB "
                f"(PyTorch's minimum for max_split_size_mb), got {self.max_split_size} B"
            )
        if self.large_segment_size < K_MIN_LARGE_ALLOC or self.large_segment_size % K_ROUND_LARGE:
            raise ValueError(
                "large_segment_size must be a multiple of 2 MiB and at least 10 MiB, "
                f"got {self.large_segment_size} B"
            )
        divs = self.roundup_power2_divisions
        values = (divs,) if isinstance(divs, int) else tuple(divs)
        if not isinstance(divs, int) and len(values) != _ROUNDUP_INTERVALS:
            raise ValueError(
                f"roundup_power2_divisions needs one number or {_ROUNDUP_INTERVALS} numbers "
                f"(one per power-of-two interval from 1 MiB), got {len(values)}"
            )
        for v in values:
            if v < 0 or (v and v & (v - 1)):
                raise ValueError(f"roundup_power2_divisions must be 0 or powers of 2, got {v}")
        if not isinstance(divs, int):
            object.__setattr__(self, "roundup_power2_divisions", values)

    def divisions_for(self, size: int) -> int:
        """``AllocatorConfig::roundup_power2_divisions(size)``: the divisions for ``size``."""
        divs = self.roundup_power2_divisions
        if isinstance(divs, int):
            return divs
        index = (size.bit_length() - 1) - _ROUNDUP_START_LOG2
        return divs[min(max(index, 0), _ROUNDUP_INTERVALS - 1)]


DEFAULT_CONFIG = AllocatorConfig()


# --------------------------------------------------------------------------- size rules


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: round ``size`` up to the next of ``divisions`` equal
    steps between the powers of two around it (1200 with 4 divisions -> 1280)."""
    if size & (size - 1) == 0:
        return size
    if divisions < 2:
        raise ValueError("Only 2 or more divisions are supported")
    power2_floor = 1 << (size.bit_length() - 1)
    power2_division = power2_floor >> (divisions.bit_length() - 1)
    if power2_division == 0:
        return power2_floor << 1
    round_size_floor = size & ~(power2_division - 1)
    return size if round_size_floor == size else round_size_floor + power2_division


def round_size(size: int, config: AllocatorConfig = DEFAULT_CONFIG) -> int:
    """``DeviceCachingAllocator::round_size``: the block size a request of ``size`` bytes gets.

    512 B minimum, else a multiple of 512 B; with ``roundup_power2_divisions`` configured
    (default off) sizes above ``512 * divisions`` go to the next power-of-two division.
    """
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = config.divisions_for(size) if config.roundup_power2_divisions else 0
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return roundup_power2_next_division(size, divisions)
    return -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def block_bytes(nbytes: int, config: AllocatorConfig = DEFAULT_CONFIG) -> int:
    """The bytes a storage of ``nbytes`` holds in the caching allocator: ``round_size``'s
    block, and nothing for an empty storage (``NativeCachingAllocator::allocate`` never calls
    ``malloc`` for 0 bytes, so the 512 B minimum does not apply to it)."""
    return round_size(nbytes, config) if nbytes > 0 else 0


def get_allocation_size(size: int, large_segment_size: int = K_LARGE_BUFFER) -> int:
    """``get_allocation_size``: the segment ``cudaMalloc`` gets for a rounded request that no
    cached block can serve: 2 MiB (<= 1 MiB), 20 MiB (< 10 MiB; ``large_segment_size``), else
    the request rounded up to a multiple of 2 MiB."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return large_segment_size
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


# --------------------------------------------------------------------------- the allocator


class _Block:
    """``Block``: a slice of one segment; ``prev``/``next`` link the slices of a segment."""

    __slots__ = ("addr", "allocated", "next", "prev", "requested", "size", "small", "stream")

    def __init__(self, size: int, addr: int, small: bool, stream: int = 0) -> None:
        self.size = size
        self.addr = addr
        self.small = small
        self.stream = stream
        self.allocated = False
        self.requested = 0
        self.prev: _Block | None = None
        self.next: _Block | None = None


class _Pool:
    """``BlockPool::blocks``: free blocks ordered by ``(size, address)``."""

    __slots__ = ("blocks", "keys")

    def __init__(self) -> None:
        self.keys: list[int] = []
        self.blocks: dict[int, _Block] = {}

    def insert(self, block: _Block) -> None:
        key = (block.size << _KEY_SHIFT) | block.addr
        insort(self.keys, key)
        self.blocks[key] = block

    def remove(self, block: _Block) -> None:
        key = (block.size << _KEY_SHIFT) | block.addr
        keys = self.keys
        del keys[bisect_left(keys, key)]
        del self.blocks[key]

    def __len__(self) -> int:
        return len(self.keys)


class SimulatedOutOfMemory(Exception):
    """The simulated ``torch.OutOfMemoryError``: no segment of ``alloc_bytes`` could be had."""

    def __init__(
        self, requested_bytes: int, alloc_bytes: int, reserved_bytes: int, allocated_bytes: int
    ) -> None:
        self.requested_bytes = requested_bytes
        self.alloc_bytes = alloc_bytes
        self.reserved_bytes = reserved_bytes
        self.allocated_bytes = allocated_bytes
        super().__init__(
            f"simulated CUDA out of memory: tried to allocate {alloc_bytes} B for a request of "
            f"{requested_bytes} B with {reserved_bytes} B reserved, {allocated_bytes} B allocated"
        )


class CachingAllocatorSim:
    """``DeviceCachingAllocator`` for one device, in Python.

    ``malloc(nbytes, stream)`` returns an opaque handle (``None`` for 0 bytes, as PyTorch
    hands out a null pointer without touching the allocator) or raises
    :class:`SimulatedOutOfMemory`; ``free(handle)`` returns it to its stream's pool.
    ``stream`` names the stream current at the request (0: the default stream). Counters
    mirror ``DeviceStats`` (aggregate pool).
    """

    def __init__(
        self, capacity_bytes: int | None = None, config: AllocatorConfig | None = None
    ) -> None:
        self.config = config or DEFAULT_CONFIG
        if self.config.expandable_segments:
            raise NotImplementedError(
                "expandable_segments:True is not modelled; the simulation covers the default "
                "(cudaMalloc'd segments)"
            )
        if self.config.backend != "native":
            raise NotImplementedError(
                f"allocator backend {self.config.backend!r} is not modelled (only 'native')"
            )
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError("capacity_bytes must not be negative")
        self.capacity_bytes = capacity_bytes
        self._small = _Pool()  # the default stream's free blocks
        self._large = _Pool()
        # every other stream's (small, large) pools: BlockPool's order puts the stream
        # first, so no search ever crosses from one stream's blocks to another's
        self._streams: dict[int, tuple[_Pool, _Pool]] = {}
        self._mss = self.config.max_split_size  # None: unlimited (size_t max)
        self._nsr = self.config.max_non_split_rounding_size
        self._lss = self.config.large_segment_size
        self._plain_round = not self.config.roundup_power2_divisions
        self._next_addr = K_SMALL_BUFFER  # never 0: a null pointer is not a segment
        self._segment_heads: set[_Block] = set()
        # DeviceStats (aggregate)
        self.allocated_bytes = 0
        self.requested_bytes = 0
        self.reserved_bytes = 0
        self.segments = 0
        self.active_blocks = 0
        self.peak_allocated_bytes = 0
        self.peak_requested_bytes = 0
        self.peak_reserved_bytes = 0
        self.peak_segments = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0

    # -- public operations ------------------------------------------------------------

    def malloc(self, nbytes: int, stream: int = 0) -> _Block | None:
        """``DeviceCachingAllocator::malloc`` for a request of ``nbytes`` on ``stream``."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative size ({nbytes})")
        if nbytes == 0:
            return None  # NativeCachingAllocator::allocate skips malloc for size 0
        if self._plain_round:
            size = (
                K_MIN_BLOCK_SIZE
                if nbytes < K_MIN_BLOCK_SIZE
                else -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE
            )
        else:
            size = round_size(nbytes, self.config)
        small = size <= K_SMALL_SIZE
        pool = self._pool(small, stream)
        block = self._get_free_block(pool, size)
        if block is None:
            alloc_size = get_allocation_size(size, self._lss)
            block = self._alloc_block(alloc_size, small, False, stream)
            if block is None and self._release_available_cached_blocks(pool, size):
                block = self._alloc_block(alloc_size, small, False, stream)
            if block is None:
                self._release_cached_blocks()
                block = self._alloc_block(alloc_size, small, True, stream)
            if block is None:
                self.num_ooms += 1
                raise SimulatedOutOfMemory(
                    nbytes, alloc_size, self.reserved_bytes, self.allocated_bytes
                )
        # should_split + alloc_found_block
        remaining = block.size - size
        if small:
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            mss = self._mss
            split = remaining > K_SMALL_SIZE and (mss is None or size < mss)
        if split:
            rest = block
            block = _Block(size, rest.addr, small, rest.stream)
            block.prev = rest.prev
            if block.prev is not None:
                block.prev.next = block
            else:
                self._segment_heads.discard(rest)
                self._segment_heads.add(block)
            block.next = rest
            rest.prev = block
            rest.addr += size
            rest.size -= size
            pool.insert(rest)
        block.allocated = True
        block.requested = nbytes
        self.active_blocks += 1
        self.allocated_bytes += block.size
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes
        self.requested_bytes += nbytes
        if self.requested_bytes > self.peak_requested_bytes:
            self.peak_requested_bytes = self.requested_bytes
        return block

    def free(self, block: _Block | None) -> None:
        """``DeviceCachingAllocator::free`` + ``free_block``: return a block, merge neighbours."""
        if block is None:
            return
        if not block.allocated:
            raise ValueError("block freed twice")
        block.allocated = False
        self.active_blocks -= 1
        self.allocated_bytes -= block.size
        self.requested_bytes -= block.requested
        block.requested = 0
        pool = self._pool(block.small, block.stream)
        prev = block.prev
        if prev is not None and not prev.allocated:  # try_merge_blocks(block, prev): [prev block]
            pool.remove(prev)
            block.addr = prev.addr
            block.size += prev.size
            block.prev = prev.prev
            if block.prev is not None:
                block.prev.next = block
            else:
                self._segment_heads.discard(prev)
                self._segment_heads.add(block)
        nxt = block.next
        if nxt is not None and not nxt.allocated:  # try_merge_blocks(block, next): [block next]
            pool.remove(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if block.next is not None:
                block.next.prev = block
        pool.insert(block)

    def empty_cache(self) -> None:
        """``emptyCache``: ``release_cached_blocks``, every cached unsplit segment goes back."""
        self._release_cached_blocks()

    def reset_peak_stats(self) -> None:
        """``resetPeakStats``: peaks become the current values."""
        self.peak_allocated_bytes = self.allocated_bytes
        self.peak_requested_bytes = self.requested_bytes
        self.peak_reserved_bytes = self.reserved_bytes
        self.peak_segments = self.segments

    def snapshot(self) -> list[dict[str, Any]]:
        """Segments in address order, each with its blocks (like ``torch.cuda.memory_snapshot``)."""
        out = []
        for head in sorted(self._segment_heads, key=lambda b: b.addr):
            blocks = []
            b: _Block | None = head
            total = 0
            while b is not None:
                blocks.append(
                    {"size": b.size, "allocated": b.allocated, "requested_size": b.requested}
                )
                total += b.size
                b = b.next
            out.append(
                {
                    "address": head.addr,
                    "total_size": total,
                    "is_large": not head.small,
                    "stream": head.stream,
                    "allocated_size": sum(x["size"] for x in blocks if x["allocated"]),
                    "blocks": blocks,
                }
            )
        return out

    # -- internals --------------------------------------------------------------------

    def _pool(self, small: bool, stream: int) -> _Pool:
        """The free blocks of ``stream`` of one size class."""
        if not stream:
            return self._small if small else self._large
        pools = self._streams.get(stream)
        if pools is None:
            pools = self._streams[stream] = (_Pool(), _Pool())
        return pools[0] if small else pools[1]

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        """``get_free_block``: lower_bound on (size, address), then the max_split_size rules."""
        keys = pool.keys
        i = bisect_left(keys, size << _KEY_SHIFT)
        if i == len(keys):
            return None
        key = keys[i]
        block = pool.blocks[key]
        mss = self._mss
        if mss is not None:
            if size < mss and block.size >= mss:
                return None  # do not return an oversized block for a smaller request
            if size >= mss and block.size >= size + self._nsr:
                return None  # oversized block rounded up too far
        del keys[i]
        del pool.blocks[key]
        return block

    def _alloc_block(self, alloc_size: int, small: bool, is_retry: bool,
                     stream: int = 0) -> _Block | None:
        """``alloc_block``: cudaMalloc a new segment, failing beyond ``capacity_bytes``."""
        if is_retry:
            self.num_alloc_retries += 1
        cap = self.capacity_bytes
        if cap is not None and self.reserved_bytes + alloc_size > cap:
            return None
        block = _Block(alloc_size, self._next_addr, small, stream)
        self._next_addr += alloc_size
        self._segment_heads.add(block)
        self.reserved_bytes += alloc_size
        if self.reserved_bytes > self.peak_reserved_bytes:
            self.peak_reserved_bytes = self.reserved_bytes
        self.segments += 1
        if self.segments > self.peak_segments:
            self.peak_segments = self.segments
        self.num_device_alloc += 1
        return block

    def _release_block(self, pool: _Pool, block: _Block) -> None:
        """``release_block``: cudaFree a whole cached segment."""
        pool.remove(block)
        self._segment_heads.discard(block)
        self.reserved_bytes -= block.size
        self.segments -= 1
        self.num_device_free += 1

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """``release_available_cached_blocks``: only with ``max_split_size`` set, free one
        cached oversize segment large enough, else the largest ones until enough is freed."""
        mss = self._mss
        if mss is None:
            return False
        key_size = size if size >= mss else mss
        keys = pool.keys
        i = bisect_left(keys, key_size << _KEY_SHIFT)
        if i < len(keys):
            block = pool.blocks[keys[i]]
            if block.prev is None and block.next is None:
                self._release_block(pool, block)
            return True
        if i == 0:
            return False
        released = 0
        j = len(keys) - 1
        while released < key_size and j >= 0:
            block = pool.blocks[keys[j]]
            if block.size < mss or block.prev is not None or block.next is not None:
                break
            released += block.size
            self._release_block(pool, block)
            j -= 1
        return released >= key_size

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks`` -> ``release_blocks``: free every cached segment that is not
        split, large pool first, then small, every stream's."""
        side = [self._streams[s] for s in sorted(self._streams)]
        for pool in (self._large, *(p[1] for p in side), self._small, *(p[0] for p in side)):
            for key in list(pool.keys):
                block = pool.blocks[key]
                if block.prev is None and block.next is None:
                    self._release_block(pool, block)


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
    stream's pool), ``"empty_cache"`` (``torch.cuda.empty_cache()``) or ``"reset_peak"``
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
    live: dict[Any, _Block | None] = {}
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
        elif kind == "empty_cache":
            sim.empty_cache()
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
        "'empty_cache' or 'reset_peak')"
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
