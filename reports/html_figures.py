"""The HTML page's charts, as plotly figures: the palette (and its dark-mode stand-ins),
the one chart unit of a page, the layout every chart starts from, and each figure: peak
memory per GPU, cuda:0's excess as a waterfall, what each GPU holds at its peak, memory over
the step, and the horizontal bars of the timing and largest-batch sections.

Every label plotly draws goes through :func:`plotly_text` (plotly reads a few HTML tags in
labels); see :mod:`dpprof.reports.html` for the page they are drawn on."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

import plotly.graph_objects as go  # type: ignore[import-untyped]

from dpprof.reports.sentences import EXTRA_COLOURS, SCENARIO_COLOURS, capacity_on_scale
from dpprof.reports.view import (
    AttributionView,
    BusyView,
    ReportView,
    SeriesView,
    TimelineView,
)
from dpprof.units import fmt_bytes

GiB = 2**30
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
LABEL_WRAP_CHARS = 22  # the waterfall's causes wrap at this width (a phone's card)


def plotly_text(x: object) -> str:
    """A label for plotly to draw: its own mini-HTML (<b>, <a href>...) disarmed."""
    return str(x).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# The unit of every chart of one page: GiB, MiB or KiB, whichever suits its largest value.
CHART_UNIT: ContextVar[tuple[str, int]] = ContextVar("dpprof_html_unit", default=("GiB", GiB))


def unit_for(top_bytes: float) -> tuple[str, int]:
    """The unit for charts whose largest value is ``top_bytes``."""
    for name, size in (("GiB", GiB), ("MiB", 2**20)):
        if top_bytes >= 2 * size:
            return name, size
    return "KiB", 2**10


def in_chart_unit(n: float) -> float:
    """Bytes in the page's chart unit."""
    return round(n / CHART_UNIT.get()[1], 4)


def _short(v: float) -> str:
    return f"{v:.1f}" if v < 100 else f"{v:.0f}"


def chart_unit_name() -> str:
    """The page's chart unit, as its axes name it (GiB, MiB or KiB)."""
    return CHART_UNIT.get()[0]


def scenario_colour(name: str, i: int) -> str:
    """The scenario's own colour, else the ``i``-th of the extra ones."""
    return SCENARIO_COLOURS.get(name, EXTRA_COLOURS[i % len(EXTRA_COLOURS)])


def base_layout(y_title: str, **extra: Any) -> dict[str, Any]:
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
        "type": "line", "xref": "paper", "x0": 0, "x1": 1,
        "y0": in_chart_unit(cap), "y1": in_chart_unit(cap),
        "line": {"color": OOM, "dash": "dash", "width": 1.5},
    }] if on_scale else []
    return [entry], shapes


# ---- peak memory per device per scenario ---------------------------------------------


def peak_figure(view: ReportView) -> go.Figure | None:
    """Per scenario, each GPU's peak allocated bar; above it, hatched, what the
    out-of-memory check adds (reserved beyond allocated, and the CUDA context), so a bar
    marked OOM reaches past the capacity line."""
    data: list[go.Bar | go.Scatter] = []
    top = 0
    many = len(view.columns) > 8
    for i, s in enumerate(view.drawn):
        devs = s.devices
        colour = scenario_colour(s.name, i)
        over = [d.out_of_memory or d.total_over_capacity for d in devs]
        extra = [max(d.total_peak_bytes - d.peak_allocated_bytes, 0) for d in devs]
        tops = [d.peak_allocated_bytes + x for d, x in zip(devs, extra, strict=True)]
        top = max(top, *tops)
        # two short lines: "OOM" over the figure fits a bar as narrow as print makes it
        label = [("OOM<br>" if o else "") + _short(in_chart_unit(t))
                 for o, t in zip(over, tops, strict=True)]
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
            name=plotly_text(s.name), legendgroup=plotly_text(s.name), offsetgroup=str(i),
            x=[plotly_text(d.label) for d in devs],
            y=[in_chart_unit(d.peak_allocated_bytes) for d in devs],
            customdata=hover, marker={"color": colour, "line": outline},
            hovertemplate="%{x}: %{customdata}<extra>%{fullData.name}</extra>",
            **({} if has_extra or many else {"text": label, **text_kw}),
        ))
        if has_extra:
            data.append(go.Bar(
                name=plotly_text(f"{s.name}: reserved and context"),
                legendgroup=plotly_text(s.name),
                showlegend=False, offsetgroup=str(i),
                x=[plotly_text(d.label) for d in devs], y=[in_chart_unit(x) for x in extra],
                base=[in_chart_unit(d.peak_allocated_bytes) for d in devs], customdata=hover,
                marker={"color": CLEAR, "line": outline,
                        "pattern": {"shape": "/", "fgcolor": colour, "solidity": 0.35}},
                hovertemplate="%{x}: %{customdata}<extra>" + plotly_text(s.name) + "</extra>",
                **({} if many else {"text": label, **text_kw}),
            ))
    if not data:
        return None
    entries, shapes = _capacity(view, max(top, view.top_allocated_bytes))
    # labels shrink to 8 px where the bars are narrow, and are never hidden (print's page is
    # narrower than a screen: the "OOM" labels were the ones that went)
    layout = base_layout(f"peak memory ({chart_unit_name()})", barmode="group", bargap=0.25,
                          shapes=shapes, uniformtext={"minsize": 8, "mode": "show"})
    return _figure([*data, *entries], layout)


