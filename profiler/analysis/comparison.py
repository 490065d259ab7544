"""From per-device peaks to answers: pure functions of a :class:`RunResult`."""

from __future__ import annotations

import statistics

from dpprof.result import (
    STATUS_OK,
    STATUS_OOM,
    Comparison,
    DeviceResult,
    RunResult,
    ScenarioComparison,
    ScenarioResult,
)
from dpprof.scenarios.base import DDP, DP_LOSS_FORWARD, DP_LOSS_PRIMARY, SINGLE
from dpprof.units import fmt_bytes


def used_devices(s: ScenarioResult) -> list[DeviceResult]:
    return [d for d in s.devices if d.used]


def median_devices(others: list[DeviceResult]) -> list[DeviceResult]:
    """The median device by peak: the middle one, or the two middle ones of an even number
    (their mean is the median). The reference cuda:0 is measured against."""
    ordered = sorted(others, key=lambda d: (d.peak_allocated_bytes, d.index))
    k = len(ordered)
    return [ordered[k // 2]] if k % 2 else ordered[k // 2 - 1: k // 2 + 1]


def primary_excess(devs: list[DeviceResult]) -> int:
    """cuda:0 (the first used device) minus the median of the other used devices."""
    if len(devs) < 2:
        return 0
    middle = median_devices(devs[1:])
    median = statistics.fmean(d.peak_allocated_bytes for d in middle)
    return devs[0].peak_allocated_bytes - int(median)


def compare_scenario(s: ScenarioResult) -> ScenarioComparison | None:
    """cuda:0's excess over the median of the other used devices, and max / mean."""
    devs = used_devices(s)
    if not devs or s.status not in (STATUS_OK, STATUS_OOM):
        return None
    peaks = [d.peak_allocated_bytes for d in devs]
    excess = primary_excess(devs)
    mean = statistics.fmean(peaks)
    return ScenarioComparison(
        primary_excess_bytes=excess,
        imbalance=(max(peaks) / mean) if mean else 1.0,
        max_bytes=max(peaks),
        mean_bytes=mean,
    )


def primary_peak(s: ScenarioResult | None) -> int | None:
    if s is None or s.status not in (STATUS_OK, STATUS_OOM) or not s.devices:
        return None
    return s.devices[0].peak_allocated_bytes


def compare(run: RunResult) -> Comparison:
    """The comparison block of a run: per-scenario figures, savings and the verdict."""
    out = Comparison()
    for s in run.scenarios:
        c = compare_scenario(s)
        if c is not None:
            out.scenarios[s.name] = c
    base = primary_peak(run.scenario(DP_LOSS_PRIMARY))
    if base is not None:
        for name in (DP_LOSS_FORWARD, DDP, SINGLE):
            other = primary_peak(run.scenario(name))
            if other is not None:
                out.savings_bytes[name] = base - other
    out.verdict = verdict(run, out)
    return out


def verdict(run: RunResult, c: Comparison) -> str:
    """One sentence: how much heavier cuda:0 is, what the fixes remove, what fails."""
    parts: list[str] = []
    prim = run.scenario(DP_LOSS_PRIMARY)
    pc = c.scenarios.get(DP_LOSS_PRIMARY)
    if prim is not None and pc is not None:
        n = len(used_devices(prim))
        if n > 1:
            parts.append(
                f"cuda:0 needs {fmt_bytes(pc.primary_excess_bytes)} more than the other "
                f"GPUs under {DP_LOSS_PRIMARY} ({pc.imbalance:.2f}x the mean)"
            )
        else:
            parts.append(f"{DP_LOSS_PRIMARY} uses a single GPU at this batch size")
        fwd = c.savings_bytes.get(DP_LOSS_FORWARD)
        if fwd is not None:
            if fwd > 0:
                parts.append(f"computing the loss inside forward removes {fmt_bytes(fwd)} of it")
            else:
                parts.append("computing the loss inside forward does not reduce cuda:0's peak")
    ddp = run.scenario(DDP)
    dc = c.scenarios.get(DDP)
    if ddp is not None and dc is not None:
        n = len(used_devices(ddp))
        parts.append(f"DDP balances all {n} GPUs at {fmt_bytes(dc.max_bytes)}")
    if not parts:
        fwd_c = c.scenarios.get(DP_LOSS_FORWARD)
        if fwd_c is not None:
            parts.append(
                f"under {DP_LOSS_FORWARD} cuda:0 needs {fmt_bytes(fwd_c.primary_excess_bytes)}"
                " more than the other GPUs"
            )
    single = run.scenario(SINGLE)
    if not parts and single is not None and len(used_devices(single)) > 1:
        # a model that places its layers on several GPUs itself (model parallel)
        parts.append("the model places its work on " + ", ".join(
            f"cuda:{d.index} ({fmt_bytes(d.peak_allocated_bytes)})"
            for d in used_devices(single)) + " itself")
    ooms = [s for s in run.scenarios if s.status == STATUS_OOM]
    sentence = "; ".join(parts) if parts else "no scenario produced a measurement"
    if ooms:
        names = ", ".join(f"{s.name} (cuda:{s.oom_device})" for s in ooms)
        sentence += f"; out of memory at {fmt_bytes(run.gpu_memory_bytes)} per GPU: {names}"
    errors = [s.name for s in run.scenarios if s.status not in (STATUS_OK, STATUS_OOM)]
    if errors:
        sentence += f"; failed: {', '.join(errors)}"
    if not sentence.startswith("cuda"):
        sentence = sentence[0].upper() + sentence[1:]
    return sentence + "."
