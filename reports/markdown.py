"""Markdown for a GitHub issue: what a person pastes when cuda:0 runs out of memory.

The verdict, a table of peak memory per device per scenario, a mermaid ``xychart-beta``
bar chart per scenario that GitHub draws (one bar series and the capacity as a line: the
subset of the syntax every mermaid release with xycharts draws; coloured through an
``init`` directive, which a renderer that ignores it simply skips), cuda:0's excess by
cause, the fix, and how the numbers were obtained, the environment and the full
configuration in collapsed ``<details>`` blocks. It reads as plain text too.

Strings from the user or the environment are escaped for Markdown and HTML (GitHub
renders inline HTML), and stripped of what would break a mermaid string or a code fence.
"""

from __future__ import annotations

import json
import re
from typing import Any

from dpprof.analysis.attribution import cause_label
from dpprof.analysis.fixes import recommended
from dpprof.reports import answers
from dpprof.reports.base import Renderer
from dpprof.reports.common import (
    cause_rows,
    device_label,
    excesses,
    failure_tracebacks,
    fix_why,
    is_real,
    max_batches,
    measured,
    memory_rows,
    nothing_to_change,
    oom_lines,
    provenance,
    used_devices,
)
from dpprof.reports.escape import code_fence, markdown_text, mermaid_label
from dpprof.result import STATUS_OK, STATUS_OOM, RunResult, ScenarioResult
from dpprof.units import fmt_bytes

GiB = 2**30
BAR_COLOURS = {
    "dp-loss-primary": "#c44e52", "dp-loss-forward": "#dd8452", "ddp": "#55a868",
    "single": "#8c8c8c",
}


def md(x: object) -> str:
    """Text for Markdown (tables included): :func:`dpprof.reports.escape.markdown_text`."""
    return markdown_text(x)


def _mermaid_str(x: object) -> str:
    """A quoted mermaid string: :func:`dpprof.reports.escape.mermaid_label`."""
    return mermaid_label(x)