# ---- cuda:0's excess by cause ---------------------------------------------------------


def _wrap(label: str) -> str:
    """A long axis label on several lines (plotly breaks lines at <br> only)."""
    return "<br>".join(plotly_text(line) for line in textwrap.wrap(label, LABEL_WRAP_CHARS) or [""])


def waterfall_figure(ex: AttributionView, x_max: int) -> go.Figure:
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
    names.append(ex.primary)
    xs.append(ex.primary_bytes)
    bases.append(0)
    colours.append(TOTAL)
    # two lines: at a phone's width the total fits beside (or in) its bar
    texts.append(f"{plotly_text(fmt_bytes(ex.primary_bytes))}<br>"
                 f"({plotly_text(fmt_bytes(ex.excess_bytes, signed=True))})")
    ends = [k in (0, len(names) - 1) for k in range(len(names))]
    bar = go.Bar(
        orientation="h", y=[_wrap(n) for n in names],
        x=[in_chart_unit(x) for x in xs], base=[in_chart_unit(b) for b in bases],
        marker={"color": colours},
        text=[t if k == len(names) - 1 else plotly_text(t) for k, t in enumerate(texts)],
        textposition=["auto" if end else "outside" for end in ends],
        insidetextanchor="end", cliponaxis=False, showlegend=False,
        constraintext="none", textfont={"size": 12},
        insidetextfont={"size": 12, "color": [ON_INK if k == len(names) - 1 else INK
                                              for k in range(len(names))]},
        hovertemplate="%{y}: %{text}<extra></extra>", name=plotly_text(ex.scenario),
    )
    layout = base_layout("")
    layout["yaxis"] = {"autorange": "reversed", "automargin": True}
    layout["xaxis"] = {"title": {"text": chart_unit_name()}, "gridcolor": GRID,
                       "range": [0, in_chart_unit(x_max) * 1.5], "automargin": True}
    layout["height"] = 90 + 38 * len(names)
    layout["margin"] = {"t": 10, "r": 12, "b": 44, "l": 10}
    layout["bargap"] = 0.3
    return _figure([bar], layout)


def breakdown_figure(view: ReportView) -> go.Figure | None:
    """Stacked bars: for each scenario and device, bytes per category at the peak."""
    pairs = [(s, d) for s in view.drawn for d in s.devices]
    if not pairs:
        return None
    xs = [[plotly_text(s.name) for s, _ in pairs], [plotly_text(d.label) for _, d in pairs]]
    data = []
    for cat, label in view.breakdown_categories:
        vals = [d.breakdown_bytes.get(cat, 0) for _, d in pairs]
        data.append(go.Bar(
            name=plotly_text(label), x=xs, y=[in_chart_unit(v) for v in vals],
            customdata=[fmt_bytes(v) for v in vals],
            marker={"color": CATEGORY_COLOURS.get(cat, "#999999")},
            hovertemplate="%{x[1]}: %{customdata}<extra>%{fullData.name}</extra>",
        ))
    if not data:
        return None
    layout = base_layout(f"{chart_unit_name()} at the device's peak", barmode="stack", bargap=0.2)
    layout["xaxis"] = {"type": "multicategory", "automargin": True}
    return _figure(data, layout)


