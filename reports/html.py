"""HTML: one self-contained page that opens offline in any browser and reads top to bottom.

The page: the verdict (out-of-memory results in red), peak memory per GPU per scenario
with the capacity line, cuda:0's excess by cause as a waterfall per scenario, what each
GPU holds at its peak, memory over the step per device with the phases marked, step time
and throughput, the largest batch, the code to change, and how the numbers were obtained
(assumptions, configuration, environment).

Charts are drawn by plotly.js's *basic* partial bundle (bar, scatter and pie traces:
everything this page needs; the waterfall is bars with a ``base``), vendored next to
this module from the npm package ``plotly.js-basic-dist-min`` (MIT; see
``scripts/update_plotly_js.sh``) and inlined as a plain ``<script>``. At 1.2 MB instead of
the full bundle's 4.8 MB, it keeps a report near 1.3 MB, parses in a fraction of the time,
and needs nothing a browser might lack (no decompression, no module loading, no network).

Every string that comes from the user or the environment is escaped: HTML text through
:func:`html.escape`; chart data is JSON with ``<``, ``>`` and ``&`` escaped inside a
``type="application/json"`` script, and the labels plotly draws have ``<``, ``>`` and
``&`` turned into entities (plotly reads a few HTML tags in labels). A hostile workload
name renders as text.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping
from contextvars import ContextVar
from functools import cache
from importlib import resources
from typing import Any

from dpprof.reports import answers
from dpprof.reports.base import Renderer
from dpprof.reports.common import (
    EXTRA_COLOURS,
    SCENARIO_COLOURS,
    alert_lines,
    capacity_on_scale,
    fix_why,
    memory_table,
    provenance,
    spread,
    step_time,
    throughput,
)
from dpprof.reports.view import (
    AttributionView,
    ReportView,
    TimelineView,
    build_view,
)
from dpprof.result import RunResult, json_safe
from dpprof.units import fmt_bytes

GiB = 2**30
PLOTLY_JS = "plotly-basic.min.js"

DEVICE_COLOURS = (
    "#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c",
    "#ccb974", "#64b5cd",
)
CATEGORY_COLOURS = {
    "parameters": "#4c78a8",
    "gradients": "#72b7b2",
    "optimizer_state": "#54a24b",
    "inputs": "#eeca3b",
    "activations": "#9d755d",
    "outputs": "#e45756",
    "loss": "#b279a2",
    "communication": "#ff9da6",
    "other": "#bab0ac",
}
PHASE_COLOURS = {
    "inputs": "#f4f4f4", "forward": "#edf2fa", "loss": "#fbe9e9", "backward": "#f2edf8",
    "optimizer": "#eaf5ec", "zero_grad": "#f4f4f4",
}
UP, DOWN, TOTAL = "#c44e52", "#55a868", "#5b6372"

_CSS = """
*{box-sizing:border-box}
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d2330;
background:#f4f5f7;line-height:1.45}
main{max-width:1120px;margin:0 auto;padding:24px 28px 60px}
h1{font-size:23px;margin:0 0 2px}
h2{font-size:18px;margin:34px 0 6px}
h2 .n{color:#8a93a3;font-weight:400;margin-right:6px}
.sub{color:#5b6372;font-size:14px}
.lead{color:#5b6372;font-size:14px;margin:0 0 10px;max-width:900px}
.verdict{font-size:19px;background:#fff;border-left:6px solid #3b6fd8;padding:16px 20px;
margin:18px 0 8px;border-radius:6px;box-shadow:0 1px 2px rgba(0,0,0,.06)}
.verdict.bad{border-left-color:#c62828}
.oom{color:#c62828;font-weight:600}
.alerts{margin:8px 0;padding:10px 16px 10px 34px;background:#fdecea;border-radius:6px;
font-size:14px}
.card{background:#fff;border-radius:6px;padding:10px 14px;margin:8px 0;
box-shadow:0 1px 2px rgba(0,0,0,.06)}
table{border-collapse:collapse;font-size:14px;font-variant-numeric:tabular-nums}
td,th{padding:5px 12px;border-bottom:1px solid #e6e8eb;text-align:right;vertical-align:top}
th{font-weight:600;color:#3c4452}
td:first-child,th:first-child{text-align:left}
td.l{text-align:left}
.dim{color:#8a93a3}
.chart{min-height:200px}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(480px,1fr));gap:0 14px}
.wf-title{font-weight:600;font-size:14px;margin:8px 0 -4px}
.prov{font-weight:600}
ul{font-size:14px;margin:6px 0}
code,pre{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:13px}
pre{background:#f7f8fa;border:1px solid #e6e8eb;padding:12px 14px;border-radius:6px;
overflow:auto;margin:6px 0 14px}
details summary{cursor:pointer;color:#3b6fd8;font-size:14px;margin:6px 0}
.kv td:first-child{color:#5b6372;white-space:nowrap}
.kv td{text-align:left}
.fix h3{font-size:15px;margin:10px 0 2px}
.fix p{margin:2px 0 6px;font-size:14px}
footer{margin-top:40px;color:#8a93a3;font-size:12px}
"""


# Nothing leaves the page: no fetch, no image, no font from anywhere but the file itself.
_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "img-src data:; font-src data:"
)


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _pt(x: object) -> str:
    """A label for plotly to draw: its own mini-HTML (<b>, <a href>...) disarmed."""
    return str(x).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _json(x: Any) -> str:
    """JSON safe inside a <script> element."""
    return (
        json.dumps(json_safe(x), separators=(",", ":"), allow_nan=False)
        .replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


@cache
def plotly_js() -> str:
    """The vendored plotly.js basic bundle (inlined into every page)."""
    return (resources.files("dpprof.reports") / PLOTLY_JS).read_text(encoding="utf-8")


# The unit of every chart of one page: GiB, MiB or KiB, whichever suits its largest value.
_UNIT: ContextVar[tuple[str, int]] = ContextVar("dpprof_html_unit", default=("GiB", GiB))


def unit_for(top_bytes: float) -> tuple[str, int]:
    """The unit for charts whose largest value is ``top_bytes``."""
    for name, size in (("GiB", GiB), ("MiB", 2**20)):
        if top_bytes >= 2 * size:
            return name, size
    return "KiB", 2**10


def _sc(n: float) -> float:
    """Bytes in the page's chart unit."""
    return round(n / _UNIT.get()[1], 4)


def _short(v: float) -> str:
    return f"{v:.1f}" if v < 100 else f"{v:.0f}"


def _un() -> str:
    return _UNIT.get()[0]


def _colour(name: str, i: int) -> str:
    return SCENARIO_COLOURS.get(name, EXTRA_COLOURS[i % len(EXTRA_COLOURS)])


def _base_layout(y_title: str, **extra: Any) -> dict[str, Any]:
    layout: dict[str, Any] = {
        "yaxis": {"title": {"text": y_title}, "gridcolor": "#eceef1", "zeroline": False},
        "xaxis": {"automargin": True},
        "margin": {"t": 36, "r": 16, "b": 40, "l": 64},
        "legend": {"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0},
        "font": {"family": "system-ui, -apple-system, Segoe UI, Roboto, sans-serif",
                 "size": 13, "color": "#1d2330"},
        "paper_bgcolor": "#ffffff",
        "plot_bgcolor": "#ffffff",
        "hoverlabel": {"namelength": -1},
    }
    layout.update(extra)
    return layout


def _capacity(
    layout: dict[str, Any], view: ReportView, top_bytes: int, off_scale_note: bool = True
) -> None:
    """Draw the capacity line when it is on the scale; otherwise say where it is."""
    cap = view.gpu_memory_bytes
    if cap <= 0:
        return
    if capacity_on_scale(cap, top_bytes):
        layout["shapes"] = [*layout.get("shapes", []), {
            "type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": _sc(cap), "y1": _sc(cap),
            "line": {"color": "#c62828", "dash": "dash", "width": 1.5},
        }]
        layout.setdefault("annotations", []).append({
            "xref": "paper", "x": 0, "y": _sc(cap), "xanchor": "left", "yanchor": "bottom",
            "showarrow": False, "text": f"capacity {fmt_bytes(cap)} per GPU",
            "font": {"color": "#c62828", "size": 12},
        })
    elif off_scale_note:
        layout.setdefault("annotations", []).append({
            "xref": "paper", "yref": "paper", "x": 1, "y": 1, "xanchor": "right",
            "yanchor": "bottom", "showarrow": False,
            "text": f"capacity {fmt_bytes(cap)} per GPU (above the scale)",
            "font": {"color": "#c62828", "size": 12},
        })


# ---- 2. peak memory per device per scenario --------------------------------------------


def _peak_figure(view: ReportView) -> dict[str, Any] | None:
    data = []
    for i, s in enumerate(view.drawn):
        devs = s.devices
        over = [d.out_of_memory for d in devs]
        data.append({
            "type": "bar",
            "name": _pt(s.name),
            "x": [_pt(d.label) for d in devs],
            "y": [_sc(d.peak_allocated_bytes) for d in devs],
            "customdata": [fmt_bytes(d.peak_allocated_bytes) + (" · out of memory" if o else "")
                           for d, o in zip(devs, over, strict=True)],
            "text": [("OOM " if o else "") + _short(_sc(d.peak_allocated_bytes))
                     for d, o in zip(devs, over, strict=True)],
            "textposition": "outside", "textangle": 0,
            "textfont": {"color": ["#c62828" if o else "#5b6372" for o in over], "size": 11},
            "cliponaxis": False,
            "marker": {
                "color": _colour(s.name, i),
                "line": {"color": ["#7f0000" if o else "rgba(0,0,0,0)" for o in over],
                         "width": [3 if o else 0 for o in over]},
            },
            "hovertemplate": "%{x}: %{customdata}<extra>%{fullData.name}</extra>",
        })
    if not data:
        return None
    layout = _base_layout(f"peak allocated ({_un()})", barmode="group", bargap=0.25)
    _capacity(layout, view, view.top_allocated_bytes)
    return {"data": data, "layout": layout}


# ---- 3. cuda:0's excess by cause --------------------------------------------------------


def _waterfall_figure(ex: AttributionView, x_max: int) -> dict[str, Any]:
    """From the median other GPU to cuda:0, cause by cause (horizontal bars with a base)."""
    names, xs, bases, colours, texts = ["median other GPU"], [ex.reference_bytes], [0], [TOTAL], [
        fmt_bytes(ex.reference_bytes)]
    level = ex.reference_bytes
    for step in ex.steps:
        names.append(step.label)
        xs.append(step.bytes)
        bases.append(level)
        colours.append(UP if step.bytes > 0 else DOWN)
        texts.append(fmt_bytes(step.bytes, signed=True))
        level += step.bytes
    names.append("cuda:0")
    xs.append(ex.primary_bytes)
    bases.append(0)
    colours.append("#1d2330")
    texts.append(f"{fmt_bytes(ex.primary_bytes)} ({fmt_bytes(ex.excess_bytes, signed=True)})")
    data = [{
        "type": "bar", "orientation": "h", "y": [_pt(n) for n in names],
        "x": [_sc(x) for x in xs], "base": [_sc(b) for b in bases],
        "marker": {"color": colours}, "text": [_pt(t) for t in texts],
        "textposition": ["auto" if k in (0, len(names) - 1) else "outside"
                         for k in range(len(names))],
        "insidetextanchor": "end", "cliponaxis": False, "showlegend": False,
        "hovertemplate": "%{y}: %{text}<extra></extra>", "name": _pt(ex.scenario),
    }]
    layout = _base_layout("")
    layout["yaxis"] = {"autorange": "reversed", "automargin": True}
    layout["xaxis"] = {"title": {"text": _un()}, "gridcolor": "#eceef1",
                       "range": [0, _sc(x_max) * 1.45]}
    layout["height"] = 90 + 34 * len(names)
    layout["margin"] = {"t": 10, "r": 20, "b": 44, "l": 10}
    layout["bargap"] = 0.3
    return {"data": data, "layout": layout}


def _excess_table(view: ReportView) -> str:
    atts = view.attributions
    if not atts:
        return ""
    head = "".join(f"<th>{_e(a.scenario)}</th>" for a in atts)
    rows = []
    for cause, label in view.cause_rows:
        cells = "".join(
            f"<td>{'' if (v := a.bytes_of(cause)) is None else _e(fmt_bytes(v, signed=True))}"
            "</td>" for a in atts
        )
        rows.append(f"<tr><td>{_e(label)}</td>{cells}</tr>")
    total = "".join(f"<th>{_e(fmt_bytes(a.excess_bytes, signed=True))}</th>" for a in atts)
    return (
        "<details><summary>The numbers: cuda:0 minus the median other GPU, by cause"
        f"</summary><table><tr><th>cause</th>{head}</tr>{''.join(rows)}"
        f"<tr><th>cuda:0's excess</th>{total}</tr></table></details>"
    )


def _breakdown_figure(view: ReportView) -> dict[str, Any] | None:
    """Stacked bars: for each scenario and device, bytes per category at the peak."""
    pairs = [(s, d) for s in view.drawn for d in s.devices]
    if not pairs:
        return None
    xs = [[_pt(s.name) for s, _ in pairs], [_pt(d.label) for _, d in pairs]]
    data = []
    for cat, label in view.breakdown_categories:
        vals = [d.breakdown_bytes.get(cat, 0) for _, d in pairs]
        data.append({
            "type": "bar", "name": _pt(label), "x": xs,
            "y": [_sc(v) for v in vals], "customdata": [fmt_bytes(v) for v in vals],
            "marker": {"color": CATEGORY_COLOURS.get(cat, "#999")},
            "hovertemplate": "%{x[1]}: %{customdata}<extra>%{fullData.name}</extra>",
        })
    if not data:
        return None
    layout = _base_layout(f"{_un()} at the device's peak", barmode="stack", bargap=0.2)
    layout["xaxis"] = {"type": "multicategory", "automargin": True}
    layout["margin"]["b"] = 70
    return {"data": data, "layout": layout}


# ---- 4. timelines -------------------------------------------------------------------------


def _timeline_figure(view: ReportView, tl: TimelineView) -> dict[str, Any]:
    nvml = tl.nvml
    data: list[dict[str, Any]] = []
    for i, series in enumerate(tl.series):
        points = series.points
        colour = DEVICE_COLOURS[i % len(DEVICE_COLOURS)]
        label = _pt(series.label)
        if nvml:
            data.append({
                "type": "scatter", "mode": "lines", "name": label, "legendgroup": label,
                "x": [p.t for p in points if p.used_bytes is not None],
                "y": [_sc(p.used_bytes) for p in points if p.used_bytes is not None],
                "line": {"color": colour, "width": 2},
                "customdata": [_pt(p.phase) for p in points if p.used_bytes is not None],
                "hovertemplate": "%{y:.2f} " + _un()
                + " · %{customdata}<extra>%{fullData.name}</extra>",
            })
        if not nvml or any(p.allocated_bytes for p in points):
            data.append({
                "type": "scatter", "mode": "lines",
                "name": f"{label} allocated" if nvml else label, "legendgroup": label,
                "showlegend": not nvml,
                "x": [p.t for p in points], "y": [_sc(p.allocated_bytes) for p in points],
                "line": {"color": colour, "width": 1.5 if nvml else 2,
                         "dash": "dot" if nvml else "solid"},
                "customdata": [_pt(p.phase) for p in points],
                "hovertemplate": "%{y:.2f} " + _un()
                + " · %{customdata}<extra>%{fullData.name}</extra>",
            })
    ref = tl.series[0].points
    shapes: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    width = (ref[-1].t - ref[0].t) or 1.0
    for x0, x1, name in tl.phase_spans:
        shapes.append({
            "type": "rect", "xref": "x", "yref": "paper", "x0": x0, "x1": x1, "y0": 0, "y1": 1,
            "fillcolor": PHASE_COLOURS.get(name, "#f4f5f7"), "line": {"width": 0},
            "layer": "below",
        })
        if (x1 - x0) / width > 0.04:
            annotations.append({
                "x": (x0 + x1) / 2, "y": 1, "xref": "x", "yref": "paper", "yanchor": "bottom",
                "showarrow": False, "text": _pt(name.replace("_", " ")),
                "font": {"size": 11, "color": "#5b6372"},
            })
    annotations.append({
        "x": tl.peak_t, "y": _sc(tl.peak_bytes), "xref": "x", "yref": "y", "ax": 40, "ay": -24,
        "showarrow": True, "arrowhead": 0, "arrowcolor": "#5b6372",
        "text": _pt(f"{tl.peak_label} peak {fmt_bytes(tl.peak_bytes)}"
                    + (f" ({tl.peak_phase})" if tl.peak_phase else "")),
        "font": {"size": 12}, "bgcolor": "rgba(255,255,255,.85)",
    })
    unit = "seconds since the step began" if view.real else (
        "allocation events of the measured step")
    layout = _base_layout(_un(), shapes=shapes, annotations=annotations)
    layout["xaxis"] = {"title": {"text": unit}, "showgrid": False, "zeroline": False}
    layout["yaxis"]["rangemode"] = "tozero"
    layout["legend"] = {"orientation": "v", "y": 1, "x": 1.01}
    layout["margin"]["b"] = 50
    _capacity(layout, view, tl.top_bytes, off_scale_note=False)
    return {"data": data, "layout": layout}


# ---- 5, 6. step time and throughput, largest batch --------------------------------------


def _hbar(names: list[str], values: list[float], texts: list[str], x_title: str,
          colours: list[str]) -> dict[str, Any]:
    data = [{
        "type": "bar", "orientation": "h", "y": [_pt(n) for n in names], "x": values,
        "text": [_pt(t) for t in texts], "textposition": "auto", "marker": {"color": colours},
        "hovertemplate": "%{y}: %{text}<extra></extra>", "showlegend": False,
    }]
    layout = _base_layout("")
    layout["xaxis"] = {"title": {"text": x_title}, "gridcolor": "#eceef1", "rangemode": "tozero"}
    layout["yaxis"] = {"autorange": "reversed", "automargin": True}
    layout["height"] = 70 + 44 * len(names)
    layout["margin"] = {"t": 10, "r": 16, "b": 44, "l": 10}
    return {"data": data, "layout": layout}


def _timing(view: ReportView) -> tuple[dict[str, Any] | None, str]:
    rows = view.timed
    if not rows:
        return None, ""
    table = ["<table><tr><th>scenario</th><th>step time (median)</th><th>spread (max-min)"
             "</th><th>throughput</th></tr>"]
    for s in rows:
        table.append(f"<tr><td>{_e(s.name)}</td><td>{step_time(s.step_time_s)}</td>"
                     f"<td>{_e(spread(s.step_time_spread_s))}</td>"
                     f"<td>{_e(throughput(s.throughput_samples_per_s))}</td></tr>")
    table.append("</table>")
    thr_rows = [s for s in rows if s.throughput_samples_per_s]
    fig = None
    if thr_rows:
        fig = _hbar(
            [s.name for s in thr_rows], [s.throughput_samples_per_s or 0 for s in thr_rows],
            [f"{s.throughput_samples_per_s:,.0f}/s · {(s.step_time_s or 0) * 1e3:.0f} ms"
             for s in thr_rows],
            "throughput (samples per second)",
            [_colour(s.name, i) for i, s in enumerate(thr_rows)],
        )
    return fig, "".join(table)


def _max_batch(view: ReportView) -> tuple[dict[str, Any] | None, str]:
    rows = view.max_batches
    if not rows:
        return None, ""
    fig = _hbar(
        [name for name, _ in rows], [float(b) for _, b in rows], [f"{b:,}" for _, b in rows],
        f"largest global batch that fits in {fmt_bytes(view.gpu_memory_bytes)} per GPU",
        [_colour(name, i) for i, (name, _) in enumerate(rows)],
    )
    table = "".join(f"<tr><td>{_e(name)}</td><td>{b:,}</td></tr>" for name, b in rows)
    return fig, f"<table><tr><th>scenario</th><th>largest batch</th></tr>{table}</table>"


# ---- tables and text ----------------------------------------------------------------------


def _table(view: ReportView) -> str:
    head = "".join(f"<th>{_e(lb)}</th>" for lb in view.columns)
    rows = []
    for s in view.scenarios:
        cells = []
        for k in range(len(view.columns)):
            d = s.cells[k] if k < len(s.cells) else None
            if d is None:
                cells.append("<td class='dim'>-</td>")
            else:
                cls = " class='oom'" if d.out_of_memory else ""
                cells.append(f"<td{cls}>{_e(fmt_bytes(d.peak_allocated_bytes))}</td>")
        exc = "-" if s.excess_bytes is None else _e(fmt_bytes(s.excess_bytes, signed=True))
        imb = "-" if s.imbalance is None else f"{s.imbalance:.2f}"
        status = "ok" if s.status_label == "ok" else \
            f"<span class='oom'>{_e(s.status_label)}</span>"
        rows.append(
            f"<tr><td>{_e(s.name)}</td>{''.join(cells)}<td>{exc}</td><td>{imb}</td>"
            f"<td>{status}</td></tr>"
        )
    return (
        f"<div class='card'><table><tr><th>scenario</th>{head}<th>cuda:0 excess</th>"
        f"<th>max/mean</th><th>status</th></tr>{''.join(rows)}</table></div>"
    )


def _value(v: Any) -> str:
    """A configuration or environment value: nested lists and dicts as small tables."""
    if isinstance(v, dict):
        if not v:
            return "<span class='dim'>(empty)</span>"
        return _kv_table(v)
    if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
        keys = list(dict.fromkeys(k for x in v for k in x))
        head = "".join(f"<th>{_e(k)}</th>" for k in keys)
        body = "".join(
            "<tr>" + "".join(f"<td class='l'>{_e(x.get(k, ''))}</td>" for k in keys) + "</tr>"
            for x in v
        )
        return f"<table><tr>{head}</tr>{body}</table>"
    if isinstance(v, list):
        return _e(", ".join(str(x) for x in v))
    if v is None:
        return "<span class='dim'>n/a</span>"
    return _e(v)


def _kv_table(items: Mapping[str, Any]) -> str:
    rows = []
    for k, v in items.items():
        shown = _value(v)
        if isinstance(v, int) and not isinstance(v, bool) and str(k).endswith("_bytes"):
            shown = f"{_e(fmt_bytes(v))} <span class='dim'>({v:,} B)</span>"
        rows.append(f"<tr><td>{_e(k)}</td><td>{shown}</td></tr>")
    return f"<table class='kv'>{''.join(rows)}</table>"


def _verdict_html(view: ReportView) -> str:
    """The verdict, with its out-of-memory clause in red."""
    parts = view.headline.verdict_parts
    if parts is not None:
        before, clause, after = parts
        return f"{_e(before)}<span class='oom'>{_e(clause)}</span>{_e(after)}"
    return _e(view.headline.verdict)


def _fixes_html(view: ReportView) -> str:
    notes = "".join(f"<p class='lead'>{_e(n)}</p>" for n in view.advice_notes)
    if not view.recommended:
        return (f"<p class='lead'>{_e(view.nothing_to_change)}</p>" + notes
                + answers.html_fix_table(view))
    parts = []
    for i, f in enumerate(view.recommended):
        parts.append(
            f"<div class='fix card'><h3>{'Recommended: ' if i == 0 else ''}{_e(f.title)}</h3>"
            f"<p>{_e(fix_why(f))}</p><pre><code>{_e(f.code)}</code></pre></div>"
        )
    return "".join(parts) + notes + answers.html_fix_table(view)


def render(run: RunResult) -> str:
    """The page for ``run``."""
    return render_view(build_view(run))


def render_view(view: ReportView) -> str:
    """The page for a result's view."""
    token = _UNIT.set(unit_for(view.top_bytes))
    try:
        return _render(view)
    finally:
        _UNIT.reset(token)


def _render(view: ReportView) -> str:
    n = 0

    def h2(title: str) -> str:
        nonlocal n
        n += 1
        return f"<h2><span class='n'>{n}</span>{_e(title)}</h2>"

    figures: dict[str, dict[str, Any]] = {}

    def chart(key: str, fig: dict[str, Any] | None, height: int | None = None) -> str:
        if fig is None:
            return ""
        if height is not None:
            fig["layout"].setdefault("height", height)
        figures[key] = fig
        return f"<div class='card'><div class='chart' id='fig-{key}' data-figure='{key}'></div>" \
               "</div>"

    body: list[str] = []
    alerts = alert_lines(view)
    bad = bool(alerts)
    body.append(f"<p class='verdict{' bad' if bad else ''}' id='verdict'>{_verdict_html(view)}</p>")
    if alerts:
        body.append("<ul class='alerts' id='alerts'>" + "".join(
            f"<li class='oom'>{_e(a)}</li>" for a in alerts) + "</ul>")
    for name, tb in view.tracebacks:
        body.append(f"<details class='traceback'><summary>{_e(name)}: the traceback</summary>"
                    f"<pre>{_e(tb)}</pre></details>")
    if view.scenarios:
        body.append(_table(view))
    head, rows = memory_table(view)
    if rows:
        body.append(
            "<details><summary>What a GPU adds: allocated, reserved (with the "
            "library workspaces), context and NVML peaks per GPU</summary>"
            "<div class='card'><table id='gpu-overheads'><tr>"
            + "".join(f"<th>{_e(h)}</th>" for h in head)
            + "</tr>" + "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>"
                                for r in rows) + "</table></div></details>")

    if view.watch is not None:  # `dpprof watch -- CMD` (reports/watch.py)
        from dpprof.reports import watch as watch_report

        body.append(watch_report.html_section(view, view.watch))
        wfig = watch_report.timeline_figure(view.watch)
        if wfig is not None:
            body.append(h2("Memory over the run"))
            body.append(chart("timeline-watch", wfig, 360))

    peak = _peak_figure(view)
    if peak is not None:
        body.append(h2("Peak memory per GPU"))
        body.append("<p class='lead'>Peak allocated memory of each GPU during the measured "
                    f"step, per scenario (labels in {_un()}). A dark outline marks a GPU that ran "
                    "out of memory.</p>")
        body.append(chart("peaks", peak, 400))

    exs = view.attributions
    if exs:
        body.append(h2("Why cuda:0 is heavier"))
        body.append("<p class='lead'>From the median other GPU to cuda:0, cause by cause: "
                    "red steps are memory that cuda:0 holds and the others do not, green "
                    "steps memory it holds less of.</p>")
        x_max = view.attribution_top_bytes
        shown = [ex for ex in exs if not ex.balanced]
        cells = []
        for k, ex in enumerate(shown):
            cells.append(
                f"<div class='wf'><div class='wf-title'>{_e(ex.scenario)}: cuda:0 "
                f"{_e(fmt_bytes(ex.excess_bytes, signed=True))}</div>"
                + chart(f"excess-{k}", _waterfall_figure(ex, x_max)) + "</div>")
        body.append("<div class='grid'>" + "".join(cells) + "</div>")
        flat = [ex for ex in exs if ex.balanced]
        if flat:
            body.append("<p class='lead'>Balanced (cuda:0 within 1 % of the others): "
                        + _e(", ".join(f"{ex.scenario} ({fmt_bytes(ex.excess_bytes, signed=True)})"
                                       for ex in flat)) + ".</p>")
        body.append(_excess_table(view))
        bd = _breakdown_figure(view)
        if bd is not None:
            body.append("<details open><summary>What every GPU holds at its peak</summary>"
                        + chart("breakdown", bd, 400) + "</details>")

    timelines: list[str] = []
    for s in view.drawn:
        if s.timeline is not None:
            fig, note = _timeline_figure(view, s.timeline), s.timeline.note
            title = f"<h3 style='font-size:15px;margin:14px 0 0'>{_e(s.name)}</h3>"
            timelines.append(title + (f"<p class='lead'>{_e(note)}</p>" if note else "")
                             + chart(f"timeline-{len(timelines)}", fig, 330))
    if timelines:
        body.append(h2("Memory over the step"))
        what = ("NVML's used memory (solid: includes the CUDA context and the allocator's "
                "reserve) and allocated memory (dotted) of every GPU, sampled" if view.real
                else "Live allocated bytes of every emulated GPU, event by event")
        body.append(f"<p class='lead'>{_e(what)} through the measured step; the bands "
                    "mark its phases.</p>")
        body.extend(timelines)

    tfig, ttable = _timing(view)
    if ttable:
        body.append(h2("Step time and throughput"))
        body.append(f"<div class='card'>{ttable}</div>")
        body.append(chart("timing", tfig))

    mfig, mtable = _max_batch(view)
    if mtable:
        body.append(h2("Largest batch that fits"))
        body.append(chart("maxbatch", mfig))
        if view.maxbatch is not None:  # what each needs, the next step, the limiting GPU
            mtable = answers.html_sections(view, parts=("maxbatch",))
        body.append(f"<details open><summary>The numbers</summary>{mtable}</details>")

    body.append(h2("What to change"))
    body.append(_fixes_html(view))
    body.append(answers.html_sections(view, parts=("equivalence", "checks")))

    body.append(h2("How these numbers were obtained"))
    body.append(f"<p class='prov'>{_e(provenance(view))}</p>")
    body.append("<ul>" + "".join(f"<li>{_e(a)}</li>" for a in view.assumptions) + "</ul>")
    if view.notes:
        body.append("<h3 style='font-size:15px'>Notes</h3><ul>"
                    + "".join(f"<li>{_e(x)}</li>" for x in view.notes) + "</ul>")
    body.append("<details open><summary>Configuration</summary>"
                f"<div class='card'>{_kv_table(view.config)}</div></details>")
    body.append("<details open><summary>Environment</summary>"
                f"<div class='card'>{_kv_table(view.environment)}</div></details>")

    title = f"dpprof: {view.workload}, {view.batch_label}, {view.gpus} GPUs"
    kind = view.kind
    backend = "" if view.backend == kind else f" ({view.backend} backend)"
    sub = (f"{kind}{backend} · {fmt_bytes(view.gpu_memory_bytes)} per GPU · "
           f"{view.dtype} · seed {view.seed} · dpprof {view.dpprof_version} · {view.created}")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="{_CSP}">
<title>{_e(title)}</title><style>{_CSS}</style></head>
<body><main>
<h1 id="title">{_e(title)}</h1>
<div class="sub">{_e(sub)}</div>
{"".join(body)}
<footer>Generated by dpprof {_e(view.dpprof_version)}. Charts: plotly.js (MIT), inlined.
</footer>
</main>
{page_scripts(figures)}
</body></html>
"""


def page_scripts(figures: dict[str, Any]) -> str:
    """The end of every dpprof page: the figures as JSON, plotly.js, and the loop that draws
    each ``[data-figure]`` div, one chart per task, top to bottom."""
    return f"""<script id="dpprof-figures" type="application/json">{_json(figures)}</script>
<script>{plotly_js()}</script>
<script>
(function(){{
  var figs = JSON.parse(document.getElementById('dpprof-figures').textContent);
  var divs = Array.prototype.slice.call(document.querySelectorAll('[data-figure]'));
  // One chart per task, top to bottom: the first screen is drawn before the rest.
  (function next(){{
    var div = divs.shift();
    if (!div) return;
    var f = figs[div.getAttribute('data-figure')];
    Plotly.newPlot(div, f.data, f.layout, {{displaylogo:false, responsive:true}})
      .then(function(){{ setTimeout(next, 0); }});
  }})();
}})();
</script>"""


class HtmlRenderer(Renderer):
    """A self-contained page with interactive charts."""

    name = "html"
    suffix = '.html'
    description = "A self-contained page with interactive charts."

    def render_view(self, view: ReportView) -> str:
        return render_view(view)
