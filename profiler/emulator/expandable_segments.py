"""The caching allocator's expandable segments (``expandable_segments:True``), as a part of
the simulation's allocator (:class:`dpprof.emulator.allocator.CachingAllocatorSim`), from
``c10/cuda/CUDACachingAllocator.cpp``: ``find_expandable_block``, ``map_block``,
``try_allocate_expandable_block``, ``unmap_block``.

A stream's size class has one segment of address space (as large as the device; endless
here) with nothing mapped at first. A request no free block serves maps whole pages (2 MiB
for the small pool, ``large_segment_size`` for the large one) from the lowest address with
room: unmapped space, or a free block just before it that grows into it; what is mapped
merges with its free neighbours, and reserved memory is what is mapped. Emptying the cache
(or an out-of-memory retry) unmaps the whole pages of free blocks, which later requests map
again, lowest first.
"""

from __future__ import annotations

from bisect import insort

from dpprof.emulator.allocator_blocks import Block, BlockPool
from dpprof.emulator.allocator_config import K_SMALL_BUFFER

__all__ = ["ExpandableSegments"]

ADDRESS_SPACE = 1 << 44  # an expandable segment's address space: more than any device


class ExpandableSegments:
    """The expandable-segment half of the simulated allocator (a base of its class): the
    allocator's counters and pools are its own."""

    capacity_bytes: int | None
    reserved_bytes: int
    peak_reserved_bytes: int
    segments: int
    peak_segments: int
    num_device_alloc: int
    num_device_free: int
    _lss: int
    _next_addr: int
    _segment_heads: set[Block]
    _unmapped: dict[tuple[int, bool], list[Block]]

    def _merge_into(self, pool: BlockPool, block: Block) -> None:
        raise NotImplementedError

    def _holes(self, small: bool, stream: int) -> list[Block]:
        """``BlockPool::unmapped`` of a stream's size class, by address."""
        return self._unmapped.setdefault((stream, small), [])

    def _page(self, small: bool) -> int:
        """``ExpandableSegment``'s page: what ``map`` rounds to (2 MiB small, 20 MiB large)."""
        return K_SMALL_BUFFER if small else self._lss

    def _find_expandable(self, size: int, small: bool, stream: int) -> Block:
        """``find_expandable_block``: the lowest address with room for ``size`` in a free
        block and the unmapped space after it, or unmapped space and what follows; else a
        new segment, address space with nothing mapped (as large as the device: endless
        here)."""
        holes = self._holes(small, stream)
        for hole in holes:
            start = hole
            if hole.prev is not None and not hole.prev.allocated and hole.prev.mapped:
                start = hole.prev
            room = 0  # the free and unmapped run from there
            walk: Block | None = start
            while room < size and walk is not None and not walk.allocated:
                room += walk.size
                walk = walk.next
            if room >= size:
                return start
        page = self._page(small)
        base = -(-self._next_addr // page) * page  # pages at multiples of the page size
        block = Block(ADDRESS_SPACE, base, small, stream, mapped=False)
        self._next_addr = base + ADDRESS_SPACE
        self._segment_heads.add(block)
        holes.append(block)  # the highest address yet
        self.segments += 1
        self.peak_segments = max(self.peak_segments, self.segments)
        return block

    def _map(self, pool: BlockPool, block: Block, size: int) -> bool:
        """``map_block``: map the pages that hold ``size`` bytes from the start of unmapped
        ``block``, failing beyond ``capacity_bytes``; what is mapped merges with free
        neighbours."""
        page = self._page(block.small)
        mapped = min(-(-size // page) * page, block.size)
        cap = self.capacity_bytes
        if cap is not None and self.reserved_bytes + mapped > cap:
            return False
        holes = self._holes(block.small, block.stream)
        holes.remove(block)
        block.mapped = True
        if mapped < block.size:  # block -> the rest, still unmapped -> block.next
            rest = Block(block.size - mapped, block.addr + mapped, block.small, block.stream,
                         mapped=False)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = mapped
            insort(holes, rest, key=lambda b: b.addr)
        self._merge_into(pool, block)
        pool.insert(block)
        self.reserved_bytes += mapped
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        self.num_device_alloc += 1
        return True

    def _unmap(self, pool: BlockPool, block: Block) -> None:
        """``unmap_block``: a free block's whole pages go back to the device; what it keeps
        of a page at either end stays mapped and free."""
        page = self._page(block.small)
        start = -(-block.addr // page) * page
        end = (block.addr + block.size) // page * page
        if end <= start:
            return
        pool.remove(block)
        pieces = [(block.addr, start, True), (start, end, False),
                  (end, block.addr + block.size, True)]
        prev, after = block.prev, block.next
        made = []
        for lo, hi, mapped in pieces:
            if hi <= lo:
                continue
            b = Block(hi - lo, lo, block.small, block.stream, mapped=mapped)
            b.prev = prev
            if prev is not None:
                prev.next = b
            prev = b
            made.append(b)
        prev.next = after  # type: ignore[union-attr]
        if after is not None:
            after.prev = prev
        if block in self._segment_heads:
            self._segment_heads.discard(block)
            self._segment_heads.add(made[0])
        holes = self._holes(block.small, block.stream)
        for b in made:
            if b.mapped:
                pool.insert(b)
            else:
                self._merge_into(pool, b)  # with unmapped space either side
                insort(holes, b, key=lambda x: x.addr)
        self.reserved_bytes -= end - start
        self.num_device_free += 1


    def _grow(self, pool: BlockPool, size: int, small: bool, stream: int) -> Block | None:
        """``try_allocate_expandable_block``: a free block of at least ``size`` made by
        mapping pages (None: the device is full), taken out of ``pool``."""
        candidate = self._find_expandable(size, small, stream)
        if not candidate.mapped and not self._map(pool, candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:  # free -> unmapped: map the rest, merged into one
            unmapped = candidate.next
            assert unmapped is not None and not unmapped.mapped
            if not self._map(pool, unmapped, min(size - candidate.size, unmapped.size)):
                return None
            candidate = unmapped
        pool.remove(candidate)
        return candidate
