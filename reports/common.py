"""What every renderer says the same way: device labels, OOM lines, provenance, cuda:0's
excess by cause (the attribution), the recommended fixes.

Pure functions of a :class:`RunResult`; no formatting beyond plain text. The analysis lives
in :mod:`dpprof.analysis` (attribution, fixes); this module only shapes it for renderers.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpprof.analysis.attribution import CAUSES, attribute
from dpprof.analysis.fixes import from_scenarios, heaviest_saving
from dpprof.result import STATUS_OK, STATUS_OOM, DeviceResult, Fix, RunResult, ScenarioResult
from dpprof.units import fmt_bytes

MEASURED = ("ok", "oom")


def measured(s: ScenarioResult) -> bool:
    return s.status in (STATUS_OK, STATUS_OOM)


def used_devices(s: ScenarioResult) -> list[DeviceResult]:
    return [d for d in s.devices if d.used]


def nodes(s: ScenarioResult) -> list[str]:
    """The distinct hosts of a scenario's devices, in order (empty: one unnamed host)."""
    seen: list[str] = []
    for d in s.devices:
        if d.node and d.node not in seen:
            seen.append(d.node)
    return seen


def device_label(s: ScenarioResult, d: DeviceResult) -> str:
    """``cuda:1``; across several hosts ``host/cuda:1``; plain text (escape it to show it)."""
    if len(nodes(s)) > 1 and d.node:
        return f"{d.node}/cuda:{d.index}"
    return f"cuda:{d.index}"


def is_real(run: RunResult) -> bool:
    return run.backend == "cuda"


def provenance(run: RunResult) -> str:
    """One sentence: were these numbers measured on GPUs or emulated?"""
    if is_real(run):
        return (
            f"Measured on {run.gpus} CUDA GPU(s): peaks from the CUDA caching allocator, "
            "timelines from NVML samples."
        )
    kind = "CPU tensors (real numbers)" if run.backend == "cpu" or run.config.get(
        "compute") else "meta tensors (memory only)"
    return (
        f"Emulated: {run.gpus} virtual GPU(s) of {fmt_bytes(run.gpu_memory_bytes)} over "
        f"{kind}; no GPU was used. Out-of-memory results are predictions."
    )


def oom_lines(run: RunResult) -> list[str]:
    """One line per scenario that ran out of memory or failed."""
    word = "ran out of memory" if is_real(run) else "would run out of memory"
    lines = []
    for s in run.scenarios:
        if s.status == STATUS_OOM:
            dev = f"cuda:{s.oom_device}" if s.oom_device is not None else "a GPU"
            verb = "tried to allocate" if is_real(run) else "needs"
            need = f" ({verb} {fmt_bytes(s.oom_bytes)})" if s.oom_bytes else ""
            lines.append(f"{s.name} {word} on {dev}{need}: {s.message}".rstrip(": "))
        elif s.status not in MEASURED:
            lines.append(f"{s.name} failed: {s.message}")
    return lines


def failure_tracebacks(run: RunResult, max_chars: int = 20_000) -> list[tuple[str, str]]:
    """(scenario, traceback) for each failed scenario that kept one (DDP: the rank that
    caused the failure, not the peers that lost their connection to it); the end of a long
    traceback, where the error is."""
    out = []
    for s in run.scenarios:
        if s.status not in MEASURED and s.traceback:
            tb = s.traceback.rstrip()
            out.append((s.name, tb if len(tb) <= max_chars else "...\n" + tb[-max_chars:]))
    return out


@dataclass(frozen=True)
class Excess:
    """cuda:0 against the median other device of one scenario, by cause (the attribution,
    :mod:`dpprof.analysis.attribution`: the only split of the excess)."""

    scenario: str
    primary_bytes: int  # cuda:0's peak allocated
    causes_bytes: dict[str, int]  # cause -> bytes; sums to the excess
    excess_bytes: int

    @property
    def reference_bytes(self) -> int:
        """The median other device's peak."""
        return self.primary_bytes - self.excess_bytes


def excess_of(run: RunResult, s: ScenarioResult) -> Excess | None:
    """cuda:0's excess by cause in ``s``: the result's attribution (computed by the same
    function for results saved without one)."""
    att = run.attribution.get(s.name) or attribute(s)
    used = used_devices(s)
    if att is None or not used or not measured(s):
        return None
    return Excess(s.name, used[0].peak_allocated_bytes, dict(att.causes_bytes),
                  att.excess_bytes)


def excesses(run: RunResult) -> list[Excess]:
    return [ex for s in run.scenarios if (ex := excess_of(run, s)) is not None]


def cause_rows(exs: list[Excess]) -> list[str]:
    """The causes any of ``exs`` names, in the attribution's order."""
    return [c for c in CAUSES if any(ex.causes_bytes.get(c) for ex in exs)]


def max_batches(run: RunResult) -> list[tuple[str, int]]:
    """(scenario, largest global batch that fits) where computed: the result's max-batch
    search when it has one, else ``ScenarioResult.max_batch``."""
    if run.maxbatch is not None and run.maxbatch.entries:
        return [(e.scenario, e.max_batch) for e in run.maxbatch.entries
                if e.max_batch is not None]
    return [(s.name, s.max_batch) for s in run.scenarios if s.max_batch is not None]


def fix_why(run: RunResult, f: Fix) -> str:
    """The fix's detail and what it saves, one sentence each."""
    saves = ""
    heaviest = heaviest_saving(run, f)
    if f.saves_bytes is not None and heaviest is not None:
        saves = (f"Saves {fmt_bytes(f.saves_bytes)} on cuda:0"
                 + ("" if heaviest == f.saves_bytes else
                    f", {fmt_bytes(heaviest)} on the heaviest GPU") + ".")
    return " ".join(x for x in (f.detail.rstrip(".") + "." if f.detail else "", saves) if x)


def nothing_to_change(run: RunResult) -> str:
    """What the reports say when no fix is recommended: never "nothing to change" about a
    run that measured nothing."""
    if not any(measured(s) for s in run.scenarios):
        return ("No recommendation: no scenario produced a measurement (see the errors "
                "above).")
    if run.fixes or from_scenarios(run):
        return ("Nothing to change: no fix lowers the heaviest GPU's peak in this "
                "comparison.")
    return "Nothing to change: cuda:0 carries no excess worth a change in any scenario measured."


MEMORY_COLUMNS = (
    ("peak_allocated_bytes", "allocated"),
    ("peak_requested_bytes", "requested"),
    ("peak_reserved_bytes", "reserved"),
    ("workspace_bytes", "of which workspaces"),
    ("context_bytes", "context"),
    ("nvml_peak_used_bytes", "NVML used"),
)


def memory_rows(run: RunResult) -> tuple[list[str], list[list[str]]]:
    """Per scenario and device: allocated, reserved, context and NVML peaks (plain text).

    Columns that no device has are left out; empty when only allocated is known.
    """
    devs = [(s, d) for s in run.scenarios if measured(s) for d in used_devices(s)]
    cols = [(k, name) for k, name in MEMORY_COLUMNS
            if any(getattr(d, k) for _, d in devs)]
    if [k for k, _ in cols] in ([], ["peak_allocated_bytes"],
                                ["peak_allocated_bytes", "peak_requested_bytes"]):
        return [], []
    head = ["scenario", "device", *(name for _, name in cols), "phase of the peak"]
    rows = []
    for s, d in devs:
        vals = [getattr(d, k) for k, _ in cols]
        rows.append([s.name, device_label(s, d),
                     *(fmt_bytes(v) if v is not None else "-" for v in vals),
                     d.peak_phase.replace("_", " ") or "-"])
    return head, rows
