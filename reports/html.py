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

import html
import json
import textwrap
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from functools import cache
from importlib import resources
from typing import Any

import plotly.graph_objects as go  # type: ignore[import-untyped]

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
    SeriesView,
    TimelineView,
    build_view,
)
from dpprof.result import RunResult, json_safe
from dpprof.units import fmt_bytes

GiB = 2**30
PLOTLY_JS = "plotly-basic.min.js"

INK, MUTED, GRID, CLEAR = "#1d2330", "#5b6372", "#eceef1", "rgba(0,0,0,0)"
ON_INK = "#ffffff"  # text on an ink bar (the waterfall's cuda:0)
OOM = "#c62828"  # out of memory and the capacity line: the page's only red
OOM_OUTLINE = "#7f0000"
# Each GPU's line in the timelines: dark hues no scenario colour uses (those are light:
# orange, sky blue, green, grey), none of them red.
GPU_COLOURS = ("#3949ab", "#8e24aa", "#6d4c41", "#c2185b", "#455a64", "#827717")
OTHER_GPUS = "#9aa3b5"  # the GPUs past the palette, one legend entry
CATEGORY_COLOURS = {
    "parameters": "#4c78a8",
    "gradients": "#72b7b2",
    "optimizer_state": "#54a24b",
    "inputs": "#eeca3b",
    "activations": "#9d755d",
    "outputs": "#f58518",
    "loss": "#b279a2",
    "communication": "#c9a0dc",
    "other": "#bab0ac",
}
# translucent tints: they read on a white and on a dark card alike
PHASE_COLOURS = {
    "inputs": "rgba(128,128,128,0.08)", "forward": "rgba(59,111,216,0.08)",
    "loss": "rgba(230,159,0,0.10)", "backward": "rgba(142,36,170,0.07)",
    "optimizer": "rgba(0,158,115,0.09)", "zero_grad": "rgba(128,128,128,0.08)",
}
# the waterfall: from the reference (light slate) by steps up (slate) and down (pale) to cuda:0
REFERENCE, UP, DOWN, TOTAL = "#9aa3b5", "#5b6372", "#c3cad6", INK
# Dark mode: every colour of a figure that would vanish on a dark card, and its stand-in.
DARK_COLOURS = {
    INK: "#e4e7ee", ON_INK: "#1b1f27", MUTED: "#a6aebd", GRID: "#2c323d",
    OOM: "#ff6b6b", OOM_OUTLINE: "#ffb4b4", UP: "#a6aebd", DOWN: "#4a5261",
    REFERENCE: "#6b7385", "#3949ab": "#8c9eff", "#8e24aa": "#ce93d8", "#6d4c41": "#bcaaa4",
    "#c2185b": "#f48fb1", "#455a64": "#b0bec5", "#827717": "#d4e157",
}
MIN_PLOT_PX = 200  # a chart grows until its plot area is this tall (legends take the rest)
LABEL_WRAP_CHARS = 22  # the waterfall's causes wrap at this width (a phone's card)
PRINT_WIDTH_PX = 680  # A4 and Letter at 12 mm margins, less the card's padding

