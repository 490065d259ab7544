"""From per-device peaks to answers: pure functions of a :class:`RunResult`."""

from __future__ import annotations

import dataclasses
import statistics

from dpprof.answers.answer_figures import primary_excess, used
from dpprof.result import (
    STATUS_OK,
    STATUS_OOM,
    Comparison,
    RunResult,
    ScenarioComparison,
    ScenarioResult,
)
from dpprof.scenarios.names import DP_LOSS_PRIMARY
from dpprof.scenarios.registry import PAIRED


def compare_scenario(s: ScenarioResult) -> ScenarioComparison | None:
    """cuda:0's excess over the median of the other used devices, and max / mean."""
    devs = used(s)
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
    """The comparison block of a run, derived from its scenarios: per-scenario figures and
    savings. Its verdict is the one answer's (:func:`dpprof.answers.answer.settled` derives
    both); here it is empty. A watched command's scenario is compared whatever its status
    (NVML saw the whole GPU up to the end)."""
    watched = run.watch is not None
    figures: dict[str, ScenarioComparison] = {}
    for s in run.scenarios:
        c = compare_scenario(dataclasses.replace(s, status=STATUS_OK) if watched else s)
        if c is not None:
            figures[s.name] = c
    savings: dict[str, int] = {}
    base = primary_peak(run.scenario(DP_LOSS_PRIMARY))
    if base is not None:
        for kind in PAIRED:  # what each other scenario saves on cuda:0
            other = (primary_peak(run.scenario(kind.name)) if kind.name != DP_LOSS_PRIMARY
                     else None)
            if other is not None:
                savings[kind.name] = base - other
    return Comparison(scenarios=figures, savings_bytes=savings)
