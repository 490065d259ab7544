"""The sentences and cells several formats share, in human units, from the view.

Formatting only: every number and label comes from :class:`dpprof.reports.view.ReportView`
(built once per result by :func:`dpprof.reports.view_builder.build_view`); these functions turn
bytes into ``1.50 GiB`` and put the view's words into plain-text sentences, which each
format then escapes and marks up.
"""

from __future__ import annotations

from dpprof.reports.view import Alert, FixView, ReportView
from dpprof.scenarios.registry import REGISTRY
from dpprof.units import fmt_bytes

# each scenario's colour in every chart (HTML's plotly bars, Markdown's mermaid bars): its
# own (dpprof.scenarios.registry). Red is kept for out-of-memory and the capacity line; the
# HTML timelines' GPU colours are another set.
SCENARIO_COLOURS = {s.name: s.colour for s in REGISTRY if s.colour}
EXTRA_COLOURS = ("#c9a400", "#8fbc5a", "#d2a679", "#7fb8b0", "#b3a1d6")  # other scenarios


def b(n: int | None, signed: bool = False) -> str:
    """Bytes in binary units; ``-`` when unknown."""
    return "-" if n is None else fmt_bytes(n, signed=signed)


def provenance(view: ReportView) -> str:
    """One sentence: were these numbers measured on GPUs or emulated?"""
    if view.real:
        return (
            f"Measured on {view.gpus} CUDA GPU(s): peaks from the CUDA caching allocator, "
            "timelines from NVML samples."
        )
    kind = "CPU tensors (real numbers)" if view.over_cpu_tensors else "meta tensors (memory only)"
    return (
        f"Emulated: {view.gpus} virtual GPU(s) of {fmt_bytes(view.gpu_memory_bytes)} over "
        f"{kind}; no GPU was used. Out-of-memory results are predictions."
    )


def alert_line(view: ReportView, a: Alert) -> str:
    """One line about a scenario that ran out of memory or failed."""
    if a.failed:
        return f"{a.scenario} failed: {a.message}"
    if a.message.startswith("out of memory on "):  # the emulator's line names the GPU and
        return f"{a.scenario}: {a.message}"  # the bytes: said once
    word = "ran out of memory" if view.real else "would run out of memory"
    verb = "tried to allocate" if view.real else "needs"
    need = f" ({verb} {fmt_bytes(a.needed_bytes)})" if a.needed_bytes else ""
    return f"{a.scenario} {word} on {a.device or 'a GPU'}{need}"


def alert_lines(view: ReportView) -> list[str]:
    return [alert_line(view, a) for a in view.alerts]


def fix_why(f: FixView) -> str:
    """The answer's sentence about a fix (:func:`dpprof.answers.answer.build_answer`)."""
    return f.why


def capacity_on_scale(capacity_bytes: int, top_bytes: int) -> bool:
    """Is the capacity line close enough to the largest bar to be drawn on its scale?"""
    return 0 < capacity_bytes <= 1.6 * max(top_bytes, 1)


def memory_table(view: ReportView) -> tuple[list[str], list[list[str]]]:
    """Allocated, reserved, context and NVML peaks per scenario and device (plain text);
    empty when only allocated is known."""
    if not view.memory_rows:
        return [], []
    head = ["scenario", "device", *view.memory_columns, "phase of the peak"]
    rows = [[r.scenario, r.device, *(b(v) for v in r.values_bytes), r.phase]
            for r in view.memory_rows]
    return head, rows


def run_title(view: ReportView) -> str:
    """``workload · batch 8 · 4 GPUs of 24.0 GiB · emulated``."""
    return (f"{view.workload} · batch {view.batch} · {view.gpus} GPUs of "
            f"{fmt_bytes(view.gpu_memory_bytes)} · {view.backend}")


def step_time(s_time: float | None) -> str:
    return f"{(s_time or 0) * 1e3:.1f} ms"


def spread(spread_s: float | None) -> str:
    return "-" if spread_s is None else f"{spread_s * 1e3:.1f} ms"


def samples(samples_per_s: float | None) -> str:
    """Samples per second, short (a table cell)."""
    return "-" if samples_per_s is None else f"{samples_per_s:,.0f}"


def times(ratio: float | None) -> str:
    """A speed-up: "3.7x"."""
    return "-" if ratio is None else f"{ratio:.1f}x"


def percent(fraction: float) -> str:
    return f"{fraction * 100:.0f}%"


def throughput(samples_per_s: float | None) -> str:
    return "-" if samples_per_s is None else f"{samples_per_s:,.0f} samples/s"
