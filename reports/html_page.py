"""The HTML page's shell: its style sheet and content security policy, the escaping of text
and of the JSON inside a ``<script>``, and the scripts at its end: the figures' JSON, the
vendored plotly.js (see :mod:`dpprof.reports.html` for why the basic bundle) and the script
that draws, themes and fits each chart."""

from __future__ import annotations

import html
import json
from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import Any

import plotly.graph_objects as go  # type: ignore[import-untyped]

from dpprof.reports.html_figures import DARK_COLOURS
from dpprof.result import json_safe

PLOTLY_JS = "plotly-basic.min.js"
MIN_PLOT_PX = 200  # a chart grows until its plot area is this tall (legends take the rest)
PRINT_WIDTH_PX = 680  # A4 and Letter at 12 mm margins, less the card's padding


PAGE_CSS = """
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
td.l,th.l{text-align:left}
table.sticky td:first-child,table.sticky th:first-child{position:sticky;left:0;z-index:1;
background:var(--card)}
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
PAGE_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "img-src data:; font-src data:"
)


def escape(x: object) -> str:
    """``x`` as HTML text (quotes escaped too: safe inside an attribute)."""
    return html.escape(str(x), quote=True)


def script_json(x: Any) -> str:
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
  var config = {displaylogo: false, displayModeBar: false, responsive: true};
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
    dark = script_json({k.lower(): v for k, v in DARK_COLOURS.items()})
    script = (_DRAW_JS.replace("__DARK__", dark)
              .replace("__MIN_PLOT__", str(MIN_PLOT_PX))
              .replace("__PRINT_WIDTH__", str(PRINT_WIDTH_PX)))
    return f"""<script id="dpprof-figures" type="application/json">{script_json(as_json)}</script>
<script>{plotly_js()}</script>
<script>{script}</script>"""


def page_document(title: str, sub: str, body_html: str, dpprof_version: str,
                  figures: Mapping[str, go.Figure | Mapping[str, Any]]) -> str:
    """The whole page around ``body_html``: the head (its policy and style sheet), the title
    and the line under it (``title``, ``sub``: text, escaped here), the footer, and the
    scripts that draw ``figures``."""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="{PAGE_CSP}">
<title>{escape(title)}</title><style>{PAGE_CSS}</style></head>
<body><main>
<h1 id="title">{escape(title)}</h1>
<div class="sub">{escape(sub)}</div>
{body_html}
<footer>Generated by dpprof {escape(dpprof_version)}. Charts: plotly.js (MIT), inlined.
</footer>
</main>
{page_scripts(figures)}
</body></html>
"""
