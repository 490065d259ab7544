"""The CUDA caching allocator's constants, its configuration (``PYTORCH_CUDA_ALLOC_CONF``)
and its size rules (``round_size``, ``get_allocation_size``), from
``c10/core/AllocatorConfig.h`` and ``c10/cuda/CUDACachingAllocator.cpp``; the allocator
itself is simulated in :mod:`dpprof.emulator.allocator`."""

from __future__ import annotations

from dataclasses import dataclass

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


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator settings that change its decisions (``PYTORCH_ALLOC_CONF``).

    Defaults are PyTorch's (``AcceleratorAllocatorConfig``): ``max_split_size`` unlimited
    (``None``), ``max_non_split_rounding_size`` 20 MiB, ``large_segment_size`` 20 MiB
    (``large_segment_size_mb``, torch 2.13: the segment ``get_allocation_size`` gives a
    request of 1-10 MiB, and an expandable segment's page in the large pool; c10 takes more
    than 10 MiB, and makes it the least ``max_split_size`` and ``max_non_split_rounding_size``
    may be), no power-of-two rounding, no expandable segments.

    ``roundup_power2_divisions`` is one number for every size interval or a sequence of 16,
    one per power-of-two interval from 1 MiB (index 0: sizes below 2 MiB) to 32 GiB and up
    (index 15); 0 or 1 means plain 512 B rounding.
    """

    max_split_size: int | None = None
    # None: the large segment size (c10 sets it so before it reads the setting)
    max_non_split_rounding_size: int | None = None
    large_segment_size: int = K_LARGE_BUFFER  # segment for 1-10 MiB requests (torch 2.13+)
    roundup_power2_divisions: int | tuple[int, ...] = 0
    expandable_segments: bool = False
    backend: str = "native"

    def __post_init__(self) -> None:
        if self.large_segment_size <= K_MIN_LARGE_ALLOC or self.large_segment_size % _MB:
            raise ValueError(
                "large_segment_size must be a whole number of MiB above 10 MiB "
                f"(large_segment_size_mb > 10), got {self.large_segment_size} B"
            )
        if self.max_non_split_rounding_size is None:
            object.__setattr__(self, "max_non_split_rounding_size", self.large_segment_size)
        for name in ("max_split_size", "max_non_split_rounding_size"):
            size = getattr(self, name)
            if size is not None and size < self.large_segment_size:
                raise ValueError(
                    f"{name} must be at least {self.large_segment_size // _MB} MiB (the large "
                    f"segment size, PyTorch's minimum for {name}_mb), got {size} B"
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


# --------------------------------------------------------------------------- the environment

def allocator_setting(env: dict[str, str]) -> tuple[str, str] | None:
    """The allocator's configuration variable the environment sets (torch reads
    ``PYTORCH_ALLOC_CONF`` first, then ``PYTORCH_CUDA_ALLOC_CONF``) and its value."""
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        if env.get(name, "").strip():
            return name, env[name].strip()
    return None


def config_from_setting(value: str | None, fraction_set: bool = False
                        ) -> tuple[AllocatorConfig, list[str]]:
    """The allocator configuration ``value`` (``PYTORCH_ALLOC_CONF``'s) sets, read as c10's
    ``AcceleratorAllocatorConfig::parseArgs`` reads it (``large_segment_size_mb`` first,
    then the rest in order; a later key wins), and the ``key:value`` settings that change
    the allocator's decisions and are not modelled: ``backend:cudaMallocAsync``, and
    ``garbage_collection_threshold`` where the script set a memory fraction
    (``fraction_set``; without one c10 never collects). A value c10 refuses (it raises at
    the first allocation) is named among them."""
    if not value:
        return DEFAULT_CONFIG, []
    left: list[str] = []
    items = _items(value)
    large = K_LARGE_BUFFER
    for key, setting in items:
        if key == "large_segment_size_mb":
            mb = _whole(setting)
            if mb is None or mb <= K_MIN_LARGE_ALLOC // _MB:
                left.append(f"{key}:{setting} (torch refuses it: it must be more than 10)")
            else:
                large = mb * _MB
    max_split: int | None = None
    non_split = large
    divisions: int | tuple[int, ...] = 0
    expandable = False
    for key, setting in items:
        if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            mb = _whole(setting)
            if mb is None or mb * _MB < large:
                left.append(f"{key}:{setting} (torch refuses it: it must be at least "
                            f"{large // _MB})")
            elif key == "max_split_size_mb":
                max_split = mb * _MB
            else:
                non_split = mb * _MB
        elif key == "roundup_power2_divisions":
            read = _roundup_divisions(setting)
            if read is None:
                left.append(f"{key}:{setting} (torch refuses it: powers of 2 only)")
            else:
                divisions = read
        elif key == "expandable_segments":
            expandable = setting.lower() == "true"
        elif ((key == "backend" and setting != "native")
              or (key == "garbage_collection_threshold" and fraction_set)):
            left.append(f"{key}:{setting}")
    return AllocatorConfig(max_split_size=max_split, max_non_split_rounding_size=non_split,
                           large_segment_size=large, roundup_power2_divisions=divisions,
                           expandable_segments=expandable), left


def _items(value: str) -> list[tuple[str, str]]:
    """``key:value`` pairs at the top level of a configuration (a bracketed list is one
    value), spaces dropped as c10's tokenizer drops them."""
    out, depth, start = [], 0, 0
    text = value.replace(" ", "")
    for i, ch in enumerate(text + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            key, _, setting = text[start:i].partition(":")
            if key:
                out.append((key, setting))
            start = i + 1
    return out


def _whole(setting: str) -> int | None:
    return int(setting) if setting.isdigit() else None


def _roundup_divisions(setting: str) -> int | tuple[int, ...] | None:
    """``parseRoundUpPower2Divisions``: one number for every interval, or a list of
    ``size_mb:divisions`` (the first entry also fills the intervals below it; ``>`` fills
    those after the last named), or None where c10 refuses it."""
    def power2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0

    if not setting.startswith("["):
        n = _whole(setting)
        return n if n is not None and power2(n) else None
    table = [0] * _ROUNDUP_INTERVALS
    first, last = True, 0
    for entry in filter(None, setting.strip("[]").split(",")):
        bound, _, count = entry.partition(":")
        n = _whole(count)
        if n is None or not (n == 0 or power2(n)):
            return None
        if bound == ">":
            table[last + 1:] = [n] * (_ROUNDUP_INTERVALS - last - 1)
            continue
        size_mb = _whole(bound)
        if size_mb is None or not power2(size_mb):
            return None
        index = min(size_mb.bit_length() - 1, _ROUNDUP_INTERVALS - 1)
        if first:
            table[:index] = [n] * index
            first = False
        table[index] = n
        last = index
    return tuple(table)