# ---- timelines ----------------------------------------------------------------------------


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


def step_timeline_figure(view: ReportView, tl: TimelineView) -> go.Figure:
    """One scenario's memory over the step, a line per GPU, its phases as bands."""
    nvml = tl.nvml
    data: list[go.Bar | go.Scatter] = []
    groups = _same_line(tl.series)
    crowded = len(groups) > len(GPU_COLOURS)
    others = f"{sum(len(g) for g in groups[1:])} other GPUs"
    for i, group in enumerate(groups):
        points = group[0].points
        if crowded and i > 0:  # past the palette: one grey legend entry for the rest
            colour, label, legend, width = OTHER_GPUS, plotly_text(others), i == 1, 1.0
        else:
            colour, label = GPU_COLOURS[i % len(GPU_COLOURS)], plotly_text(_group_label(group))
            legend, width = True, 2.0
        name = plotly_text(_group_label(group))
        if nvml:
            data.append(go.Scatter(
                mode="lines", name=label, legendgroup=label, showlegend=legend,
                x=[p.t for p in points if p.used_bytes is not None],
                y=[in_chart_unit(p.used_bytes) for p in points if p.used_bytes is not None],
                line={"color": colour, "width": width},
                customdata=[plotly_text(p.phase) for p in points if p.used_bytes is not None],
                hovertemplate="%{y:.2f} " + chart_unit_name() + " · %{customdata}<extra>" + name
                + "</extra>",
            ))
        if not nvml or any(p.allocated_bytes for p in points):
            data.append(go.Scatter(
                mode="lines", name=f"{label} allocated" if nvml else label,
                legendgroup=label, showlegend=legend and not nvml,
                x=[p.t for p in points], y=[in_chart_unit(p.allocated_bytes) for p in points],
                line={"color": colour, "width": width * (0.75 if nvml else 1),
                      "dash": "dot" if nvml else "solid"},
                customdata=[plotly_text(p.phase) for p in points],
                hovertemplate="%{y:.2f} " + chart_unit_name() + " · %{customdata}<extra>" + name
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
                "showarrow": False, "text": plotly_text(phase.replace("_", " ")), "name": "phase",
                "font": {"size": 11, "color": MUTED},
            })
    # the peak: a ring on the line, its words in the legend (an annotation beside it ran off
    # a phone's narrow chart or covered the phase labels)
    data.append(go.Scatter(
        mode="markers", x=[tl.peak_t], y=[in_chart_unit(tl.peak_bytes)],
        name=plotly_text(f"{tl.peak_label} peak {fmt_bytes(tl.peak_bytes)}"
                 + (f" ({tl.peak_phase})" if tl.peak_phase else "")),
        marker={"symbol": "circle-open", "size": 11, "color": INK, "line": {"width": 2}},
        hovertemplate="%{fullData.name}<extra></extra>",
    ))
    unit = "seconds since the step began" if view.real else (
        "allocation events of the measured step")
    entries, cap_shapes = _capacity(view, tl.top_bytes, off_scale_note=False)
    layout = base_layout(chart_unit_name(), shapes=[*shapes, *cap_shapes], annotations=annotations)
    ts = [p.t for series in tl.series for p in series.points]
    layout["xaxis"] = {"title": {"text": unit, "font": {"size": 12}}, "showgrid": False,
                       "zeroline": False, "automargin": True, "range": [min(ts), max(ts)]}
    layout["yaxis"]["rangemode"] = "tozero"
    layout["margin"] = {"t": 40, "r": 16, "b": 44, "l": 56}
    # the legend at the top of the chart, the phase labels between it and the plot
    layout["legend"] = {"orientation": "h", "x": 0, "y": 1, "yref": "container",
                        "yanchor": "top"}
    return _figure([*data, *entries], layout)


