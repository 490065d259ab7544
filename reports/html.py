"""HTML: one self-contained page that opens offline in any browser and reads top to bottom.

The page: the verdict (out-of-memory results in red), peak memory per GPU per scenario
with the capacity line, cuda:0's excess by cause as a waterfall per scenario, what each
GPU holds at its peak, memory over the step per device with the phases marked, step time
and throughput, the largest batch, the code to change, and how the numbers were obtained
(assumptions, configuration, environment).

Figures are built with plotly's Python API (:mod:`plotly.graph_objects`), which validates
every property against the schema of the plotly.js it ships; the page carries their JSON.
They are drawn by plotly.js's *basic* partial bundle (bar, scatter and pie traces:
everything this page needs; the waterfall is bars with a ``base``) at the version plotly.py
bundles, vendored next to this module from the npm package ``plotly.js-basic-dist-min``
(MIT; see ``scripts/update_plotly_js.sh``) and inlined once as a plain ``<script>``. At
1.2 MB instead of the full bundle's 4.8 MB (plotly.py ships only the full one), it keeps a
report near 1.3 MB and needs nothing a browser might lack (no decompression, no module
loading, no network).

The page reads at a phone's 390 px as at 1400 px (tables scroll inside their cards, a chart
grows when its legend would squeeze the plot, phase labels that would collide are hidden),
follows the reader's dark mode (``prefers-color-scheme``: the charts' colours are swapped by
:data:`DARK_COLOURS`) and prints on A4 or Letter (charts redrawn at the page's width, never
split across pages). Red means out of memory, and only that: the capacity line, OOM bars and
the alerts.

Every string that comes from the user or the environment is escaped: HTML text through
:func:`html.escape`; chart data is JSON with ``<``, ``>`` and ``&`` escaped inside a
``type="application/json"`` script, and the labels plotly draws have ``<``, ``>`` and
``&`` turned into entities (plotly reads a few HTML tags in labels). A hostile workload
name renders as text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go  # type: ignore[import-untyped]

from dpprof.reports import answer_sections, watch_sections
from dpprof.reports.html_figures import (
    CHART_UNIT,
    breakdown_figure,
    busy_figure,
    chart_unit_name,
    hbar_figure,
    peak_figure,
    scenario_colour,
    step_timeline_figure,
    unit_for,
    waterfall_figure,
)
from dpprof.reports.html_page import escape, page_document
from dpprof.reports.renderer import Renderer
from dpprof.reports.sentences import (
    alert_lines,
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
from dpprof.reports.view import ReportView
from dpprof.reports.view_builder import build_view
from dpprof.result import RunResult
from dpprof.units import fmt_bytes


def _excess_table(view: ReportView) -> str:
    atts = view.attributions
    if not atts:
        return ""
    head = "".join(f"<th>{escape(a.scenario)}</th>" for a in atts)
    rows = []
    for cause, label in view.cause_rows:
        cells = "".join(
            f"<td>{'' if (v := a.bytes_of(cause)) is None else escape(fmt_bytes(v, signed=True))}"
            "</td>" for a in atts
        )
        rows.append(f"<tr><td>{escape(label)}</td>{cells}</tr>")
    total = "".join(f"<th>{escape(fmt_bytes(a.excess_bytes, signed=True))}</th>" for a in atts)
    gpu = escape(view.primary)
    return (
        f"<details><summary>The numbers: {gpu} minus the median other GPU, by cause"
        f"</summary><div class='card scroll'><table><tr><th>cause</th>{head}</tr>"
        f"{''.join(rows)}<tr><th>{gpu}'s excess</th>{total}</tr></table></div></details>"
    )


# ---- the sections' tables ----------------------------------------------------------------


def _timing(view: ReportView) -> tuple[go.Figure | None, str]:
    rows = view.timed
    if not rows:
        return None, ""
    table = ["<table><tr><th>scenario</th><th>step time (median)</th><th>spread (max-min)"
             "</th><th>throughput</th></tr>"]
    for s in rows:
        table.append(f"<tr><td>{escape(s.name)}</td><td>{step_time(s.step_time_s)}</td>"
                     f"<td>{escape(spread(s.step_time_spread_s))}</td>"
                     f"<td>{escape(throughput(s.throughput_samples_per_s))}</td></tr>")
    table.append("</table>")
    thr_rows = [s for s in rows if s.throughput_samples_per_s]
    fig = None
    if thr_rows:
        fig = hbar_figure(
            [s.name for s in thr_rows], [s.throughput_samples_per_s or 0 for s in thr_rows],
            [f"{s.throughput_samples_per_s:,.0f}/s · {(s.step_time_s or 0) * 1e3:.0f} ms"
             for s in thr_rows],
            "throughput (samples per second)",
            [scenario_colour(s.name, i) for i, s in enumerate(thr_rows)],
        )
    return fig, "".join(table)


def _max_batch(view: ReportView) -> tuple[go.Figure | None, str]:
    rows = view.max_batches
    if not rows:
        return None, ""
    fig = hbar_figure(
        [name for name, _ in rows], [float(b) for _, b in rows], [f"{b:,}" for _, b in rows],
        f"largest global batch that fits in {fmt_bytes(view.gpu_memory_bytes)} per GPU",
        [scenario_colour(name, i) for i, (name, _) in enumerate(rows)],
    )
    table = "".join(f"<tr><td>{escape(name)}</td><td>{b:,}</td></tr>" for name, b in rows)
    return fig, f"<table><tr><th>scenario</th><th>largest batch</th></tr>{table}</table>"


# ---- tables and text ----------------------------------------------------------------------


def _table(view: ReportView) -> str:
    head = "".join(f"<th>{escape(lb)}</th>" for lb in view.columns)
    rows = []
    for s in view.scenarios:
        cells = []
        for k in range(len(view.columns)):
            d = s.cells[k] if k < len(s.cells) else None
            if d is None:
                cells.append("<td class='dim'>-</td>")
            else:
                cls = " class='oom'" if d.out_of_memory else ""
                cells.append(f"<td{cls}>{escape(fmt_bytes(d.peak_allocated_bytes))}</td>")
        exc = "-" if s.excess_bytes is None else escape(fmt_bytes(s.excess_bytes, signed=True))
        imb = "-" if s.imbalance is None else f"{s.imbalance:.2f}"
        status = "ok" if s.status_label == "ok" else \
            f"<span class='oom'>{escape(s.status_label)}</span>"
        rows.append(
            f"<tr><td>{escape(s.name)}</td><td class='l'>{status}</td>{''.join(cells)}"
            f"<td>{exc}</td><td>{imb}</td></tr>"
        )
    # the status beside the scenario, where a phone shows it without scrolling; the GPUs
    # scroll inside the card, the scenario's name held at its left edge
    return (
        f"<div class='card scroll'><table id='peaks-table' class='sticky'><tr>"
        f"<th>scenario</th><th class='l'>status</th>{head}<th>{escape(view.primary)} excess</th>"
        f"<th>max/mean</th></tr>{''.join(rows)}</table></div>"
    )


def _value(v: Any) -> str:
    """A configuration or environment value: nested lists and dicts as small tables."""
    if isinstance(v, dict):
        if not v:
            return "<span class='dim'>(empty)</span>"
        return _kv_table(v)
    if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
        keys = list(dict.fromkeys(k for x in v for k in x))
        head = "".join(f"<th>{escape(k)}</th>" for k in keys)
        body = "".join(
            "<tr>" + "".join(f"<td class='l'>{escape(x.get(k, ''))}</td>" for k in keys) + "</tr>"
            for x in v
        )
        return f"<table><tr>{head}</tr>{body}</table>"
    if isinstance(v, list):
        return escape(", ".join(str(x) for x in v))
    if v is None:
        return "<span class='dim'>n/a</span>"
    return escape(v)


def _kv_table(items: Mapping[str, Any]) -> str:
    rows = []
    for k, v in items.items():
        shown = _value(v)
        if isinstance(v, int) and not isinstance(v, bool) and str(k).endswith("_bytes"):
            shown = f"{escape(fmt_bytes(v))} <span class='dim'>({v:,} B)</span>"
        rows.append(f"<tr><td>{escape(k)}</td><td>{shown}</td></tr>")
    return f"<table class='kv'>{''.join(rows)}</table>"


def _verdict_html(view: ReportView) -> str:
    """The verdict, with its out-of-memory clause in red."""
    parts = view.headline.verdict_parts
    if parts is not None:
        before, clause, after = parts
        return f"{escape(before)}<span class='oom'>{escape(clause)}</span>{escape(after)}"
    return escape(view.headline.verdict)


def _fixes_html(view: ReportView) -> str:
    head, why = answer_sections.recommendation_lines(view)
    f = view.recommended
    fix = ("" if f is None else f"<p>{escape(fix_why(f))}</p>"
           f"<pre><code>{escape(f.code)}</code></pre>")
    passed = ("<ul class='passed'>" + "".join(f"<li>{escape(x)}</li>" for x in why[1:])
              + "</ul>" if why[1:] else "")
    return (f"<div class='fix card' id='recommended'><h3>{escape(head)}</h3>"
            f"<p>{escape(why[0])}</p>{fix}{passed}</div>" + answer_sections.html_fix_table(view))


def render(run: RunResult) -> str:
    """The page for ``run``."""
    return render_view(build_view(run))


def render_view(view: ReportView) -> str:
    """The page for a result's view."""
    token = CHART_UNIT.set(unit_for(view.top_bytes))
    try:
        return _render(view)
    finally:
        CHART_UNIT.reset(token)


