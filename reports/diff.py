"""Two saved results side by side: did a change fix the imbalance?

``dpprof report before.json after.json`` prints :func:`render_terminal`; ``-o diff.md``
writes :func:`render_markdown`, ``-o diff.html`` :func:`render_html`. :func:`diff` is the
pure comparison they share: per scenario and device, the peak before, after and the
difference; cuda:0's excess before and after; and what differs in the configuration (a
diff across different batches or GPU counts is shown, and said to be one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from dpprof.reports.markdown import md
from dpprof.reports.sentences import b as _b
from dpprof.reports.sentences import run_title
from dpprof.reports.view import ReportView, ScenarioView
from dpprof.reports.view_builder import build_view
from dpprof.result import RunResult
from dpprof.units import fmt_bytes

CONFIG_KEYS = ("backend", "workload", "batch", "gpus", "gpu_memory_bytes", "dtype", "seed")


@dataclass(frozen=True)
class DeviceDiff:
    label: str
    before_bytes: int | None  # None: the device did not take part (or no measurement)
    after_bytes: int | None

    @property
    def delta_bytes(self) -> int | None:
        if self.before_bytes is None or self.after_bytes is None:
            return None
        return self.after_bytes - self.before_bytes

    @property
    def change_percent(self) -> float | None:
        """The change against before, in percent; None where there is none to state."""
        if self.delta_bytes is None or not self.before_bytes:
            return None
        return 100 * self.delta_bytes / self.before_bytes


@dataclass(frozen=True)
class ScenarioDiff:
    name: str
    before_status: str | None  # None: the scenario is absent from that run
    after_status: str | None
    before_excess_bytes: int | None
    after_excess_bytes: int | None
    devices: tuple[DeviceDiff, ...] = ()


@dataclass(frozen=True)
class RunDiff:
    """The view of two results side by side (each the one view of its result)."""

    before: ReportView
    after: ReportView
    changed: dict[str, tuple[Any, Any]]  # configuration key -> (before, after)
    scenarios: tuple[ScenarioDiff, ...]


def _peaks(s: ScenarioView | None) -> dict[str, int]:
    if s is None or not s.measured:
        return {}
    return {d.label: d.peak_allocated_bytes for d in s.devices}


def diff(before: RunResult, after: RunResult) -> RunDiff:
    """Compare two results scenario by scenario and device by device."""
    vb, va = build_view(before), build_view(after)
    changed = {
        k: (getattr(vb, k), getattr(va, k))
        for k in CONFIG_KEYS if getattr(vb, k) != getattr(va, k)
    }
    names = list(dict.fromkeys([s.name for s in vb.scenarios] + [s.name for s in va.scenarios]))
    out = []
    for name in names:
        b, a = vb.scenario(name), va.scenario(name)
        pb, pa = _peaks(b), _peaks(a)
        labels = list(dict.fromkeys([*pb, *pa]))
        out.append(ScenarioDiff(
            name=name,
            before_status=b.status if b else None,
            after_status=a.status if a else None,
            before_excess_bytes=b.excess_bytes if b else None,
            after_excess_bytes=a.excess_bytes if a else None,
            devices=tuple(DeviceDiff(lb, pb.get(lb), pa.get(lb)) for lb in labels),
        ))
    return RunDiff(vb, va, changed, tuple(out))


def _pct(d: DeviceDiff) -> str:
    return "" if d.change_percent is None else f"{d.change_percent:+.0f}%"


def _status(st: str | None) -> str:
    return "absent" if st is None else ("ok" if st == "ok" else st.upper())


def _changed_text(rd: RunDiff) -> str:
    parts = []
    for k, (b, a) in rd.changed.items():
        if k.endswith("_bytes"):
            b, a = fmt_bytes(b), fmt_bytes(a)
        parts.append(f"{k} {b} → {a}")
    return "; ".join(parts)


def summary(rd: RunDiff) -> list[str]:
    """One line per scenario in both runs: cuda:0's peak and excess, before → after."""
    lines = []
    for s in rd.scenarios:
        if s.before_status is None or s.after_status is None:
            which = "after" if s.before_status is None else "before"
            lines.append(f"{s.name}: only in the {which} run")
            continue
        d0 = s.devices[0] if s.devices else None
        status = ""
        if s.before_status != s.after_status:
            status = f"; status {_status(s.before_status)} → {_status(s.after_status)}"
        if d0 is None or d0.delta_bytes is None:
            lines.append(f"{s.name}: no measurement to compare{status}")
            continue
        exc = ""
        if s.before_excess_bytes is not None and s.after_excess_bytes is not None \
                and d0 is not None:
            exc = (f", excess over the others {_b(s.before_excess_bytes, True)} → "
                   f"{_b(s.after_excess_bytes, True)}")
        lines.append(
            f"{s.name}: {d0.label} {_b(d0.before_bytes)} → {_b(d0.after_bytes)} "
            f"({_b(d0.delta_bytes, True)} {_pct(d0)}){exc}{status}"
        )
    return lines


def _title(view: ReportView) -> str:
    return f"{run_title(view)} · {view.created}"


# ---- terminal -----------------------------------------------------------------------------