def _fence(text: str, lang: str = "") -> str:
    """A code block whose fence is longer than any run of backticks inside."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{text.rstrip()}\n{fence}"


def _gib(n: int | float) -> str:
    return f"{n / GiB:.2f}"


def _peak_table(run: RunResult) -> list[str]:
    cols = max((len(s.devices) for s in run.scenarios), default=0)
    ref = max(run.scenarios, key=lambda s: len(s.devices), default=None)
    labels = [device_label(ref, d) for d in ref.devices] if ref and ref.devices else []
    head = ["scenario", *labels, "cuda:0 excess", "max/mean", "status"]
    lines = ["| " + " | ".join(md(h) for h in head) + " |",
             "| --- |" + " ---: |" * (len(head) - 2) + " --- |"]
    for s in run.scenarios:
        cells = [md(s.name)]
        for k in range(cols):
            d = s.devices[k] if k < len(s.devices) else None
            if d is None or not d.used or not measured(s):
                cells.append("-")
            else:
                v = fmt_bytes(d.peak_allocated_bytes)
                cells.append(f"**{v}** (over)" if d.peak_allocated_bytes > d.capacity_bytes > 0
                             else v)
        c = run.comparison.scenarios.get(s.name)
        cells.append(fmt_bytes(c.primary_excess_bytes, signed=True) if c else "-")
        cells.append(f"{c.imbalance:.2f}" if c else "-")
        cells.append({STATUS_OK: "ok", STATUS_OOM: "**OOM**"}.get(s.status, f"**{md(s.status)}**"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _chart(run: RunResult, s: ScenarioResult, top: int) -> str:
    devs = used_devices(s)
    cap = run.gpu_memory_bytes
    show_cap = 0 < cap <= 1.6 * max(top, 1)
    y_max = max(top, cap if show_cap else 0) * 1.05
    colour = BAR_COLOURS.get(s.name, "#4c72b0")
    lines = [
        # the bar in the scenario's colour of the HTML report, the capacity line in red
        '%%{init: {"themeVariables": {"xyChart": {"plotColorPalette": "'
        + colour + ', #c62828"}}}}%%',
        "xychart-beta",
        f"    title {_mermaid_str(f'{s.name}: peak allocated per GPU (GiB)')}",
        "    x-axis [" + ", ".join(_mermaid_str(device_label(s, d)) for d in devs) + "]",
        f'    y-axis "GiB" 0 --> {float(_gib(y_max)):.4g}',
        "    bar [" + ", ".join(_gib(d.peak_allocated_bytes) for d in devs) + "]",
    ]
    if show_cap:
        lines.append("    line [" + ", ".join(_gib(cap) for _ in devs) + "]")
    return _fence("\n".join(lines), "mermaid")


def _charts(run: RunResult) -> list[str]:
    drawn = [s for s in run.scenarios if measured(s) and used_devices(s)]
    if not drawn:
        return []
    top = max(d.peak_allocated_bytes for s in drawn for d in used_devices(s))
    cap = run.gpu_memory_bytes
    out = []
    if 0 < cap <= 1.6 * max(top, 1):
        out += [f"The line is each GPU's capacity, {fmt_bytes(cap)}; every chart has the same "
                "scale.", ""]
    for s in drawn:
        out += [_chart(run, s, top), ""]
    return out


def _excess_table(run: RunResult) -> list[str]:
    exs = excesses(run)
    if not exs:
        return []
    lines = ["| cause | " + " | ".join(md(ex.scenario) for ex in exs) + " |",
             "| --- |" + " ---: |" * len(exs)]
    for c in cause_rows(exs):
        cells = [fmt_bytes(ex.causes_bytes[c], signed=True) if c in ex.causes_bytes else ""
                 for ex in exs]
        lines.append(f"| {md(cause_label(c))} | " + " | ".join(cells) + " |")
    lines.append("| **cuda:0's excess** | " + " | ".join(
        f"**{fmt_bytes(ex.excess_bytes, signed=True)}**" for ex in exs) + " |")
    return lines


def _value(v: Any) -> str:
    if isinstance(v, (dict, list)):
        return "`" + json.dumps(v, sort_keys=False).replace("`", "'") + "`"
    if v is None:
        return "n/a"
    return md(v)


def render(run: RunResult) -> str:
    kind = "measured" if is_real(run) else "emulated"
    lines = [
        f"## dpprof: {md(run.workload)}, batch {run.batch}, {run.gpus} GPUs ({kind})",
        "",
        f"**{md(run.comparison.verdict or 'No verdict: the result has no comparison.')}**",
        "",
    ]
    for a in oom_lines(run):
        lines.append(f"> **⚠ {md(a)}**")
    if oom_lines(run):
        lines.append("")
    for name, tb in failure_tracebacks(run):
        lines += [f"<details><summary>{md(name)}: the traceback</summary>", "",
                  code_fence(tb, "text"), "", "</details>", ""]
    lines += ["### Peak memory per GPU", "", *_peak_table(run), ""]
    head, rows = memory_rows(run)
    if rows:
        lines += ["<details><summary>Allocated, reserved, context and NVML peaks per GPU"
                  "</summary>", "", "| " + " | ".join(md(h) for h in head) + " |",
                  "| --- | --- |" + " ---: |" * (len(head) - 3) + " --- |"]
        lines += ["| " + " | ".join(md(c) for c in r) + " |" for r in rows]
        lines += ["", "</details>", ""]
    lines += _charts(run)
    excess = _excess_table(run)
    if excess:
        lines += ["### cuda:0's excess by cause", "",
                  "cuda:0 minus the median other GPU, at each device's peak.", "", *excess, ""]
    timed = [s for s in run.scenarios if s.step_time_s is not None]
    if timed:
        lines += ["### Step time and throughput", "",
                  "| scenario | step time (median) | spread | throughput |",
                  "| --- | ---: | ---: | ---: |"]
        for s in timed:
            spread = (f"{s.step_time_spread_s * 1e3:.1f} ms"
                      if s.step_time_spread_s is not None else "-")
            thr = (f"{s.throughput_samples_per_s:,.0f} samples/s"
                   if s.throughput_samples_per_s is not None else "-")
            lines.append(f"| {md(s.name)} | {(s.step_time_s or 0) * 1e3:.1f} ms | {spread} | "
                         f"{thr} |")
        lines.append("")
    sized = max_batches(run)
    if sized:
        lines += [f"### Largest batch that fits in {fmt_bytes(run.gpu_memory_bytes)} per GPU", "",
                  "| scenario | largest batch |", "| --- | ---: |"]
        lines += [f"| {md(name)} | {b:,} |" for name, b in sized]
        lines.append("")
    lines += ["### What to change", ""]
    found = recommended(run)
    if not found:
        lines += [md(nothing_to_change(run)), ""]
    for f in found:
        lang = "diff" if f.code.lstrip().startswith(("-", "+", "@@")) else "python"
        lines += [f"**{md(f.title)}.** {md(fix_why(run, f))}", "", _fence(f.code, lang), ""]
    extra = answers.markdown_sections(run, parts=("equivalence", "checks"))
    if extra:
        lines += [extra]
    lines += ["<details><summary>How these numbers were obtained</summary>", "",
              md(provenance(run)), ""]
    lines += [f"- {md(a)}" for a in run.assumptions]
    notes = [*run.notes, *(f"{s.name}: {n}" for s in run.scenarios for n in s.notes
                           if "Traceback" not in n)]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {md(n)}" for n in notes]
    lines += ["", "</details>", "", "<details><summary>Environment</summary>", ""]
    lines += [f"- **{md(k)}**: {_value(v)}" for k, v in run.environment.items()]
    config = {
        "backend": run.backend, "workload": run.workload, "batch": run.batch, "gpus": run.gpus,
        "gpu_memory_bytes": run.gpu_memory_bytes, "dtype": run.dtype, "seed": run.seed,
        "dpprof_version": run.dpprof_version, "created": run.created,
        "schema_version": run.schema_version, "config": run.config,
    }
    lines += ["", "</details>", "", "<details><summary>Full configuration</summary>", "",
              _fence(json.dumps(config, indent=2, default=str), "json"), "", "</details>", ""]
    return "\n".join(lines)


class MarkdownRenderer(Renderer):
    """Markdown for a GitHub issue."""

    name = "markdown"
    suffix = '.md'
    description = "Markdown for a GitHub issue."

    def render(self, run: RunResult) -> str:
        return render(run)
