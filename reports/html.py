"""HTML: one self-contained page that opens offline (plotly inlined, no network).

The only module of dpprof that imports plotly. Every string that comes from the user or
the environment is escaped; chart data is embedded as JSON with ``<`` escaped, so a
hostile workload name renders as text.
"""

from __future__ import annotations

import html
import json
from typing import Any

from plotly.offline import get_plotlyjs

from dpprof.result import CATEGORIES, STATUS_OK, STATUS_OOM, RunResult
from dpprof.units import fmt_bytes

GiB = 2**30

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

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1d2330;
background:#f6f7f9}
main{max-width:1100px;margin:0 auto;padding:24px}
h1{font-size:22px;margin:0 0 4px}
h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #dde1e6;padding-bottom:4px}
.sub{color:#5b6372;font-size:14px}
.verdict{font-size:18px;background:#fff;border-left:5px solid #3b6fd8;padding:14px 18px;
margin:18px 0;border-radius:4px}
.oom{color:#c62828;font-weight:600}
table{border-collapse:collapse;background:#fff;font-size:14px}
td,th{padding:5px 10px;border-bottom:1px solid #e6e8eb;text-align:right}
td:first-child,th:first-child{text-align:left}
.chart{background:#fff;border-radius:4px;margin:8px 0}
ul{font-size:14px} code,pre{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:13px}
pre{background:#fff;padding:12px;border-radius:4px;overflow:auto}
"""


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _json(x: Any) -> str:
    """JSON safe inside a <script> element."""
    return (
        json.dumps(x, separators=(",", ":"))
        .replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


def _gib(n: float) -> float:
    return round(n / GiB, 4)


def _peak_figure(run: RunResult) -> dict[str, Any]:
    data = []
    for s in run.scenarios:
        if s.status not in (STATUS_OK, STATUS_OOM):
            continue
        devs = [d for d in s.devices if d.used]
        data.append({
            "type": "bar",
            "name": s.name,
            "x": [f"cuda:{d.index}" for d in devs],
            "y": [_gib(d.peak_allocated_bytes) for d in devs],
            "text": [fmt_bytes(d.peak_allocated_bytes) for d in devs],
            "hovertemplate": "%{x}: %{text}<extra>%{fullData.name}</extra>",
        })
    layout = {
        "barmode": "group",
        "yaxis": {"title": {"text": "peak allocated (GiB)"}},
        "shapes": [{
            "type": "line", "xref": "paper", "x0": 0, "x1": 1,
            "y0": _gib(run.gpu_memory_bytes), "y1": _gib(run.gpu_memory_bytes),
            "line": {"color": "#c62828", "dash": "dash"},
        }],
        "annotations": [{
            "xref": "paper", "x": 1, "y": _gib(run.gpu_memory_bytes), "xanchor": "right",
            "yanchor": "bottom", "showarrow": False,
            "text": f"capacity {fmt_bytes(run.gpu_memory_bytes)}",
            "font": {"color": "#c62828"},
        }],
        "margin": {"t": 30, "r": 20},
        "legend": {"orientation": "h"},
    }
    return {"data": data, "layout": layout}


def _breakdown_figure(run: RunResult) -> dict[str, Any]:
    """Stacked bars: for each scenario and device, bytes per category at the peak."""
    xs: list[list[str]] = [[], []]
    for s in run.scenarios:
        if s.status not in (STATUS_OK, STATUS_OOM):
            continue
        for d in s.devices:
            if d.used:
                xs[0].append(s.name)
                xs[1].append(f"cuda:{d.index}")
    data = []
    for cat in CATEGORIES:
        ys, texts = [], []
        for s in run.scenarios:
            if s.status not in (STATUS_OK, STATUS_OOM):
                continue
            for d in s.devices:
                if d.used:
                    b = d.breakdown_bytes.get(cat, 0)
                    ys.append(_gib(b))
                    texts.append(fmt_bytes(b))
        if any(ys):
            data.append({
                "type": "bar", "name": cat.replace("_", " "), "x": xs, "y": ys,
                "text": texts, "textposition": "none",
                "marker": {"color": CATEGORY_COLOURS.get(cat, "#999")},
                "hovertemplate": "%{x}: %{text}<extra>%{fullData.name}</extra>",
            })
    layout = {
        "barmode": "stack",
        "yaxis": {"title": {"text": "GiB at the device's peak"}},
        "margin": {"t": 30, "r": 20},
        "legend": {"orientation": "h"},
    }
    return {"data": data, "layout": layout}


def _timeline_figure(run: RunResult, scenario: str) -> dict[str, Any] | None:
    s = run.scenario(scenario)
    if s is None or s.status not in (STATUS_OK, STATUS_OOM):
        return None
    data = []
    for d in s.devices:
        if not d.used or not d.timeline or (s.name == "ddp" and d.index > 0):
            continue
        data.append({
            "type": "scatter", "mode": "lines", "name": f"cuda:{d.index}",
            "x": [p.t for p in d.timeline], "y": [_gib(p.allocated_bytes) for p in d.timeline],
            "text": [p.phase for p in d.timeline],
            "hovertemplate": "%{y:.2f} GiB during %{text}<extra>%{fullData.name}</extra>",
        })
    if not data:
        return None
    unit = "seconds" if run.backend == "cuda" else "allocation events"
    layout = {
        "xaxis": {"title": {"text": f"measured step ({unit})"}},
        "yaxis": {"title": {"text": "allocated (GiB)"}},
        "margin": {"t": 30, "r": 20},
        "legend": {"orientation": "h"},
    }
    return {"data": data, "layout": layout}


def _table(run: RunResult) -> str:
    head = "".join(f"<th>cuda:{i}</th>" for i in range(run.gpus))
    rows = []
    for s in run.scenarios:
        cells = []
        for i in range(run.gpus):
            d = s.device(i)
            if d is None or not d.used or s.status not in (STATUS_OK, STATUS_OOM):
                cells.append("<td>-</td>")
            else:
                cls = ' class="oom"' if d.peak_allocated_bytes > d.capacity_bytes > 0 else ""
                cells.append(f"<td{cls}>{_e(fmt_bytes(d.peak_allocated_bytes))}</td>")
        c = run.comparison.scenarios.get(s.name)
        exc = _e(fmt_bytes(c.primary_excess_bytes, signed=True)) if c else "-"
        imb = f"{c.imbalance:.2f}" if c else "-"
        status = "ok" if s.status == STATUS_OK else f'<span class="oom">{_e(s.status)}</span>'
        rows.append(
            f"<tr><td>{_e(s.name)}</td>{''.join(cells)}<td>{exc}</td><td>{imb}</td>"
            f"<td>{status}</td></tr>"
        )
    return (
        f"<table><tr><th>scenario</th>{head}<th>cuda:0 excess</th><th>max/mean</th>"
        f"<th>status</th></tr>{''.join(rows)}</table>"
    )


def _gpu_table(run: RunResult) -> str:
    """Per device: allocated, reserved (allocator segments, workspaces included) and the
    context, each in its own column: a GPU adds them, they are never folded together."""
    rows = []
    for s in run.scenarios:
        if s.status not in (STATUS_OK, STATUS_OOM):
            continue
        for d in s.devices:
            if not d.used or d.peak_reserved_bytes is None:
                continue
            total = d.total_peak_bytes
            cls = ' class="oom"' if total > d.capacity_bytes > 0 else ""
            rows.append(
                f"<tr><td>{_e(s.name)}</td><td>cuda:{d.index}</td>"
                f"<td>{_e(fmt_bytes(d.peak_allocated_bytes))}</td>"
                f"<td>{_e(fmt_bytes(d.peak_reserved_bytes))}</td>"
                f"<td>{_e(fmt_bytes(d.workspace_bytes or 0))}</td>"
                f"<td>{_e(fmt_bytes(d.context_bytes or 0))}</td>"
                f"<td{cls}>{_e(fmt_bytes(total))}</td></tr>"
            )
    if not rows:
        return ""
    return (
        "<h2>What a GPU adds: reserved and context</h2><table id='gpu-overheads'><tr>"
        "<th>scenario</th><th>device</th><th>allocated</th><th>reserved</th>"
        "<th>of which workspaces</th><th>context</th><th>reserved + context</th></tr>"
        + "".join(rows) + "</table>"
    )


def _kv_table(items: dict[str, Any]) -> str:
    rows = "".join(
        f"<tr><td>{_e(k)}</td><td style='text-align:left'>{_e(v)}</td></tr>"
        for k, v in items.items()
    )
    return f"<table>{rows}</table>"


def render(run: RunResult) -> str:
    figures: list[tuple[str, str, dict[str, Any]]] = [
        ("peaks", "Peak memory per GPU", _peak_figure(run)),
        ("breakdown", "What each GPU holds at its peak", _breakdown_figure(run)),
    ]
    for name in ("dp-loss-primary", "dp-loss-forward", "ddp", "single"):
        fig = _timeline_figure(run, name)
        if fig is not None:
            figures.append((f"timeline-{name}", f"Memory over the step: {name}", fig))
    sections = []
    for key, title, _ in figures:
        sections.append(
            f"<h2>{_e(title)}</h2><div class='chart' id='fig-{_e(key)}' "
            f"data-figure='{_e(key)}'></div>"
        )
    problems = "".join(
        f"<li class='oom'>{_e(s.name)}: {_e(s.message)}</li>"
        for s in run.scenarios if s.status != STATUS_OK
    )
    notes = "".join(
        f"<li>{_e(s.name)}: {_e(n)}</li>" for s in run.scenarios for n in s.notes
        if "Traceback" not in n
    )
    verdict_cls = " oom" if any(s.status == STATUS_OOM for s in run.scenarios) else ""
    fig_json = _json({key: fig for key, _, fig in figures})
    title = f"dpprof: {run.workload}, batch {run.batch}, {run.gpus} GPUs"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(title)}</title><style>{_CSS}</style>
<script>{get_plotlyjs()}</script></head>
<body><main>
<h1>{_e(title)}</h1>
<div class="sub">{_e(run.backend)} backend · dpprof {_e(run.dpprof_version)} ·
{_e(run.created)} · {_e(fmt_bytes(run.gpu_memory_bytes))} per GPU</div>
<p class="verdict{verdict_cls}" id="verdict">{_e(run.comparison.verdict)}</p>
{_table(run)}
{"<ul>" + problems + "</ul>" if problems else ""}
{_gpu_table(run)}
{"".join(sections)}
<h2>Notes</h2><ul>{notes or "<li>none</li>"}</ul>
<h2>How these numbers were obtained</h2>
<ul>{"".join(f"<li>{_e(a)}</li>" for a in run.assumptions)}</ul>
<h2>Configuration</h2>{_kv_table(run.config)}
<h2>Environment</h2>{_kv_table(run.environment)}
</main>
<script id="dpprof-figures" type="application/json">{fig_json}</script>
<script>
(function(){{
  var figs = JSON.parse(document.getElementById('dpprof-figures').textContent);
  document.querySelectorAll('[data-figure]').forEach(function(div){{
    var f = figs[div.getAttribute('data-figure')];
    Plotly.newPlot(div, f.data, f.layout, {{displaylogo:false, responsive:true}});
  }});
}})();
</script>
</body></html>
"""