_CSS = """
:root{--bg:#f4f5f7;--card:#fff;--ink:#1d2330;--muted:#5b6372;--faint:#8a93a3;--line:#e6e8eb;
--accent:#3b6fd8;--bad:#c62828;--alert:#fdecea;--pre:#f7f8fa;--good:#2e7d32;
color-scheme:light dark}
@media screen and (prefers-color-scheme:dark){:root{--bg:#12151b;--card:#1b1f27;--ink:#e4e7ee;
--muted:#a6aebd;--faint:#7d8696;--line:#2c323d;--accent:#8fb0ff;--bad:#ff6b6b;--alert:#3a1d20;
--pre:#151920;--good:#66bb6a}}
*{box-sizing:border-box}
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:var(--ink);
background:var(--bg);line-height:1.45}
main{max-width:1120px;margin:0 auto;padding:24px 28px 60px}
h1{font-size:23px;margin:0 0 2px;overflow-wrap:anywhere}
h2{font-size:18px;margin:34px 0 6px}
h2 .n{color:var(--faint);font-weight:400;margin-right:6px}
h3{font-size:15px;margin:14px 0 2px;overflow-wrap:anywhere}
.sub{color:var(--muted);font-size:14px;overflow-wrap:anywhere}
.lead{color:var(--muted);font-size:14px;margin:0 0 10px;max-width:900px}
.verdict{font-size:19px;background:var(--card);border-left:6px solid var(--accent);
padding:16px 20px;margin:18px 0 8px;border-radius:6px;box-shadow:0 1px 2px rgba(0,0,0,.06)}
.verdict.bad{border-left-color:var(--bad)}
.oom{color:var(--bad);font-weight:600}
.good{color:var(--good)}
.alerts{margin:8px 0;padding:10px 16px 10px 34px;background:var(--alert);border-radius:6px;
font-size:14px}
.card{background:var(--card);border-radius:6px;padding:10px 14px;margin:8px 0;
box-shadow:0 1px 2px rgba(0,0,0,.06);min-width:0}
.scroll{overflow-x:auto}
table{border-collapse:collapse;font-size:14px;font-variant-numeric:tabular-nums}
td,th{padding:5px 12px;border-bottom:1px solid var(--line);text-align:right;vertical-align:top}
td{overflow-wrap:anywhere}
th{font-weight:600;color:var(--muted)}
td:first-child,th:first-child{text-align:left}
td.l{text-align:left}
.dim{color:var(--faint)}
.chart{min-height:200px}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(min(480px,100%),1fr));gap:0 14px}
.grid>*{min-width:0}
.wf-title{font-weight:600;font-size:14px;margin:8px 0 -4px}
.prov{font-weight:600}
ul{font-size:14px;margin:6px 0}
code,pre{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:13px}
pre{background:var(--pre);border:1px solid var(--line);padding:12px 14px;border-radius:6px;
overflow:auto;margin:6px 0 14px}
details summary{cursor:pointer;color:var(--accent);font-size:14px;margin:6px 0}
.kv td:first-child{color:var(--muted);white-space:nowrap}
.kv td{text-align:left}
.fix h3{font-size:15px;margin:10px 0 2px}
.fix p{margin:2px 0 6px;font-size:14px}
footer{margin-top:40px;color:var(--faint);font-size:12px}
@media (max-width:600px){
main{padding:14px 10px 40px}
h1{font-size:20px}
.verdict{font-size:16px;padding:12px 14px;border-left-width:4px}
.card{padding:6px 6px}
td,th{padding:4px 7px}
.kv td:first-child{white-space:normal}
}
@media print{
@page{margin:12mm}
:root{--bg:#fff;--card:#fff}
body{font-size:12px}
main{max-width:none;padding:0}
h2{margin:18px 0 4px;break-after:avoid}
h3,.wf-title,.lead,details summary{break-after:avoid}
.card,.verdict,.wf,tr,pre{break-inside:avoid;box-shadow:none}
.card{border:1px solid var(--line);padding:4px}
.grid{display:block}
.scroll{overflow:visible}
pre{white-space:pre-wrap}
details summary{color:var(--ink)}
details:not([open]) summary{display:none}
}
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
    """The layout every chart starts from (a dict: plotly validates it in the figure)."""
    layout: dict[str, Any] = {
        "template": "none",  # plotly.py's default template would restyle every chart
        "yaxis": {"title": {"text": y_title}, "gridcolor": GRID, "zeroline": False,
                  "automargin": True},
        "xaxis": {"automargin": True},
        "margin": {"t": 36, "r": 16, "b": 40, "l": 56},
        "legend": {"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0},
        "font": {"family": "system-ui, -apple-system, Segoe UI, Roboto, sans-serif",
                 "size": 13, "color": INK},
        "paper_bgcolor": CLEAR,
        "plot_bgcolor": CLEAR,
        "hoverlabel": {"namelength": -1},
    }
    layout.update(extra)
    return layout


def _figure(data: Sequence[go.Bar | go.Scatter], layout: dict[str, Any]) -> go.Figure:
    return go.Figure(data=list(data), layout=go.Layout(layout))


def _capacity(view: ReportView, top_bytes: int, off_scale_note: bool = True
              ) -> tuple[list[go.Scatter], list[dict[str, Any]]]:
    """The capacity: a dashed line across the plot when it is on the scale, named in the
    legend (where no bar label or annotation can cover its words); otherwise a legend entry
    that says it is above the scale. Returns (legend traces, shapes)."""
    cap = view.gpu_memory_bytes
    if cap <= 0:
        return [], []
    on_scale = capacity_on_scale(cap, top_bytes)
    if not on_scale and not off_scale_note:
        return [], []
    name = f"capacity {fmt_bytes(cap)} per GPU" + ("" if on_scale else " (above the scale)")
    # no points: the legend's entry only (the line itself is a shape across the plot)
    entry = go.Scatter(
        x=[None], y=[None], mode="lines", name=name, hoverinfo="skip",
        line={"color": OOM, "dash": "dash", "width": 1.5 if on_scale else 0},
    )
    shapes = [{
        "type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": _sc(cap), "y1": _sc(cap),
        "line": {"color": OOM, "dash": "dash", "width": 1.5},
    }] if on_scale else []
    return [entry], shapes


# ---- 2. peak memory per device per scenario --------------------------------------------


def _peak_figure(view: ReportView) -> go.Figure | None:
    """Per scenario, each GPU's peak allocated bar; above it, hatched, what the
    out-of-memory check adds (reserved beyond allocated, and the CUDA context), so a bar
    marked OOM reaches past the capacity line."""
    data: list[go.Bar | go.Scatter] = []
    top = 0
    many = len(view.columns) > 8
    for i, s in enumerate(view.drawn):
        devs = s.devices
        colour = _colour(s.name, i)
        over = [d.out_of_memory or d.total_over_capacity for d in devs]
        extra = [max(d.total_peak_bytes - d.peak_allocated_bytes, 0) for d in devs]
        tops = [d.peak_allocated_bytes + x for d, x in zip(devs, extra, strict=True)]
        top = max(top, *tops)
        label = [("OOM " if o else "") + _short(_sc(t)) for o, t in zip(over, tops, strict=True)]
        outline = {"color": [OOM_OUTLINE if o else CLEAR for o in over],
                   "width": [2 if o else 0 for o in over]}
        hover = [fmt_bytes(d.peak_allocated_bytes) + " allocated"
                 + (f", {fmt_bytes(t)} with reserved and context" if x else "")
                 + (" · out of memory" if o else "")
                 for d, x, t, o in zip(devs, extra, tops, over, strict=True)]
        text_kw: dict[str, Any] = {
            "textposition": "outside", "textangle": 0, "cliponaxis": False,
            "textfont": {"color": [OOM if o else MUTED for o in over], "size": 11},
        }
        has_extra = any(extra)
        data.append(go.Bar(
            name=_pt(s.name), legendgroup=_pt(s.name), offsetgroup=str(i),
            x=[_pt(d.label) for d in devs], y=[_sc(d.peak_allocated_bytes) for d in devs],
            customdata=hover, marker={"color": colour, "line": outline},
            hovertemplate="%{x}: %{customdata}<extra>%{fullData.name}</extra>",
            **({} if has_extra or many else {"text": label, **text_kw}),
        ))
        if has_extra:
            data.append(go.Bar(
                name=_pt(f"{s.name}: reserved and context"), legendgroup=_pt(s.name),
                showlegend=False, offsetgroup=str(i),
                x=[_pt(d.label) for d in devs], y=[_sc(x) for x in extra],
                base=[_sc(d.peak_allocated_bytes) for d in devs], customdata=hover,
                marker={"color": CLEAR, "line": outline,
                        "pattern": {"shape": "/", "fgcolor": colour, "solidity": 0.35}},
                hovertemplate="%{x}: %{customdata}<extra>" + _pt(s.name) + "</extra>",
                **({} if many else {"text": label, **text_kw}),
            ))
    if not data:
        return None
    entries, shapes = _capacity(view, max(top, view.top_allocated_bytes))
    layout = _base_layout(f"peak memory ({_un()})", barmode="group", bargap=0.25,
                          shapes=shapes, uniformtext={"minsize": 8, "mode": "hide"})
    return _figure([*data, *entries], layout)


# ---- 3. cuda:0's excess by cause --------------------------------------------------------


def _wrap(label: str) -> str:
    """A long axis label on several lines (plotly breaks lines at <br> only)."""
    return "<br>".join(_pt(line) for line in textwrap.wrap(label, LABEL_WRAP_CHARS) or [""])


def _waterfall_figure(ex: AttributionView, x_max: int) -> go.Figure:
    """From the median other GPU to cuda:0, cause by cause (horizontal bars with a base)."""
    names, xs, bases, colours = ["median other GPU"], [ex.reference_bytes], [0], [REFERENCE]
    texts = [fmt_bytes(ex.reference_bytes)]
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
    colours.append(TOTAL)
    # two lines: at a phone's width the total fits beside (or in) its bar
    texts.append(f"{_pt(fmt_bytes(ex.primary_bytes))}<br>"
                 f"({_pt(fmt_bytes(ex.excess_bytes, signed=True))})")
    ends = [k in (0, len(names) - 1) for k in range(len(names))]
    bar = go.Bar(
        orientation="h", y=[_wrap(n) for n in names],
        x=[_sc(x) for x in xs], base=[_sc(b) for b in bases],
        marker={"color": colours},
        text=[t if k == len(names) - 1 else _pt(t) for k, t in enumerate(texts)],
        textposition=["auto" if end else "outside" for end in ends],
        insidetextanchor="end", cliponaxis=False, showlegend=False,
        constraintext="none", textfont={"size": 12},
        insidetextfont={"size": 12, "color": [ON_INK if k == len(names) - 1 else INK
                                              for k in range(len(names))]},
        hovertemplate="%{y}: %{text}<extra></extra>", name=_pt(ex.scenario),
    )
    layout = _base_layout("")
    layout["yaxis"] = {"autorange": "reversed", "automargin": True}
    layout["xaxis"] = {"title": {"text": _un()}, "gridcolor": GRID,
                       "range": [0, _sc(x_max) * 1.5], "automargin": True}
    layout["height"] = 90 + 38 * len(names)
    layout["margin"] = {"t": 10, "r": 12, "b": 44, "l": 10}
    layout["bargap"] = 0.3
    return _figure([bar], layout)


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
        f"</summary><div class='card scroll'><table><tr><th>cause</th>{head}</tr>"
        f"{''.join(rows)}<tr><th>cuda:0's excess</th>{total}</tr></table></div></details>"
    )


def _breakdown_figure(view: ReportView) -> go.Figure | None:
    """Stacked bars: for each scenario and device, bytes per category at the peak."""
    pairs = [(s, d) for s in view.drawn for d in s.devices]
    if not pairs:
        return None
    xs = [[_pt(s.name) for s, _ in pairs], [_pt(d.label) for _, d in pairs]]
    data = []
    for cat, label in view.breakdown_categories:
        vals = [d.breakdown_bytes.get(cat, 0) for _, d in pairs]
        data.append(go.Bar(
            name=_pt(label), x=xs, y=[_sc(v) for v in vals],
            customdata=[fmt_bytes(v) for v in vals],
            marker={"color": CATEGORY_COLOURS.get(cat, "#999999")},
            hovertemplate="%{x[1]}: %{customdata}<extra>%{fullData.name}</extra>",
        ))
    if not data:
        return None
    layout = _base_layout(f"{_un()} at the device's peak", barmode="stack", bargap=0.2)
    layout["xaxis"] = {"type": "multicategory", "automargin": True}
    return _figure(data, layout)


# ---- 4. timelines -------------------------------------------------------------------------


def _same_line(series: tuple[SeriesView, ...]) -> list[list[SeriesView]]:
    """The series grouped by identical points, in order of their first member: identical
    lines would hide all but the last one drawn, so each group is one line and one label."""
    groups: dict[tuple[Any, ...], list[SeriesView]] = {}
    for s in series:
        # not the times: emulated devices' events interleave (cuda:1's 13th is cuda:2's 14th)
        key = tuple((p.allocated_bytes, p.used_bytes, p.phase) for p in s.points)
        groups.setdefault(key, []).append(s)
    return list(groups.values())


def _group_label(group: list[SeriesView]) -> str:
    labels = [s.label for s in group]
    if len(labels) == 1:
        return labels[0]
    if len(labels) <= 3:
        return f"{', '.join(labels)} (identical)"
    return f"{labels[0]} to {labels[-1]} ({len(labels)} GPUs, identical)"


def _timeline_figure(view: ReportView, tl: TimelineView) -> go.Figure:
    nvml = tl.nvml
    data: list[go.Bar | go.Scatter] = []
    groups = _same_line(tl.series)
    crowded = len(groups) > len(GPU_COLOURS)
    others = f"{sum(len(g) for g in groups[1:])} other GPUs"
    for i, group in enumerate(groups):
        points = group[0].points
        if crowded and i > 0:  # past the palette: one grey legend entry for the rest
            colour, label, legend, width = OTHER_GPUS, _pt(others), i == 1, 1.0
        else:
            colour, label = GPU_COLOURS[i % len(GPU_COLOURS)], _pt(_group_label(group))
            legend, width = True, 2.0
        name = _pt(_group_label(group))
        if nvml:
            data.append(go.Scatter(
                mode="lines", name=label, legendgroup=label, showlegend=legend,
                x=[p.t for p in points if p.used_bytes is not None],
                y=[_sc(p.used_bytes) for p in points if p.used_bytes is not None],
                line={"color": colour, "width": width},
                customdata=[_pt(p.phase) for p in points if p.used_bytes is not None],
                hovertemplate="%{y:.2f} " + _un() + " · %{customdata}<extra>" + name
                + "</extra>",
            ))
        if not nvml or any(p.allocated_bytes for p in points):
            data.append(go.Scatter(
                mode="lines", name=f"{label} allocated" if nvml else label,
                legendgroup=label, showlegend=legend and not nvml,
                x=[p.t for p in points], y=[_sc(p.allocated_bytes) for p in points],
                line={"color": colour, "width": width * (0.75 if nvml else 1),
                      "dash": "dot" if nvml else "solid"},
                customdata=[_pt(p.phase) for p in points],
                hovertemplate="%{y:.2f} " + _un() + " · %{customdata}<extra>" + name
                + (" allocated" if nvml else "") + "</extra>",
            ))
    ref = tl.series[0].points
    shapes: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    width_t = (ref[-1].t - ref[0].t) or 1.0
    for x0, x1, phase in tl.phase_spans:
        shapes.append({
            "type": "rect", "xref": "x", "yref": "paper", "x0": x0, "x1": x1, "y0": 0, "y1": 1,
            "fillcolor": PHASE_COLOURS.get(phase, "rgba(128,128,128,0.08)"),
            "line": {"width": 0}, "layer": "below",
        })
        if (x1 - x0) / width_t > 0.04:
            # named "phase": the page hides a phase label that would cover another label
            annotations.append({
                "x": (x0 + x1) / 2, "y": 1, "xref": "x", "yref": "paper", "yanchor": "bottom",
                "showarrow": False, "text": _pt(phase.replace("_", " ")), "name": "phase",
                "font": {"size": 11, "color": MUTED},
            })
    # the peak: a ring on the line, its words in the legend (an annotation beside it ran off
    # a phone's narrow chart or covered the phase labels)
    data.append(go.Scatter(
        mode="markers", x=[tl.peak_t], y=[_sc(tl.peak_bytes)],
        name=_pt(f"{tl.peak_label} peak {fmt_bytes(tl.peak_bytes)}"
                 + (f" ({tl.peak_phase})" if tl.peak_phase else "")),
        marker={"symbol": "circle-open", "size": 11, "color": INK, "line": {"width": 2}},
        hovertemplate="%{fullData.name}<extra></extra>",
    ))
    unit = "seconds since the step began" if view.real else (
        "allocation events of the measured step")
    entries, cap_shapes = _capacity(view, tl.top_bytes, off_scale_note=False)
    layout = _base_layout(_un(), shapes=[*shapes, *cap_shapes], annotations=annotations)
    ts = [p.t for series in tl.series for p in series.points]
    layout["xaxis"] = {"title": {"text": unit, "font": {"size": 12}}, "showgrid": False,
                       "zeroline": False, "automargin": True, "range": [min(ts), max(ts)]}
    layout["yaxis"]["rangemode"] = "tozero"
    layout["margin"] = {"t": 40, "r": 16, "b": 44, "l": 56}
    # the legend at the top of the chart, the phase labels between it and the plot
    layout["legend"] = {"orientation": "h", "x": 0, "y": 1, "yref": "container",
                        "yanchor": "top"}
    return _figure([*data, *entries], layout)


# ---- 5, 6. step time and throughput, largest batch --------------------------------------


def _hbar(names: list[str], values: list[float], texts: list[str], x_title: str,
          colours: list[str]) -> go.Figure:
    bar = go.Bar(
        orientation="h", y=[_wrap(n) for n in names], x=values,
        text=[_pt(t) for t in texts], textposition="auto", marker={"color": colours},
        hovertemplate="%{y}: %{text}<extra></extra>", showlegend=False,
    )
    layout = _base_layout("")
    layout["xaxis"] = {"title": {"text": x_title}, "gridcolor": GRID, "rangemode": "tozero",
                       "automargin": True}
    layout["yaxis"] = {"autorange": "reversed", "automargin": True}
    layout["height"] = 70 + 44 * len(names)
    layout["margin"] = {"t": 10, "r": 16, "b": 44, "l": 10}
    return _figure([bar], layout)


def _timing(view: ReportView) -> tuple[go.Figure | None, str]:
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


def _max_batch(view: ReportView) -> tuple[go.Figure | None, str]:
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
        f"<div class='card scroll'><table id='peaks-table'><tr><th>scenario</th>{head}"
        "<th>cuda:0 excess</th>"
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

    figures: dict[str, go.Figure | dict[str, Any]] = {}

    def chart(key: str, fig: go.Figure | Mapping[str, Any] | None,
              height: int | None = None) -> str:
        if fig is None:
            return ""
        # a plain dict (reports/watch.py) is validated here
        built = fig if isinstance(fig, go.Figure) else go.Figure(dict(fig))
        if height is not None and built.layout.height is None:
            built.update_layout(height=height)
        figures[key] = built
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
            "<div class='card scroll'><table id='gpu-overheads'><tr>"
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
                    "step, per scenario; hatched above it, where known, the reserved memory and "
                    "CUDA context the out-of-memory check adds (labels: the top, in "
                    f"{_un()}). A dark outline marks a GPU that runs out of memory.</p>")
        body.append(chart("peaks", peak, 400))

    exs = view.attributions
    if exs:
        body.append(h2("Why cuda:0 is heavier"))
        body.append("<p class='lead'>From the median other GPU to cuda:0, cause by cause: "
                    "dark steps are memory that cuda:0 holds and the others do not, pale "
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
            title = f"<h3>{_e(s.name)}</h3>"
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
        body.append(f"<div class='card scroll'>{ttable}</div>")
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
        body.append("<h3>Notes</h3><ul>"
                    + "".join(f"<li>{_e(x)}</li>" for x in view.notes) + "</ul>")
    # closed: long, and read when something looks wrong (printed, they took two pages)
    body.append("<details id='configuration'><summary>Configuration</summary>"
                f"<div class='card scroll'>{_kv_table(view.config)}</div></details>")
    body.append("<details id='environment'><summary>Environment</summary>"
                f"<div class='card scroll'>{_kv_table(view.environment)}</div></details>")

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


def figure_json(fig: go.Figure | Mapping[str, Any]) -> dict[str, Any]:
    """A figure as the page carries it; a plain dict is validated by plotly first (a
    misspelt or unknown property raises ``ValueError`` here, not a blank chart there)."""
    built = fig if isinstance(fig, go.Figure) else go.Figure(dict(fig))
    out: dict[str, Any] = built.to_plotly_json()
    out["layout"].pop("template", None)  # "none": plotly.js's own defaults, nothing to carry
    return out


# The page's script: draws each [data-figure] div, one chart per task, top to bottom, and keeps
# it readable: dark colours while the reader's scheme is dark, a taller chart when its legend
# squeezes the plot, phase labels that would cover another label hidden, the page's width
# while printing. Placeholders: __DARK__, __MIN_PLOT__, __PRINT_WIDTH__.
_DRAW_JS = """
(function(){
  var figs = JSON.parse(document.getElementById('dpprof-figures').textContent);
  var DARK = __DARK__, MIN_PLOT = __MIN_PLOT__, PRINT_WIDTH = __PRINT_WIDTH__;
  var dark = window.matchMedia('screen and (prefers-color-scheme: dark)');
  var print = window.matchMedia('print');
  var config = {displaylogo: false, responsive: true};
  var drawn = [];
  function recolour(o) {
    if (typeof o === 'string') {
      var k = o.toLowerCase();
      return Object.prototype.hasOwnProperty.call(DARK, k) ? DARK[k] : o;
    }
    if (Array.isArray(o)) return o.map(recolour);
    if (o && typeof o === 'object') {
      var r = {};
      for (var key in o) r[key] = recolour(o[key]);
      return r;
    }
    return o;
  }
  function copy(o) { return JSON.parse(JSON.stringify(o)); }
  function themed(div) {
    var f = figs[div.getAttribute('data-figure')];
    var data = dark.matches ? recolour(f.data) : copy(f.data);
    var layout = dark.matches ? recolour(f.layout) : copy(f.layout);
    if (div._dpprofHeight) layout.height = div._dpprofHeight;
    if (print.matches) layout.width = PRINT_WIDTH;
    return {data: data, layout: layout};
  }
  function overlaps(a, b) {
    return a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom;
  }
  // A phase label that would cover another label (narrow phases on a narrow screen) or run
  // off the chart is hidden.
  function declutter(div) {
    var anns = (div._fullLayout && div._fullLayout.annotations) || [];
    var edge = div.getBoundingClientRect();
    var nodes = div.querySelectorAll('.annotation');
    var kept = [], phases = [];
    for (var i = 0; i < nodes.length; i++) {
      var idx = +nodes[i].getAttribute('data-index');
      nodes[i].style.display = '';
      var item = {node: nodes[i], box: nodes[i].getBoundingClientRect()};
      if (anns[idx] && anns[idx].name === 'phase') phases.push(item); else kept.push(item);
    }
    phases.sort(function(a, b) { return b.box.width - a.box.width; });
    phases.forEach(function(p) {
      var off = p.box.left < edge.left || p.box.right > edge.right;
      if (off || kept.some(function(k) { return overlaps(p.box, k.box); })) {
        p.node.style.display = 'none';
      } else {
        kept.push(p);
      }
    });
  }
  // A legend that wraps on a narrow screen takes its rows from the plot: grow the chart.
  function fit(div) {
    var fl = div._fullLayout;
    if (!fl || !fl._size) return Promise.resolve();
    var base = figs[div.getAttribute('data-figure')].layout.height || fl.height;
    var want = Math.max(base, Math.round(fl.height + MIN_PLOT - fl._size.h));
    if (Math.abs(want - fl.height) < 2) return Promise.resolve();
    div._dpprofHeight = want;
    return Plotly.relayout(div, {height: want});
  }
  function settle(div) {
    return fit(div).then(function() { declutter(div); });
  }
  function draw(div) {
    var f = themed(div);
    return Plotly.react(div, f.data, f.layout, config).then(function() { return settle(div); });
  }
  function redrawAll() {
    drawn.forEach(function(div) { draw(div); });
  }
  var divs = Array.prototype.slice.call(document.querySelectorAll('[data-figure]'));
  // One chart per task, top to bottom: the first screen is drawn before the rest.
  (function next() {
    var div = divs.shift();
    if (!div) { document.documentElement.setAttribute('data-charts', 'drawn'); return; }
    draw(div).then(function() {
      drawn.push(div);
      div.on('plotly_relayout', function() { settle(div); });
      setTimeout(next, 0);
    });
  })();
  function listen(q, fn) {
    if (q.addEventListener) q.addEventListener('change', fn); else q.addListener(fn);
  }
  listen(dark, redrawAll);
  listen(print, redrawAll);
  window.addEventListener('beforeprint', function() {
    drawn.forEach(function(div) { Plotly.relayout(div, {width: PRINT_WIDTH}); });
  });
  window.addEventListener('afterprint', redrawAll);
})();
"""


def page_scripts(figures: Mapping[str, go.Figure | Mapping[str, Any]]) -> str:
    """The end of every dpprof page: the figures as JSON, plotly.js (once), and the script
    that draws each ``[data-figure]`` div (see :data:`_DRAW_JS`)."""
    as_json = {key: figure_json(fig) for key, fig in figures.items()}
    script = (_DRAW_JS.replace("__DARK__", _json({k.lower(): v for k, v in DARK_COLOURS.items()}))
              .replace("__MIN_PLOT__", str(MIN_PLOT_PX))
              .replace("__PRINT_WIDTH__", str(PRINT_WIDTH_PX)))
    return f"""<script id="dpprof-figures" type="application/json">{_json(as_json)}</script>
<script>{plotly_js()}</script>
<script>{script}</script>"""


class HtmlRenderer(Renderer):
    """A self-contained page with interactive charts."""

    name = "html"
    suffix = '.html'
    description = "A self-contained page with interactive charts."

    def render_view(self, view: ReportView) -> str:
        return render_view(view)