class _Page:
    """The page being built: its numbered section titles and the figures its charts draw."""

    def __init__(self) -> None:
        self.sections = 0
        self.figures: dict[str, go.Figure | dict[str, Any]] = {}

    def h2(self, title: str) -> str:
        self.sections += 1
        return f"<h2><span class='n'>{self.sections}</span>{escape(title)}</h2>"

    def chart(self, key: str, fig: go.Figure | Mapping[str, Any] | None,
              height: int | None = None) -> str:
        if fig is None:
            return ""
        # a plain dict (reports/watch_sections.py) is validated here
        built = fig if isinstance(fig, go.Figure) else go.Figure(dict(fig))
        if height is not None and built.layout.height is None:
            built.update_layout(height=height)
        self.figures[key] = built
        return f"<div class='card'><div class='chart' id='fig-{key}' data-figure='{key}'></div>" \
               "</div>"


def _render(view: ReportView) -> str:
    page = _Page()
    body = _overview(view)
    for section in (_watch_section, _peak_section, _excess_section, _timeline_section,
                    _timing_section, _maxbatch_section, _change_section, _writes_section,
                    _provenance_section):
        body += section(view, page)
    return _document(view, body, page.figures)


def _overview(view: ReportView) -> list[str]:
    """The verdict, the alerts, the scenarios' tracebacks and tables."""
    body: list[str] = []
    alerts = alert_lines(view)
    bad = bool(alerts)
    body.append(f"<p class='verdict{' bad' if bad else ''}' id='verdict'>{_verdict_html(view)}</p>")
    if alerts:
        body.append("<ul class='alerts' id='alerts'>" + "".join(
            f"<li class='oom'>{escape(a)}</li>" for a in alerts) + "</ul>")
    for name, tb in view.tracebacks:
        body.append(f"<details class='traceback'><summary>{escape(name)}: the traceback</summary>"
                    f"<pre>{escape(tb)}</pre></details>")
    if view.scenarios:
        body.append(_table(view))
    head, rows = memory_table(view)
    if rows:
        body.append(
            "<details><summary>What a GPU adds: allocated, reserved (with the "
            "library workspaces), context and NVML peaks per GPU</summary>"
            "<div class='card scroll'><table id='gpu-overheads'><tr>"
            + "".join(f"<th>{escape(h)}</th>" for h in head)
            + "</tr>" + "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>"
                                for r in rows) + "</table></div></details>")

    return body


