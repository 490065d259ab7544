"""A simulation of PyTorch's CUDA caching allocator: one device, its streams.

The emulator records, per virtual device, the allocations and frees the allocator would see:
``(kind, block_id, size_bytes)`` with ``kind`` ``"alloc"`` or ``"free"`` and ``size_bytes`` the
bytes a tensor storage asked for. :func:`dpprof.emulator.allocator_replay.simulate` replays
such a list through a model of ``c10/cuda/CUDACachingAllocator.cpp`` and predicts what a
real GPU would report:
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

- CUDA graphs' private pools (``beginAllocateToPool``, Note [Interaction with CUDA graph
  capture]): while a stream captures, its allocations are served from the graph's private
  pool, a pool of its own like a stream's, under the key :func:`private_pool_key` (the pool
  and the stream; negative, so it never meets a stream's id). A block of it freed goes back
  to it, so only allocations into the same pool (a later capture given its handle) reuse it,
  and ``release_cached_blocks`` leaves its segments alone until no graph uses the pool
  (``releasePool``: :meth:`CachingAllocatorSim.release_pool`, ``graph_pools_freeable``).

- ``expandable_segments:True`` (``find_expandable_block``, ``map_block``, ``unmap_block``,
  ``try_allocate_expandable_block``): a stream's size class has one segment of address space
  with nothing behind it at first; a request no free block serves maps pages (2 MiB small,
  ``large_segment_size`` large) from the lowest address with room, a free block just before
  unmapped space growing into it; best fit counts such a block at the size it can grow to;
  a block is split wherever 512 B remain (``should_split``); ``release_cached_blocks``
  unmaps the whole pages of free blocks.

What is not modelled: ``record_stream`` (events, deferred frees: a free here returns the block at
once, as it does for a block no other stream used), the ordinary pools left cached by an
out-of-memory retry during a capture (``captures_underway``), an expandable segment released
whole once all of it is unmapped,
``garbage_collection_threshold`` (only acts with ``set_per_process_memory_fraction``), the
``cudaMallocAsync`` backend, and free-memory callbacks (only IPC). Segment addresses are handed
out in increasing order; the real driver's addresses only matter for tie-breaking between free
blocks of equal size.

``capacity_bytes`` is what ``cudaMalloc`` can still hand to this allocator: the device's
total memory minus the CUDA context, library workspaces outside the allocator and other
processes (or ``set_per_process_memory_fraction``'s limit, which fails the same way).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

from dpprof.emulator.allocator_blocks import KEY_SHIFT, Block, BlockPool
from dpprof.emulator.allocator_config import (
    DEFAULT_CONFIG,
    K_MIN_BLOCK_SIZE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    AllocatorConfig,
    get_allocation_size,
    round_size,
)
from dpprof.emulator.events import RELEASE_POOL
from dpprof.emulator.expandable_segments import ExpandableSegments

_POOL_SHIFT = 32  # a private pool's key: -(pool id << 32 | the capturing stream's id)


def private_pool_key(pool_id: int, stream: int) -> int:
    """The key under which a CUDA graph's private pool ``pool_id`` (a positive id) files the
    blocks a capture on ``stream`` takes: an allocation made under it is that pool's."""
    if pool_id <= 0 or not 0 <= stream < 1 << _POOL_SHIFT:
        raise ValueError(f"no private pool key for pool {pool_id}, stream {stream}")
    return -((pool_id << _POOL_SHIFT) | stream)


def stream_of_key(key: int) -> int:
    """The stream of an allocation's key: the stream's own id, or a private pool's stream."""
    return key if key >= 0 else (-key) & ((1 << _POOL_SHIFT) - 1)


def pool_of_key(key: int) -> int:
    """The private pool of an allocation's key (0: the ordinary pools)."""
    return 0 if key >= 0 else (-key) >> _POOL_SHIFT


# --------------------------------------------------------------------------- the allocator


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


