"""The caching allocator's blocks (:class:`Block`: a slice of a segment, linked to its
neighbours) and a pool of free ones (:class:`BlockPool`: ordered by size, then address, as
``BlockComparatorSize`` orders them), shared by the simulation's allocator
(:mod:`dpprof.emulator.allocator`) and its expandable segments
(:mod:`dpprof.emulator.expandable_segments`)."""

from __future__ import annotations

from bisect import bisect_left, insort

__all__ = ["KEY_SHIFT", "Block", "BlockPool"]

KEY_SHIFT = 64  # free-block key: size << 64 | address (orders by size, then address)


class Block:
    """``Block``: a slice of one segment; ``prev``/``next`` link the slices of a segment."""

    __slots__ = ("addr", "allocated", "mapped", "next", "prev", "requested", "size", "small",
                 "stream")

    def __init__(self, size: int, addr: int, small: bool, stream: int = 0,
                 mapped: bool = True) -> None:
        self.size = size
        self.addr = addr
        self.small = small
        self.stream = stream
        self.allocated = False
        self.mapped = mapped  # False: an expandable segment's address space, no memory
        self.requested = 0
        self.prev: Block | None = None
        self.next: Block | None = None


class BlockPool:
    """``BlockPool::blocks``: free blocks ordered by ``(size, address)``."""

    __slots__ = ("blocks", "keys")

    def __init__(self) -> None:
        self.keys: list[int] = []
        self.blocks: dict[int, Block] = {}

    def insert(self, block: Block) -> None:
        key = (block.size << KEY_SHIFT) | block.addr
        insort(self.keys, key)
        self.blocks[key] = block

    def remove(self, block: Block) -> None:
        key = (block.size << KEY_SHIFT) | block.addr
        keys = self.keys
        del keys[bisect_left(keys, key)]
        del self.blocks[key]

    def __len__(self) -> int:
        return len(self.keys)