def _watch_section(view: ReportView, page: _Page) -> list[str]:
    """``dpprof watch -- CMD``'s section and its timeline (reports/watch_sections.py)."""
    body: list[str] = []
    if view.watch is not None:  # `dpprof watch -- CMD` (reports/watch_sections.py)

        body.append(watch_sections.html_section(view, view.watch))
        wfig = watch_sections.timeline_figure(view.watch)
        if wfig is not None:
            body.append(page.h2("Memory over the run"))
            body.append(page.chart("timeline-watch", wfig, 360))

    return body


def _peak_section(view: ReportView, page: _Page) -> list[str]:
    body: list[str] = []
    peak = peak_figure(view)
    if peak is not None:
        body.append(page.h2("Peak memory per GPU"))
        body.append("<p class='lead'>Peak allocated memory of each GPU during the measured "
                    "step, per scenario; hatched above it, where known, the reserved memory and "
                    "CUDA context the out-of-memory check adds (labels: the top, in "
                    f"{chart_unit_name()}). A dark outline marks a GPU that runs out of "
                    "memory.</p>")
        body.append(page.chart("peaks", peak, 400))

    return body


def _excess_section(view: ReportView, page: _Page) -> list[str]:
    """Why cuda:0 is heavier: a waterfall per unbalanced scenario, the numbers, and what
    every GPU holds at its peak."""
    body: list[str] = []
    exs = view.attributions
    if exs:
        gpu = escape(view.primary)
        body.append(page.h2(f"Why {view.primary} is heavier"))
        body.append(f"<p class='lead'>From the median other GPU to {gpu}, cause by cause: "
                    f"dark steps are memory that {gpu} holds and the others do not, pale "
                    "steps memory it holds less of.</p>")
        x_max = view.attribution_top_bytes
        shown = [ex for ex in exs if not ex.balanced]
        cells = []
        for k, ex in enumerate(shown):
            cells.append(
                f"<div class='wf'><div class='wf-title'>{escape(ex.scenario)}: {gpu} "
                f"{escape(fmt_bytes(ex.excess_bytes, signed=True))}</div>"
                + page.chart(f"excess-{k}", waterfall_figure(ex, x_max)) + "</div>")
        body.append("<div class='grid'>" + "".join(cells) + "</div>")
        flat = [ex for ex in exs if ex.balanced]
        if flat:
            body.append(f"<p class='lead'>Balanced ({gpu} within 1 % of the others): "
                        + escape(", ".join(
                            f"{ex.scenario} ({fmt_bytes(ex.excess_bytes, signed=True)})"
                            for ex in flat)) + ".</p>")
        body.append(_excess_table(view))
        bd = breakdown_figure(view)
        if bd is not None:
            body.append("<details open><summary>What every GPU holds at its peak</summary>"
                        + page.chart("breakdown", bd, 400) + "</details>")

    return body


