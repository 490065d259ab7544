"""cuda:0's excess over the other GPUs, by cause: a pure function of one scenario's result.

The excess is cuda:0's peak minus the peak of the *median other device* (the middle one
of the other used devices by peak; with an even number, the mean of the two middle ones),
the same figure as :attr:`ScenarioComparison.primary_excess_bytes`. It is split by the
per-category ``breakdown_bytes`` of the two, so the causes add up to the excess exactly.

This is deliberately the minimal attribution the reports need. Where a result carries the
authoritative attribution (``RunResult.attribution``, issue 6), the reports use its causes
instead (:func:`dpprof.reports.common.excesses`); this module then only supplies cuda:0's
and the reference device's peaks for the waterfall.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpprof.result import CATEGORIES, STATUS_OK, STATUS_OOM, DeviceResult, ScenarioResult

# The memory categories as causes of cuda:0's excess, in the words of the reports.
CAUSES: dict[str, str] = {
    "outputs": "gathered outputs",
    "loss": "loss and its gradient",
    "parameters": "master parameters",
    "gradients": "reduced gradients",
    "optimizer_state": "optimizer state",
    "inputs": "input batch",
    "communication": "communication buffers",
    "activations": "activations",
    "other": "other",
}


def cause_label(key: str) -> str:
    """The words for a cause: this module's, the authoritative attribution's, or the key."""
    if key in CAUSES:
        return CAUSES[key]
    try:  # the authoritative attribution's labels, where that module exists
        from dpprof.analysis.attribution import CAUSES as labels  # type: ignore[import-not-found]

        return str(labels.get(key, key.replace("_", " ")))
    except ImportError:
        return key.replace("_", " ")


@dataclass(frozen=True)
class Excess:
    """cuda:0 against the median other device of one scenario, split by category."""

    scenario: str
    primary_bytes: int  # cuda:0's peak allocated
    reference_bytes: int  # the median other device's peak allocated
    by_category: dict[str, int]  # category -> cuda:0 minus reference; sums to the excess

    @property
    def excess_bytes(self) -> int:
        return self.primary_bytes - self.reference_bytes


def _reference(others: list[DeviceResult]) -> tuple[int, dict[str, int]]:
    """Peak and breakdown of the median other device (mean of the middle two if even)."""
    ranked = sorted(others, key=lambda d: d.peak_allocated_bytes)
    mid = len(ranked) // 2
    middle = ranked[mid: mid + 1] if len(ranked) % 2 else ranked[mid - 1: mid + 1]
    peak = sum(d.peak_allocated_bytes for d in middle) // len(middle)
    cats = {
        c: sum(d.breakdown_bytes.get(c, 0) for d in middle) // len(middle)
        for c in {c for d in middle for c in d.breakdown_bytes}
    }
    return peak, cats


def excess_by_cause(s: ScenarioResult) -> Excess | None:
    """cuda:0's excess by category, or None without a measurement on two used devices."""
    if s.status not in (STATUS_OK, STATUS_OOM):
        return None
    used = [d for d in s.devices if d.used]
    if len(used) < 2 or used[0].index != 0:
        return None
    primary, others = used[0], used[1:]
    ref_peak, ref_cats = _reference(others)
    order = [c for c in CATEGORIES if c in CAUSES] + sorted(
        c for c in set(primary.breakdown_bytes) | set(ref_cats) if c not in CATEGORIES
    )
    by_cat = {
        c: primary.breakdown_bytes.get(c, 0) - ref_cats.get(c, 0)
        for c in order
        if primary.breakdown_bytes.get(c, 0) or ref_cats.get(c, 0)
    }
    # Breakdowns that do not sum to the peak (rounding of the median, a backend that gives
    # no breakdown): the rest is filed under "other" so the causes add up to the excess.
    rest = (primary.peak_allocated_bytes - ref_peak) - sum(by_cat.values())
    if rest:
        by_cat["other"] = by_cat.get("other", 0) + rest
    return Excess(s.name, primary.peak_allocated_bytes, ref_peak, by_cat)
