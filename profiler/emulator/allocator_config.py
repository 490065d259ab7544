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


# --------------------------------------------------------------------------- the environment

# the settings of PYTORCH_ALLOC_CONF (PYTORCH_CUDA_ALLOC_CONF before torch 2.9) that change
# where blocks go or what they round to, with the value each has by default: the emulation
# simulates the default allocator only
_DECIDING = {"max_split_size_mb": None, "roundup_power2_divisions": None,
             "expandable_segments": "false", "garbage_collection_threshold": None,
             "backend": "native", "large_segment_size_mb": "20"}


def allocator_setting(env: dict[str, str]) -> tuple[str, str] | None:
    """The allocator's configuration variable the environment sets (torch reads
    ``PYTORCH_ALLOC_CONF`` first, then ``PYTORCH_CUDA_ALLOC_CONF``) and its value."""
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        if env.get(name, "").strip():
            return name, env[name].strip()
    return None


def config_from_setting(value: str | None) -> tuple[AllocatorConfig, list[str]]:
    """The allocator configuration ``value`` (``PYTORCH_ALLOC_CONF``'s) sets, as far as the
    simulation models it (``expandable_segments``, ``max_split_size_mb``), and the
    ``key:value`` settings that change its decisions and are not modelled."""
    if not value:
        return DEFAULT_CONFIG, []
    expandable, max_split, left = False, None, []
    for item in settings_not_modelled(value):
        key, _, setting = item.partition(":")
        if key == "expandable_segments" and setting.lower() == "true":
            expandable = True
        elif key == "max_split_size_mb" and setting.isdigit() and int(setting) > 20:
            max_split = int(setting) * _MB  # torch refuses 20 MB or less
        else:
            left.append(item)
    return AllocatorConfig(max_split_size=max_split, expandable_segments=expandable), left


def settings_not_modelled(value: str) -> list[str]:
    """The ``key:value`` settings of an allocator configuration that differ from the
    default allocator's decisions (``roundup_power2_divisions:[256:1,512:2]`` is one)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(value + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(value[start:i].strip())
            start = i + 1
    out = []
    for item in items:
        key, _, setting = item.partition(":")
        key = key.strip()
        if key in _DECIDING and setting.strip().lower() != _DECIDING[key]:
            out.append(f"{key}:{setting.strip()}")
    return out