def _timeline_section(view: ReportView, page: _Page) -> list[str]:
    body: list[str] = []
    timelines: list[str] = []
    for s in view.drawn:
        if s.timeline is not None:
            fig, note = step_timeline_figure(view, s.timeline), s.timeline.note
            title = f"<h3>{escape(s.name)}</h3>"
            timelines.append(title + (f"<p class='lead'>{escape(note)}</p>" if note else "")
                             + page.chart(f"timeline-{len(timelines)}", fig, 330))
    if timelines:
        body.append(page.h2("Memory over the step"))
        what = ("NVML's used memory (solid: includes the CUDA context and the allocator's "
                "reserve) and allocated memory (dotted) of every GPU, sampled" if view.real
                else "Live allocated bytes of every emulated GPU, event by event")
        body.append(f"<p class='lead'>{escape(what)} through the measured step; the bands "
                    "mark its phases.</p>")
        body.extend(timelines)

    return body


def _timing_section(view: ReportView, page: _Page) -> list[str]:
    body: list[str] = []
    tfig, ttable = _timing(view)
    if ttable:
        body.append(page.h2("Step time and throughput"))
        body.append(f"<div class='card scroll'>{ttable}</div>")
        body.append(page.chart("timing", tfig))
    predicted = _predicted_table(view)
    if predicted:
        body.append(page.h2("Step time, predicted"))
        lead = ("Predicted without a GPU: each op's FLOPs and bytes on the target GPU's peak "
                "rates, its launch and host cost, the interconnect, each GPU waiting for the "
                "others. Each bar is one GPU's step: computing, communicating, waiting.")
        if view.speed_sentence:
            lead = f"{view.speed_sentence} {lead}"
        body.append(f"<p class='lead'>{escape(lead)}</p>")
        body.append(page.chart("busy", busy_figure(view)))
        body.append(f"<details><summary>The numbers</summary><div class='card scroll'>"
                    f"{predicted}</div></details>")
    return body


def _predicted_table(view: ReportView) -> str:
    rows = [t for t in view.timings if t.predicted_step_s is not None]
    if not rows:
        return ""
    table = ["<table><tr><th>scenario</th><th>step (predicted)</th><th>samples/s</th>"
             "<th>× one GPU</th><th>measured</th><th>busy per GPU</th></tr>"]
    for t in rows:
        step = t.predicted_step_s or 0.0
        busy = ", ".join(f"{b.label} {percent(b.busy_s / step)}"
                         for b in t.busy) if step else "-"
        measured = step_time(t.measured_step_s) if t.measured_step_s is not None else "-"
        table.append(f"<tr><td>{escape(t.scenario)}</td><td>{step_time(step)}</td>"
                     f"<td>{samples(t.predicted_samples_per_s)}</td>"
                     f"<td>{times(t.speedup_predicted)}</td><td>{measured}</td>"
                     f"<td>{escape(busy)}</td></tr>")
    table.append("</table>")
    return "".join(table)


