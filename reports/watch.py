"""Rendering of ``dpprof watch`` results (``run.watch`` set, backend ``nvml-watch``).

Kept apart from the general renderers so that they need only a one-line hook each:
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

from dpprof.result import RunResult, WatchResult
from dpprof.units import fmt_bytes

__all__ = ["html_section", "render_terminal", "timeline_figure"]


def _pct(used: int | None, total: int | None) -> str:
    if used is None or not total:
        return "-"
    return f"{100 * used / total:.0f}%"


def _rows(w: WatchResult) -> list[list[str]]:
    """GPU, name, peak, % of total, at (s), command's own peak, before the command, at OOM."""
    at = w.ooms[0].used_at_oom_bytes if w.ooms else {}
    rows = []
    for d in w.devices:
        key = f"cuda:{d.cuda_index}"
        rows.append([
            key,
            d.name or "?",
            fmt_bytes(d.peak_used_bytes),
            _pct(d.peak_used_bytes, d.total_bytes),
            f"{d.peak_t_s:.1f} s" if d.peak_t_s is not None else "-",
            fmt_bytes(d.command_peak_bytes) if d.command_peak_bytes is not None else "-",
            fmt_bytes(d.baseline_used_bytes),
            fmt_bytes(at[key]) if key in at else "-",
        ])
    return rows


_HEAD = ("GPU", "name", "peak used", "of total", "at", "command's own", "before start",
         "at the OOM")


def render_terminal(run: RunResult) -> Group:
    """The terminal view of a watch: one row per GPU, the verdict, the post-mortem."""
    w = run.watch
    assert w is not None
    title = f"{run.workload} · {len(w.devices)} GPUs · every {w.interval_s:g} s · {run.backend}"
    # Text, not str: a command such as `train.py --ids [1,2]` is shown, not read as markup.
    table = Table(
        title=Text(title), title_justify="left", header_style="bold", box=box.SIMPLE_HEAD
    )
    for i, name in enumerate(_HEAD):
        table.add_column(name, justify="left" if i < 2 else "right", no_wrap=True)
    for row in _rows(w):
        table.add_row(*(Text(cell) for cell in row))
    parts: list[Any] = [table, Text(run.comparison.verdict, style="bold")]
    if w.post_mortem:
        parts.append(Text("Post-mortem", style="bold red"))
        parts.extend(Text(f"  {line}") for line in w.post_mortem)
    if w.next_steps:
        parts.append(Text("Next", style="bold"))
        parts.extend(Text(f"  - {step}") for step in w.next_steps)
    for note in run.notes:
        parts.append(Text(note, style="dim"))
    return Group(*parts)


def timeline_figure(run: RunResult) -> dict[str, Any] | None:
    """Used memory per GPU over the run (GiB against seconds), OOMs as vertical lines."""
    w = run.watch
    if w is None or not run.scenarios:
        return None
    data = []
    for d in run.scenarios[0].devices:
        if not d.timeline:
            continue
        data.append({
            "type": "scatter", "mode": "lines", "name": f"cuda:{d.index}",
            "x": [p.t for p in d.timeline], "y": [p.allocated_bytes / 2**30 for p in d.timeline],
            "hovertemplate": "%{y:.2f} GiB at %{x:.2f} s<extra>%{fullData.name}</extra>",
        })
    if not data:
        return None
    shapes = [
        {"type": "line", "xref": "x", "yref": "paper", "x0": o.t_s, "x1": o.t_s, "y0": 0,
         "y1": 1, "line": {"color": "#c0392b", "dash": "dot"}}
        for o in w.ooms if o.t_s is not None
    ]
    layout = {
        "xaxis": {"title": {"text": "seconds since dpprof started watching"}},
        "yaxis": {"title": {"text": "used (GiB, NVML)"}},
        "margin": {"t": 30, "r": 20},
        "legend": {"orientation": "h"},
        "shapes": shapes,
    }
    return {"data": data, "layout": layout}


def html_section(run: RunResult) -> str:
    """The watch-specific part of the HTML report: per-GPU table, post-mortem, next steps."""
    w = run.watch
    if w is None:
        return ""
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in _HEAD)
    body = "".join(
        "<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in _rows(w)
    )
    out = [
        "<section id='watch'>",
        f"<h2>The command</h2><p><code>{e(run.workload)}</code>: "
        f"{e(run.scenarios[0].message if run.scenarios else '')}</p>",
        f"<table id='watch-gpus'><tr>{head}</tr>{body}</table>",
    ]
    if w.post_mortem:
        out.append("<h2>Post-mortem</h2><ul id='post-mortem'>")
        out.extend(f"<li>{e(line)}</li>" for line in w.post_mortem)
        out.append("</ul>")
        out.append("<pre class='oom-message'>" + e(w.ooms[0].text) + "</pre>")
    if w.next_steps:
        out.append("<h2>What to run next</h2><ul id='next-steps'>")
        out.extend(f"<li>{e(step)}</li>" for step in w.next_steps)
        out.append("</ul>")
    if w.signals:
        out.append("<h2>Signals</h2><ul>")
        out.extend(
            f"<li>{s.get('t_s', 0):.2f} s: {e(str(s.get('signal') or ''))} "
            f"{e(str(s.get('action', '')))}</li>"
            for s in w.signals
        )
        out.append("</ul>")
    out.append(f"<p class='sub'>Samples: <code>{e(w.samples_path)}</code></p></section>")
    return "".join(out)
