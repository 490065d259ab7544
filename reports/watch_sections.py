"""Rendering of ``dpprof watch`` results (``run.watch`` set, backend ``nvml-watch``).

Kept apart from the general renderers so that they need only a one-line hook each (each reads
the result's :class:`~dpprof.reports.view.ReportView` and its ``watch`` part):
:func:`render_terminal` for ``terminal.render``, :func:`html_section` and
:func:`timeline_figure` for ``html.render``. No plotly import here: figures are plain dicts.
"""

from __future__ import annotations

import html
from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from dpprof.reports.sentences import b as _b
from dpprof.reports.view import ReportView, WatchRowView, WatchView
from dpprof.units import fmt_bytes

__all__ = ["html_section", "render_terminal", "timeline_figure"]


def _cells(r: WatchRowView) -> list[str]:
    """GPU, name, peak, % of total, at (s), command's own peak, before the command, at OOM."""
    return [
        r.gpu, r.name, fmt_bytes(r.peak_used_bytes),
        "-" if r.peak_percent is None else f"{r.peak_percent:.0f}%",
        f"{r.peak_t_s:.1f} s" if r.peak_t_s is not None else "-",
        _b(r.command_peak_bytes), fmt_bytes(r.baseline_used_bytes), _b(r.at_oom_bytes),
    ]


_HEAD = ("GPU", "name", "peak used", "of total", "at", "command's own", "before start",
         "at the OOM")


def render_terminal(view: ReportView) -> Group:
    """The terminal view of a watch: one row per GPU, the verdict, the post-mortem."""
    w = view.watch
    assert w is not None
    title = f"{view.workload} · {len(w.rows)} GPUs · every {w.interval_s:g} s · {view.backend}"
    # Text, not str: a command such as `train.py --ids [1,2]` is shown, not read as markup.
    table = Table(
        title=Text(title), title_justify="left", header_style="bold", box=box.SIMPLE_HEAD
    )
    for i, name in enumerate(_HEAD):
        table.add_column(name, justify="left" if i < 2 else "right", no_wrap=True)
    for row in w.rows:
        table.add_row(*(Text(cell) for cell in _cells(row)))
    verdict = view.headline.verdict if view.has_comparison else ""
    parts: list[Any] = [table, Text(verdict, style="bold")]
    if w.post_mortem:
        parts.append(Text("Post-mortem", style="bold red"))
        parts.extend(Text(f"  {line}") for line in w.post_mortem)
    if w.next_steps:
        parts.append(Text("Next", style="bold"))
        parts.extend(Text(f"  - {step}") for step in w.next_steps)
    for note in view.run_notes:
        parts.append(Text(note, style="dim"))
    return Group(*parts)


def timeline_figure(w: WatchView) -> dict[str, Any] | None:
    """Used memory per GPU over the run (GiB against seconds), OOMs as vertical lines."""
    data = []
    for series in w.series:
        data.append({
            "type": "scatter", "mode": "lines", "name": series.label,
            "x": [p.t for p in series.points],
            "y": [p.allocated_bytes / 2**30 for p in series.points],
            "hovertemplate": "%{y:.2f} GiB at %{x:.2f} s<extra>%{fullData.name}</extra>",
        })
    if not data:
        return None
    shapes = [
        {"type": "line", "xref": "x", "yref": "paper", "x0": t, "x1": t, "y0": 0,
         "y1": 1, "line": {"color": "#c0392b", "dash": "dot"}}
        for t in w.oom_times_s
    ]
    layout = {
        "xaxis": {"title": {"text": "seconds since dpprof started watching"}},
        "yaxis": {"title": {"text": "used (GiB, NVML)"}},
        "margin": {"t": 30, "r": 20},
        "legend": {"orientation": "h"},
        "shapes": shapes,
    }
    return {"data": data, "layout": layout}


def html_section(view: ReportView, w: WatchView) -> str:
    """The watch-specific part of the HTML report: per-GPU table, post-mortem, next steps."""
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in _HEAD)
    body = "".join(
        "<tr>" + "".join(f"<td>{e(c)}</td>" for c in _cells(row)) + "</tr>" for row in w.rows
    )
    out = [
        "<section id='watch'>",
        f"<h2>The command</h2><p><code>{e(view.workload)}</code>: {e(w.message)}</p>",
        f"<table id='watch-gpus'><tr>{head}</tr>{body}</table>",
    ]
    if w.post_mortem:
        out.append("<h2>Post-mortem</h2><ul id='post-mortem'>")
        out.extend(f"<li>{e(line)}</li>" for line in w.post_mortem)
        out.append("</ul>")
        out.append("<pre class='oom-message'>" + e(w.oom_text or "") + "</pre>")
    if w.next_steps:
        out.append("<h2>What to run next</h2><ul id='next-steps'>")
        out.extend(f"<li>{e(step)}</li>" for step in w.next_steps)
        out.append("</ul>")
    if w.signals:
        out.append("<h2>Signals</h2><ul>")
        out.extend(f"<li>{t_s:.2f} s: {e(signal)} {e(action)}</li>"
                   for t_s, signal, action in w.signals)
        out.append("</ul>")
    out.append(f"<p class='sub'>Samples: <code>{e(w.samples_path)}</code></p></section>")
    return "".join(out)