def _maxbatch_section(view: ReportView, page: _Page) -> list[str]:
    body: list[str] = []
    mfig, mtable = _max_batch(view)
    if mtable:
        body.append(page.h2("Largest batch that fits"))
        body.append(page.chart("maxbatch", mfig))
        if view.maxbatch is not None:  # what each needs, the next step, the limiting GPU
            mtable = answer_sections.html_sections(view, parts=("maxbatch",))
        body.append(f"<details open><summary>The numbers</summary>{mtable}</details>")

    return body


def _change_section(view: ReportView, page: _Page) -> list[str]:
    body: list[str] = []
    body.append(page.h2("What to change"))
    body.append(_fixes_html(view))
    body.append(answer_sections.html_sections(view, parts=("equivalence", "checks")))

    return body


def _writes_section(view: ReportView, page: _Page) -> list[str]:
    """``dpprof run``: what the script wrote into its runs' private overlays, and the
    seal's check (loud where a file of the user's changed)."""
    w = view.writes
    if w is None:
        return []
    body = [page.h2("What the script wrote"),
            f"<p class='{'verdict bad' if w.changed else 'lead'}' id='writes-summary'>"
            f"{escape(w.summary)}</p>"]
    if w.changed:
        body.append("<ul class='alerts'>" + "".join(
            f"<li class='oom'>{escape(c)}</li>" for c in w.changed) + "</ul>")
    if w.rows:
        body.append(
            "<div class='card scroll'><table id='writes'><tr><th>run</th><th>path</th>"
            "<th>size</th><th></th></tr>" + "".join(
                f"<tr><td>{escape(r.run)}</td><td>{escape(r.path)}"
                f"{'/' if r.kind == 'folder' else ''}</td><td>"
                f"{escape(fmt_bytes(r.size_bytes) if r.kind in ('file', 'link') else r.kind)}"
                f"</td><td>{escape(r.note)}</td></tr>" for r in w.rows) + "</table></div>")
    if w.more:
        body.append(f"<p class='lead'>... and {w.more} more (every one in the JSON "
                    "report)</p>")
    return body


def _provenance_section(view: ReportView, page: _Page) -> list[str]:
    """How the numbers were obtained: the provenance, the assumptions, the notes, the
    configuration and the environment."""
    body: list[str] = []
    body.append(page.h2("How these numbers were obtained"))
    body.append(f"<p class='prov'>{escape(provenance(view))}</p>")
    body.append("<ul>" + "".join(f"<li>{escape(a)}</li>" for a in view.assumptions) + "</ul>")
    if view.notes:
        body.append("<h3>Notes</h3><ul>"
                    + "".join(f"<li>{escape(x)}</li>" for x in view.notes) + "</ul>")
    # closed: long, and read when something looks wrong (printed, they took two pages)
    body.append("<details id='configuration'><summary>Configuration</summary>"
                f"<div class='card scroll'>{_kv_table(view.config)}</div></details>")
    body.append("<details id='environment'><summary>Environment</summary>"
                f"<div class='card scroll'>{_kv_table(view.environment)}</div></details>")

    return body


def _document(view: ReportView, body: list[str],
              figures: Mapping[str, go.Figure | Mapping[str, Any]]) -> str:
    """The whole page: the title and the line under it, then ``body``."""
    title = f"dpprof: {view.workload}, {view.batch_label}, {view.gpus} GPUs"
    kind = view.kind
    backend = "" if view.backend == kind else f" ({view.backend} backend)"
    sub = (f"{kind}{backend} · {fmt_bytes(view.gpu_memory_bytes)} per GPU · "
           f"{view.dtype} · seed {view.seed} · dpprof {view.dpprof_version} · {view.created}")
    return page_document(title, sub, "".join(body), view.dpprof_version, figures)


class HtmlRenderer(Renderer):
    """A self-contained page with interactive charts."""

    name = "html"
    suffix = '.html'
    description = "A self-contained page with interactive charts."

    def render_view(self, view: ReportView) -> str:
        return render_view(view)