def render_terminal(rd: RunDiff) -> Group:
    parts: list[Any] = [
        Text(f"before: {_title(rd.before)}", style="bold"),
        Text(f"after:  {_title(rd.after)}", style="bold"),
    ]
    if rd.changed:
        parts.append(Text(f"the runs differ in: {_changed_text(rd)}", style="yellow"))
    table = Table(header_style="bold", box=box.SIMPLE_HEAD)
    for col, j in (("scenario", "left"), ("device", "left"), ("before", "right"),
                   ("after", "right"), ("change", "right"), ("", "right")):
        table.add_column(col, justify=j, no_wrap=True)  # type: ignore[arg-type]
    for s in rd.scenarios:
        first = True
        rows = s.devices or (DeviceDiff("-", None, None),)
        for d in rows:
            delta = d.delta_bytes
            style = "" if delta is None or delta == 0 else ("green" if delta < 0 else "red")
            table.add_row(
                s.name if first else "", d.label, _b(d.before_bytes), _b(d.after_bytes),
                Text(_b(delta, True), style=style), Text(_pct(d), style=style),
            )
            first = False
        table.add_row("", Text("cuda:0 excess", style="dim"), _b(s.before_excess_bytes, True),
                      _b(s.after_excess_bytes, True), "", "", end_section=True)
    parts.append(table)
    parts += [Text(line) for line in summary(rd)]
    return Group(*parts)


# ---- markdown -----------------------------------------------------------------------------


def render_markdown(rd: RunDiff) -> str:
    lines = ["## dpprof: before and after", "",
             f"- **before**: {md(_title(rd.before))}", f"- **after**: {md(_title(rd.after))}"]
    if rd.changed:
        lines.append(f"- **the runs differ in**: {md(_changed_text(rd))}")
    lines += ["", *[f"- {md(x)}" for x in summary(rd)], "",
              "| scenario | device | before | after | change | |",
              "| --- | --- | ---: | ---: | ---: | ---: |"]
    for s in rd.scenarios:
        for k, d in enumerate(s.devices):
            lines.append(f"| {md(s.name) if k == 0 else ''} | {md(d.label)} | "
                         f"{_b(d.before_bytes)} | {_b(d.after_bytes)} | "
                         f"{_b(d.delta_bytes, True)} | {_pct(d)} |")
        lines.append(f"| | *cuda:0 excess* | {_b(s.before_excess_bytes, True)} | "
                     f"{_b(s.after_excess_bytes, True)} | | |")
    return "\n".join(lines) + "\n"


# ---- html ---------------------------------------------------------------------------------


def render_html(rd: RunDiff) -> str:
    from dpprof.reports import html_figures as charts  # deferred: plotly, for HTML only

    top = max((max(d.before_bytes or 0, d.after_bytes or 0) for s in rd.scenarios
               for d in s.devices), default=0)
    token = charts.CHART_UNIT.set(charts.unit_for(top))
    try:
        return _render_html(rd)
    finally:
        charts.CHART_UNIT.reset(token)


def _render_html(rd: RunDiff) -> str:
    # deferred: plotly, for HTML only
    from dpprof.reports import html_figures as charts
    from dpprof.reports import html_page as page

    xs: list[list[str]] = [[], []]
    before_y, after_y, before_t, after_t = [], [], [], []
    for s in rd.scenarios:
        for d in s.devices:
            xs[0].append(charts.plotly_text(s.name))
            xs[1].append(charts.plotly_text(d.label))
            before_y.append(None if d.before_bytes is None
                            else charts.in_chart_unit(d.before_bytes))
            after_y.append(None if d.after_bytes is None
                           else charts.in_chart_unit(d.after_bytes))
            before_t.append(_b(d.before_bytes))
            after_t.append(f"{_b(d.after_bytes)} ({_b(d.delta_bytes, True)})")
    layout = charts.base_layout(f"peak allocated ({charts.chart_unit_name()})",
                                barmode="group", bargap=0.2, height=420)
    layout["xaxis"] = {"type": "multicategory", "automargin": True}
    fig = {"data": [
        {"type": "bar", "name": "before", "x": xs, "y": before_y, "customdata": before_t,
         "marker": {"color": "#b0b7c3"},
         "hovertemplate": "%{x[1]}: %{customdata}<extra>before</extra>"},
        {"type": "bar", "name": "after", "x": xs, "y": after_y, "customdata": after_t,
         "marker": {"color": "#4c72b0"},
         "hovertemplate": "%{x[1]}: %{customdata}<extra>after</extra>"},
    ], "layout": layout}
    e = page.escape
    rows = []
    for s in rd.scenarios:
        for k, d in enumerate(s.devices):
            delta = d.delta_bytes
            cls = "" if not delta else (" style='color:#2e7d32'" if delta < 0 else " class='oom'")
            rows.append(f"<tr><td>{e(s.name) if k == 0 else ''}</td><td class='l'>"
                        f"{e(d.label)}</td><td>{e(_b(d.before_bytes))}</td>"
                        f"<td>{e(_b(d.after_bytes))}</td><td{cls}>{e(_b(delta, True))}</td>"
                        f"<td{cls}>{e(_pct(d))}</td></tr>")
        rows.append(f"<tr><td></td><td class='l dim'>cuda:0 excess</td>"
                    f"<td>{e(_b(s.before_excess_bytes, True))}</td>"
                    f"<td>{e(_b(s.after_excess_bytes, True))}</td><td></td><td></td></tr>")
    changed = (f"<p class='oom'>The runs differ in: {e(_changed_text(rd))}</p>"
               if rd.changed else "")
    title = "dpprof: before and after"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="{page.PAGE_CSP}">
<title>{e(title)}</title><style>{page.PAGE_CSS}</style></head>
<body><main>
<h1 id="title">{e(title)}</h1>
<div class="sub">before: {e(_title(rd.before))}<br>after: {e(_title(rd.after))}</div>
{changed}
<div class="verdict" id="verdict">{"<br>".join(e(x) for x in summary(rd))}</div>
<div class="card"><div class="chart" id="fig-diff" data-figure="diff"></div></div>
<div class="card"><table><tr><th>scenario</th><th>device</th><th>before</th><th>after</th>
<th>change</th><th></th></tr>{"".join(rows)}</table></div>
</main>
{page.page_scripts({"diff": fig})}
</body></html>
"""