class CachingAllocatorSim(ExpandableSegments):
    """``DeviceCachingAllocator`` for one device, in Python.

    ``malloc(nbytes, stream)`` returns an opaque handle (``None`` for 0 bytes, as PyTorch
    hands out a null pointer without touching the allocator) or raises
    :class:`SimulatedOutOfMemory`; ``free(handle)`` returns it to its stream's pool.
    ``stream`` names the stream current at the request (0: the default stream), or a CUDA
    graph's private pool (:func:`private_pool_key`). Counters mirror ``DeviceStats``
    (aggregate pool).
    """

    def __init__(
        self, capacity_bytes: int | None = None, config: AllocatorConfig | None = None
    ) -> None:
        self.config = config or DEFAULT_CONFIG
        self._expandable = self.config.expandable_segments
        # expandable segments: each stream's and size class's unmapped address space, its
        # blocks by address (find_expandable_block takes the lowest that has room)
        self._unmapped: dict[tuple[int, bool], list[Block]] = {}
        if self.config.backend != "native":
            raise NotImplementedError(
                f"allocator backend {self.config.backend!r} is not modelled (only 'native')"
            )
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError("capacity_bytes must not be negative")
        self.capacity_bytes = capacity_bytes
        self._small = BlockPool()  # the default stream's free blocks
        self._large = BlockPool()
        # every other stream's (small, large) pools: BlockPool's order puts the stream
        # first, so no search ever crosses from one stream's blocks to another's
        self._streams: dict[int, tuple[BlockPool, BlockPool]] = {}
        self._mss = self.config.max_split_size  # None: unlimited (size_t max)
        self._lss = self.config.large_segment_size
        self._nsr: int = self.config.max_non_split_rounding_size or self._lss
        self._plain_round = not self.config.roundup_power2_divisions
        self._next_addr = K_SMALL_BUFFER  # never 0: a null pointer is not a segment
        self._segment_heads: set[Block] = set()
        self._freeable: set[int] = set()  # private pools no graph uses (graph_pools_freeable)
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

    def malloc(self, nbytes: int, stream: int = 0) -> Block | None:
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
            block = self._new_block(alloc_size, size, small, False, stream)
            if block is None and self._release_available_cached_blocks(pool, size):
                block = self._new_block(alloc_size, size, small, False, stream)
            if block is None:
                self._release_cached_blocks()
                block = self._new_block(alloc_size, size, small, True, stream)
            if block is None:
                self.num_ooms += 1
                raise SimulatedOutOfMemory(
                    nbytes, size if self._expandable else alloc_size, self.reserved_bytes,
                    self.allocated_bytes
                )
        # should_split + alloc_found_block
        remaining = block.size - size
        if small or self._expandable:
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            mss = self._mss
            split = remaining > K_SMALL_SIZE and (mss is None or size < mss)
        if split:
            rest = block
            block = Block(size, rest.addr, small, rest.stream)
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

    def free(self, block: Block | None) -> None:
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
        self._merge_into(pool, block)
        pool.insert(block)

    def _merge_into(self, pool: BlockPool, block: Block) -> None:
        """``try_merge_blocks`` with the free neighbours of ``block`` (a free block, not in
        ``pool``): an expandable segment's unmapped space merges only with unmapped space."""
        prev = block.prev
        if prev is not None and not prev.allocated and prev.mapped == block.mapped:
            self._take_out(pool, prev)
            block.addr = prev.addr
            block.size += prev.size
            block.prev = prev.prev
            if block.prev is not None:
                block.prev.next = block
            else:
                self._segment_heads.discard(prev)
                self._segment_heads.add(block)
        nxt = block.next
        if nxt is not None and not nxt.allocated and nxt.mapped == block.mapped:
            self._take_out(pool, nxt)
            block.size += nxt.size
            block.next = nxt.next
            if block.next is not None:
                block.next.prev = block

    def _new_block(self, alloc_size: int, size: int, small: bool, is_retry: bool,
                   stream: int) -> Block | None:
        """``alloc_block``: a new segment (cudaMalloc), or with expandable segments memory
        mapped into the stream's (``try_allocate_expandable_block``)."""
        if not self._expandable:
            return self._alloc_block(alloc_size, small, is_retry, stream)
        if is_retry:
            self.num_alloc_retries += 1
        return self._grow(self._pool(small, stream), size, small, stream)

    def _take_out(self, pool: BlockPool, block: Block) -> None:
        """A free block out of the free pool, or unmapped space out of its segment's list."""
        if block.mapped:
            pool.remove(block)
        else:
            self._holes(block.small, block.stream).remove(block)

    def empty_cache(self) -> None:
        """``emptyCache``: ``release_cached_blocks``, every cached unsplit segment goes back."""
        self._release_cached_blocks()

    def own_step(self, row: Sequence[Any]) -> None:
        """One of the allocator's own steps between allocations, as a log's mark or a
        replay's row names it: ``("empty_cache", ...)`` or ``(RELEASE_POOL, pool id, ...)``
        (:data:`dpprof.emulator.events.EMPTY_CACHE`, :data:`~dpprof.emulator.events.
        RELEASE_POOL`)."""
        if row[0] == RELEASE_POOL:
            self.release_pool(int(row[1]))
        else:
            self.empty_cache()

    def release_pool(self, pool_id: int) -> None:
        """``releasePool``: the last graph using the private pool ``pool_id`` is gone (its
        ``use_count`` reached 0): the pool is freeable, its cached segments released with
        the ordinary pools' at the next ``release_cached_blocks``."""
        self._freeable.add(pool_id)

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
            b: Block | None = head
            total = 0
            while b is not None:
                if b.mapped:  # an expandable segment's unmapped space holds no memory
                    blocks.append({"size": b.size, "allocated": b.allocated,
                                   "requested_size": b.requested})
                    total += b.size
                b = b.next
            if not blocks:  # an expandable segment with nothing mapped
                continue
            out.append(
                {
                    "address": head.addr,
                    "total_size": total,
                    "is_large": not head.small,
                    "stream": stream_of_key(head.stream),
                    "private_pool": pool_of_key(head.stream),  # 0: the ordinary pools
                    "expandable": self._expandable,
                    "allocated_size": sum(x["size"] for x in blocks if x["allocated"]),
                    "blocks": blocks,
                }
            )
        return out

    # -- internals --------------------------------------------------------------------

    def _pool(self, small: bool, stream: int) -> BlockPool:
        """The free blocks of ``stream`` of one size class."""
        if not stream:
            return self._small if small else self._large
        pools = self._streams.get(stream)
        if pools is None:
            pools = self._streams[stream] = (BlockPool(), BlockPool())
        return pools[0] if small else pools[1]

    def _get_free_block(self, pool: BlockPool, size: int) -> Block | None:
        """``get_free_block``: lower_bound on (size, address), then the max_split_size rules."""
        keys = pool.keys
        i = bisect_left(keys, size << KEY_SHIFT)
        if i == len(keys):
            return None
        if self._expandable:
            # best fit counts a block followed by unmapped space at the size it can grow to:
            # a larger block that cannot grow may fit better
            def growable(b: Block) -> int:
                nxt = b.next
                return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

            while i + 1 < len(keys) and (growable(pool.blocks[keys[i + 1]])
                                         < growable(pool.blocks[keys[i]])):
                i += 1
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
                     stream: int = 0) -> Block | None:
        """``alloc_block``: cudaMalloc a new segment, failing beyond ``capacity_bytes``."""
        if is_retry:
            self.num_alloc_retries += 1
        cap = self.capacity_bytes
        if cap is not None and self.reserved_bytes + alloc_size > cap:
            return None
        block = Block(alloc_size, self._next_addr, small, stream)
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

    def _release_block(self, pool: BlockPool, block: Block) -> None:
        """``release_block``: cudaFree a whole cached segment."""
        pool.remove(block)
        self._segment_heads.discard(block)
        self.reserved_bytes -= block.size
        self.segments -= 1
        self.num_device_free += 1

    def _release_available_cached_blocks(self, pool: BlockPool, size: int) -> bool:
        """``release_available_cached_blocks``: only with ``max_split_size`` set, free one
        cached oversize segment large enough, else the largest ones until enough is freed."""
        mss = self._mss
        if mss is None:
            return False
        key_size = size if size >= mss else mss
        keys = pool.keys
        i = bisect_left(keys, key_size << KEY_SHIFT)
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
        split, large pool first, then small, every stream's; a CUDA graph's private pool
        keeps its segments while a graph uses it (freeable once none does:
        :meth:`release_pool`)."""
        side = [self._streams[s] for s in sorted(self._streams)
                if not isinstance(s, int) or s >= 0 or pool_of_key(s) in self._freeable]
        for pool in (self._large, *(p[1] for p in side), self._small, *(p[0] for p in side)):
            for key in list(pool.keys):
                block = pool.blocks.get(key)
                if block is None:
                    continue
                if self._expandable:
                    self._unmap(pool, block)
                elif block.prev is None and block.next is None:
                    self._release_block(pool, block)
