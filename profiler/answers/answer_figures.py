"""The figures every answer reads off a scenario: the GPUs it used, whether it was measured,
what its fullest GPU needs, its heaviest GPU, and cuda:0's excess over the median of the
others with the margin under which that excess is noise."""

from __future__ import annotations

import statistics

from dpprof.fixes.fix_kind import MIN_SAVING
from dpprof.result import STATUS_OK, STATUS_OOM, DeviceResult, RunResult, ScenarioResult
from dpprof.scenarios.names import DP_LOSS_PRIMARY
from dpprof.units import fmt_bytes

MEASURED = (STATUS_OK, STATUS_OOM)
# MIN_SAVING: a difference under 1 % of the heaviest GPU's peak is noise (a loss tensor), not
# a change: a fix that saves less is not recommended, a cuda:0 within it is balanced.
BALANCED_FRACTION = MIN_SAVING


def used(s: ScenarioResult) -> list[DeviceResult]:
    """The GPUs the scenario put memory on."""
    return [d for d in s.devices if d.used]


def measured(s: ScenarioResult | None) -> bool:
    """Whether the scenario ran (or ran out of memory) and used a GPU."""
    return s is not None and s.status in MEASURED and bool(used(s))


def need_bytes(s: ScenarioResult) -> int:
    """What the fullest GPU needs, as the out-of-memory check counts it: reserved (or
    allocated) plus the context, where they were modelled or measured."""
    return max((d.total_peak_bytes for d in used(s)), default=0)


def budget_bytes(run: RunResult, s: ScenarioResult | None) -> int:
    """What the fullest GPU of ``s`` may need: the GPU's memory, or where the script limits
    its caching allocator (``set_per_process_memory_fraction``), that limit and the CUDA
    context beside it (the need counts both)."""
    if s is None or s.allocator_limit_bytes is None:
        return run.gpu_memory_bytes
    context = max((d.context_bytes or 0 for d in used(s)), default=0)
    return min(run.gpu_memory_bytes, s.allocator_limit_bytes + context)


def budget_words(run: RunResult, s: ScenarioResult | None) -> str:
    """:func:`budget_bytes` in words, the memory fraction named where it sets it."""
    cap = fmt_bytes(budget_bytes(run, s))
    if s is None or s.allocator_limit_bytes is None:
        return cap
    return (f"{cap} (the script's memory fraction: {fmt_bytes(s.allocator_limit_bytes)} for "
            "the caching allocator, and the CUDA context)")


def heaviest(s: ScenarioResult) -> DeviceResult:
    """The GPU with the highest allocated peak (the lowest index of equals)."""
    return max(used(s), key=lambda d: (d.peak_allocated_bytes, -d.index))


def counts(run: RunResult) -> str:
    """What :func:`need_bytes` counts in ``run``, in words."""
    devs = [d for s in run.scenarios if measured(s) for d in used(s)]
    reserved = any(d.peak_reserved_bytes is not None for d in devs)
    context = any(d.context_bytes is not None for d in devs)
    if reserved and context:
        return "reserved memory and the CUDA context counted"
    if reserved:
        return "reserved memory counted"
    return "allocated only: reserved memory and the CUDA context were not emulated"


def excess_over_median(first: float, others: list[float]) -> float:
    """``first`` minus the median of ``others`` (the mean of the middle two of an even
    number): how cuda:0's excess is measured everywhere."""
    return first - statistics.median(others) if others else 0.0


def balanced(excess: float, peak: float) -> bool:
    """Whether ``excess`` is noise: within :data:`BALANCED_FRACTION` of ``peak``."""
    return abs(excess) <= BALANCED_FRACTION * max(peak, 1)


def device_label(d: DeviceResult) -> str:
    """A GPU as the answers name it: ``cuda:1``, or ``node/cuda:1`` on several nodes."""
    return f"{d.node}/cuda:{d.index}" if d.node else f"cuda:{d.index}"


def median_devices(others: list[DeviceResult]) -> list[DeviceResult]:
    """The median device by peak: the middle one, or the two middle ones of an even number
    (their mean is the median). The reference cuda:0 is measured against."""
    ordered = sorted(others, key=lambda d: (d.peak_allocated_bytes, d.index))
    k = len(ordered)
    return [ordered[k // 2]] if k % 2 else ordered[k // 2 - 1: k // 2 + 1]


def primary_label(s: ScenarioResult | None) -> str:
    """The GPU a scenario's excess is measured on, as the answers name it: the first it used
    (DataParallel's first ``device_ids``: cuda:0 unless the script names others), by its
    index alone (DataParallel is one process, on one node)."""
    devs = used(s) if s is not None else []
    return f"cuda:{devs[0].index}" if devs else "cuda:0"


def run_primary_label(run: RunResult) -> str:
    """The GPU the run's DataParallel excess is measured on (its baseline's:
    :func:`primary_label`), for the reports' headings."""
    return primary_label(run.scenario(DP_LOSS_PRIMARY))


def primary_excess(devs: list[DeviceResult]) -> int:
    """cuda:0 (the first used device) minus the median of the other used devices."""
    if len(devs) < 2:
        return 0
    middle = median_devices(devs[1:])
    median = statistics.fmean(d.peak_allocated_bytes for d in middle)
    return devs[0].peak_allocated_bytes - int(median)
