"""Markdown for a GitHub issue: what a person pastes when cuda:0 runs out of memory.

The verdict, a table of peak memory per device per scenario, a mermaid ``xychart-beta``
bar chart per scenario that GitHub draws (one bar series and the capacity as a line: the
subset of the syntax every mermaid release with xycharts draws; coloured through an
``init`` directive, which a renderer that ignores it simply skips), cuda:0's excess by
cause, the fix, and how the numbers were obtained, the environment and the full
configuration in collapsed ``<details>`` blocks (the charts, and a fix's code longer than
:data:`LONG_CODE_LINES`, too). Sizes are in the unit that fits them (a chart of MiB is drawn
in MiB). It reads as plain text too.

What it shows of the machine is the caller's choice: ``dpprof`` renders it from
:func:`dpprof.reports.escape.without_host` unless ``--include-host``.

Strings from the user or the environment are escaped for Markdown and HTML (GitHub
renders inline HTML), and stripped of what would break a mermaid string or a code fence.
"""

from __future__ import annotations

import json
from typing import Any

from dpprof.reports import answer_sections
from dpprof.reports.escape import code_fence, code_span, markdown_text, mermaid_label
from dpprof.reports.renderer import Renderer
from dpprof.reports.sentences import (
    EXTRA_COLOURS,
    SCENARIO_COLOURS,
    alert_lines,
    capacity_on_scale,
    fix_why,
    memory_table,
    percent,
    provenance,
    samples,
    spread,
    step_time,
    throughput,
    times,
)
from dpprof.reports.view import ReportView, ScenarioView
from dpprof.reports.view_builder import build_view
from dpprof.result import RunResult
from dpprof.units import fmt_bytes, unit_for

# A fix's code longer than this goes into a collapsed block: the issue shows what to change
# first, the whole class on a click.
LONG_CODE_LINES = 12


def md(x: object) -> str:
    """Text for Markdown (tables included): :func:`dpprof.reports.escape.markdown_text`."""
    return markdown_text(x)


def _mermaid_str(x: object) -> str:
    """A quoted mermaid string: :func:`dpprof.reports.escape.mermaid_label`."""
    return mermaid_label(x)


def _in(n: int | float, size: int) -> str:
    """``n`` bytes in units of ``size`` bytes, to four significant digits (a chart value)."""
    return f"{n / size:.4g}"


def _peak_table(view: ReportView) -> list[str]:
    head = ["scenario", *view.columns, f"{view.primary} excess", "max/mean", "status"]
    lines = ["| " + " | ".join(md(h) for h in head) + " |",
             "| --- |" + " ---: |" * (len(head) - 2) + " --- |"]
    for s in view.scenarios:
        cells = [md(s.name)]
        for k in range(len(view.columns)):
            d = s.cells[k] if k < len(s.cells) else None
            if d is None:
                cells.append("-")
            else:
                v = fmt_bytes(d.peak_allocated_bytes)
                cells.append(f"**{v}** (over)" if d.over_capacity else v)
        cells.append("-" if s.excess_bytes is None else fmt_bytes(s.excess_bytes, signed=True))
        cells.append("-" if s.imbalance is None else f"{s.imbalance:.2f}")
        cells.append("ok" if s.status_label == "ok" else f"**{md(s.status_label)}**")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


# More GPUs than this: cuda:0 against the others' least, median and most (64 labels smear
# a chart's axis), as the terminal's table does.
MAX_CHART_GPUS = 16