# ---- step time, throughput and the largest batch -----------------------------------------


def hbar_figure(names: list[str], values: list[float], texts: list[str], x_title: str,
                colours: list[str]) -> go.Figure:
    """Horizontal bars, one per name (the timing and largest-batch sections)."""
    bar = go.Bar(
        orientation="h", y=[_wrap(n) for n in names], x=values,
        text=[plotly_text(t) for t in texts], textposition="auto", marker={"color": colours},
        hovertemplate="%{y}: %{text}<extra></extra>", showlegend=False,
    )
    layout = base_layout("")
    layout["xaxis"] = {"title": {"text": x_title}, "gridcolor": GRID, "rangemode": "tozero",
                       "automargin": True}
    layout["yaxis"] = {"autorange": "reversed", "automargin": True}
    layout["height"] = 70 + 44 * len(names)
    layout["margin"] = {"t": 10, "r": 16, "b": 44, "l": 10}
    return _figure([bar], layout)


# ---- the predicted step: each GPU busy or waiting ----------------------------------------

# the parts a predicted step stacks into (they add up to the step): the name shown, the
# BusyView attribute, the colour
BUSY_PARTS = (("compute", "compute_s", "#4c78a8"),
              ("communication beside no kernel", "exposed_communication_s", "#f58518"),
              ("waiting", "waiting_s", "#d9d9d9"))


# a scenario's bars past which its other GPUs are shown by their least, median and most busy
BUSY_BARS_MAX = 6


def _busy_bars(busy: tuple[BusyView, ...]) -> list[tuple[str, BusyView]]:
    """One bar per group of GPUs whose steps split alike (64 GPUs of DDP are one bar); where
    the groups are still many, the first GPU's and the others' least, median and most busy."""
    groups: dict[tuple[float, float, float], list[BusyView]] = {}
    for b in busy:
        key = (round(b.compute_s, 9), round(b.exposed_communication_s, 9), round(b.waiting_s, 9))
        groups.setdefault(key, []).append(b)
    bars = [(_busy_label(g), g[0]) for g in groups.values()]
    if len(bars) <= BUSY_BARS_MAX:
        return bars
    first, rest = bars[0], sorted(bars[1:], key=lambda lb: lb[1].busy_s)
    picked = {"least busy": rest[0], "median": rest[len(rest) // 2], "most busy": rest[-1]}
    return [first, *((f"{label} ({how} of the others)", b)
                     for how, (label, b) in picked.items())]


def _busy_label(group: list[BusyView]) -> str:
    labels = [b.label for b in group]
    if len(labels) == 1:
        return labels[0]
    if len(labels) <= 3:
        return ", ".join(labels)
    return f"{labels[0]} to {labels[-1]} ({len(labels)} GPUs, alike)"


def busy_figure(view: ReportView) -> go.Figure | None:
    """One bar per GPU of each scenario, its predicted step split into computing,
    communicating and waiting (stacked, in ms): where DataParallel's cuda:0 works while the
    others wait."""
    rows = [(t.scenario, label, b) for t in view.timings if t.predicted_step_s
            for label, b in _busy_bars(t.busy)]
    if not rows:
        return None
    names = [f"{scenario} · {label}" for scenario, label, _ in rows]
    bars = []
    for part, attribute, colour in BUSY_PARTS:
        values = [getattr(b, attribute) * 1e3 for _, _, b in rows]
        bars.append(go.Bar(
            orientation="h", y=[_wrap(n) for n in names], x=values, name=part,
            marker={"color": colour},
            hovertemplate=f"%{{y}}: {part} %{{x:.2f}} ms<extra></extra>"))
    layout = base_layout("")
    layout["barmode"] = "stack"
    layout["xaxis"] = {"title": {"text": "ms of the predicted step"}, "gridcolor": GRID,
                       "rangemode": "tozero", "automargin": True}
    layout["yaxis"] = {"autorange": "reversed", "automargin": True}
    layout["height"] = 90 + 26 * len(names)
    layout["margin"] = {"t": 10, "r": 16, "b": 44, "l": 10}
    return _figure(bars, layout)
