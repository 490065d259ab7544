"""How DataParallel's scatter splits a batch over its GPUs (``tensor.chunk``), without torch:
the fixes and the reports read it too."""

from __future__ import annotations

import math

__all__ = ["shard_sizes"]


def shard_sizes(batch: int, devices: int) -> list[int]:
    """Rows per device as ``tensor.chunk(devices)`` splits them (DataParallel's scatter).

    Chunks of ceil(B / N) rows, the last smaller, and fewer than N chunks when B is small:
    10 over 4 -> [3, 3, 3, 1]; 6 over 4 -> [2, 2, 2].
    """
    size = math.ceil(batch / devices)
    sizes = []
    left = batch
    while left > 0:
        sizes.append(min(size, left))
        left -= size
    return sizes