def _bars(s: ScenarioView) -> list[tuple[str, int]]:
    """(label, what the GPU needs) per bar: each GPU, or cuda:0 and the others' least,
    median and most where there are more than :data:`MAX_CHART_GPUS`."""
    devs = [(d.label, d.total_peak_bytes) for d in s.devices]
    if len(devs) <= MAX_CHART_GPUS:
        return devs
    others = sorted(devs[1:], key=lambda d: d[1])
    n = len(others)
    return [devs[0], (f"least of {n} others", others[0][1]),
            (f"median of {n}", others[n // 2][1]), (f"most of {n}", others[-1][1])]


def _chart(view: ReportView, s: ScenarioView, top: int) -> str:
    """What each GPU needs (reserved and context where counted, as the out-of-memory check
    counts), a bar per GPU, and the capacity as a red line across; on one GPU, where a line
    of one point is not drawn, as a red bar beside it."""
    bars = _bars(s)
    cap = view.gpu_memory_bytes
    show_cap = capacity_on_scale(cap, top)
    y_max = max(top, cap if show_cap else 0) * 1.05
    unit, size = unit_for([y_max])  # one unit for every chart: they share the scale
    colour = SCENARIO_COLOURS.get(s.name, EXTRA_COLOURS[0])
    labels = [label for label, _ in bars]
    needs = [_in(need, size) for _, need in bars]
    one = show_cap and len(bars) == 1
    if one:
        labels.append("capacity")
    lines = [
        # the bar in the scenario's colour of the HTML report, the capacity in red
        '%%{init: {"themeVariables": {"xyChart": {"plotColorPalette": "'
        + colour + ', #c62828"}}}}%%',
        "xychart-beta",
        f"    title {_mermaid_str(f'{s.name}: what each GPU needs, {unit}')}",
        "    x-axis [" + ", ".join(_mermaid_str(x) for x in labels) + "]",
        f'    y-axis "{unit}" 0 --> {_in(y_max, size)}',
        "    bar [" + ", ".join(needs + (["0"] if one else [])) + "]",
    ]
    if one:
        lines.append(f"    bar [0, {_in(cap, size)}]")
    elif show_cap:
        lines.append("    line [" + ", ".join(_in(cap, size) for _ in bars) + "]")
    return code_fence("\n".join(lines), "mermaid")


def _charts(view: ReportView) -> list[str]:
    if not view.drawn:
        return []
    top = max(d.total_peak_bytes for s in view.drawn for d in s.devices)
    cap = view.gpu_memory_bytes
    out = ["<details><summary>Charts: what each GPU needs, one per scenario</summary>", "",
           f"Each bar is what a GPU needs ({md(view.need_counts)}), as the out-of-memory "
           "check counts it."]
    if capacity_on_scale(cap, top):
        out[-1] += (f" The red line (a red bar beside a single GPU) is each GPU's capacity, "
                    f"{fmt_bytes(cap)}; every chart has the same scale.")
    out.append("")
    for s in view.drawn:
        out += [_chart(view, s, top), ""]
    return [*out, "</details>", ""]


def _code(code: str, lang: str) -> list[str]:
    """A fix's code: shown when short, collapsed when long (a whole class)."""
    fence = code_fence(code, lang)
    lines = code.strip("\n").count("\n") + 1
    if lines <= LONG_CODE_LINES:
        return [fence, ""]
    return [f"<details><summary>The change ({lines} lines)</summary>", "", fence, "",
            "</details>", ""]


def _excess_table(view: ReportView) -> list[str]:
    atts = view.attributions
    if not atts:
        return []
    lines = ["| cause | " + " | ".join(md(a.scenario) for a in atts) + " |",
             "| --- |" + " ---: |" * len(atts)]
    for cause, label in view.cause_rows:
        cells = ["" if (v := a.bytes_of(cause)) is None else fmt_bytes(v, signed=True)
                 for a in atts]
        lines.append(f"| {md(label)} | " + " | ".join(cells) + " |")
    lines.append(f"| **{md(view.primary)}'s excess** | " + " | ".join(
        f"**{fmt_bytes(a.excess_bytes, signed=True)}**" for a in atts) + " |")
    return lines


def _value(v: Any) -> str:
    if isinstance(v, (dict, list)):
        return "`" + json.dumps(v, sort_keys=False).replace("`", "'") + "`"
    if v is None:
        return "n/a"
    return md(v)


def _predicted_time(view: ReportView) -> list[str]:
    """The predicted step per scenario (measured beside it where it was), its speed-up over
    one GPU, and each GPU's share busy."""
    rows = [t for t in view.timings if t.predicted_step_s is not None]
    if not rows:
        return []
    out = ["### Step time, predicted", "",
           "Predicted without a GPU: each op's FLOPs and bytes on the target GPU's peak rates, "
           "its launch and host cost, the interconnect, each GPU waiting for the others.", "",
           "| scenario | step (predicted) | samples/s | × one GPU | measured | "
           "busy per GPU (compute + communication) |",
           "| --- | ---: | ---: | ---: | ---: | --- |"]
    for t in rows:
        step = t.predicted_step_s or 0.0
        busy = ", ".join(
            f"{md(b.label)} {percent(b.busy_s / step)}"
            for b in t.busy) if step else "-"
        measured = step_time(t.measured_step_s) if t.measured_step_s is not None else "-"
        out.append(f"| {md(t.scenario)} | {step_time(t.predicted_step_s)} | "
                   f"{samples(t.predicted_samples_per_s)} | {times(t.speedup_predicted)} | "
                   f"{measured} | {busy} |")
    return [*out, ""]


def render(run: RunResult) -> str:
    """The Markdown report of ``run``."""
    return render_view(build_view(run))


def render_view(view: ReportView) -> str:
    lines = [
        f"## dpprof: {md(view.workload)}, {view.batch_label}, {view.gpus} GPUs ({view.kind})",
        "",
        f"**{md(view.headline.verdict)}**",
        "",
    ]
    if view.speed_sentence:
        lines += [f"**{md(view.speed_sentence)}**", ""]
    alerts = alert_lines(view)
    for a in alerts:
        lines.append(f"> **⚠ {md(a)}**")
    if alerts:
        lines.append("")
    for name, tb in view.tracebacks:
        lines += [f"<details><summary>{md(name)}: the traceback</summary>", "",
                  code_fence(tb, "text"), "", "</details>", ""]
    if view.scenarios:
        lines += ["### Peak memory per GPU", "", *_peak_table(view), ""]
    head, rows = memory_table(view)
    if rows:
        lines += ["<details><summary>Allocated, reserved, context and NVML peaks per GPU"
                  "</summary>", "", "| " + " | ".join(md(h) for h in head) + " |",
                  "| --- | --- |" + " ---: |" * (len(head) - 3) + " --- |"]
        lines += ["| " + " | ".join(md(c) for c in r) + " |" for r in rows]
        lines += ["", "</details>", ""]
    lines += _charts(view)
    excess = _excess_table(view)
    if excess:
        gpu = md(view.primary)
        lines += [f"### {gpu}'s excess by cause", "",
                  f"{gpu} minus the median other GPU, at each device's peak.", "", *excess, ""]
    if view.timed:
        lines += ["### Step time and throughput", "",
                  "| scenario | step time (median) | spread | throughput |",
                  "| --- | ---: | ---: | ---: |"]
        for s in view.timed:
            lines.append(f"| {md(s.name)} | {step_time(s.step_time_s)} | "
                         f"{spread(s.step_time_spread_s)} | "
                         f"{throughput(s.throughput_samples_per_s)} |")
        lines.append("")
    lines += _predicted_time(view)
    if view.maxbatch is not None:  # what each needs, the next step, the limiting GPU
        lines += [answer_sections.markdown_sections(view, parts=("maxbatch",))]
    elif view.max_batches:
        lines += [f"### Largest batch that fits in {fmt_bytes(view.gpu_memory_bytes)} per GPU",
                  "", "| scenario | largest batch |", "| --- | ---: |"]
        lines += [f"| {md(name)} | {b:,} |" for name, b in view.max_batches]
        lines.append("")
    lines += ["### What to change", ""]
    title, why = answer_sections.recommendation_lines(view)
    lines += [f"**{md(title)}**", "", md(why[0]), ""]
    f = view.recommended
    if f is not None:
        lines += [md(fix_why(f)), "", *_code(f.code, f.code_lang)]
    lines += [f"- {md(x)}" for x in why[1:]] + ([""] if why[1:] else [])
    if view.fixes:
        lines += [f"Every change measured against {code_span(view.baseline)}, cheapest "
                  f"first ({md(answer_sections.fix_columns(view))}):",
                  "",
                  answer_sections.md_table(answer_sections.FIX_HEADER,
                                           answer_sections.fix_rows(view)), "",
                  "<details><summary>Each change, measured</summary>", ""]
        lines += [f"- **{md(f.title)}**: {md(f.why)}" for f in view.fixes]
        lines += ["", "</details>", ""]
    extra = answer_sections.markdown_sections(view, parts=("equivalence", "checks"))
    if extra:
        lines += [extra]
    lines += ["<details><summary>How these numbers were obtained</summary>", "",
              md(provenance(view)), ""]
    lines += [f"- {md(a)}" for a in view.assumptions]
    if view.notes:
        lines += ["", "Notes:", ""] + [f"- {md(n)}" for n in view.notes]
    lines += ["", "</details>", "", "<details><summary>Environment</summary>", ""]
    lines += [f"- **{md(k)}**: {_value(v)}" for k, v in view.environment.items()]
    lines += ["", "</details>", "", "<details><summary>Full configuration</summary>", "",
              code_fence(json.dumps(view.full_configuration, indent=2, default=str), "json"),
              "", "</details>", ""]
    return "\n".join(lines)


class MarkdownRenderer(Renderer):
    """Markdown for a GitHub issue."""

    name = "markdown"
    suffix = '.md'
    description = "Markdown for a GitHub issue."

    def render_view(self, view: ReportView) -> str:
        return render_view(view)
