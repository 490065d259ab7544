"""Two saved results side by side: did a change fix the imbalance?

``dpprof report before.json after.json`` prints :func:`render_terminal`; ``-o diff.md``
writes :func:`render_markdown`, ``-o diff.html`` :func:`render_html`. :func:`diff` is the
pure comparison they share: the runs matched by role (what the user runs, as written, before
and after, whatever scenario each is, then the other scenarios by name), per device the peak
before, after and the difference; what the fullest GPU needs and whether it fits, before and
after; cuda:0's excess before and after; and what differs in the configuration (a diff
across different batches or GPU counts is shown, and said to be one).

So "did my fix work?" for a script before and after its suggested change reads
``as written (dp-loss-primary → dp-loss-forward): cuda:0 6.79 GiB, out of memory →
6.31 GiB, fits``.
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

AS_WRITTEN = "as written"  # the role of the scenario each run stands for (its baseline)

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
class NeedDiff:
    """What one run's fullest GPU needs (reserved and context where counted) and whether
    the scenario fits."""

    label: str  # the fullest GPU
    need_bytes: int
    fits: bool


@dataclass(frozen=True)
class ScenarioDiff:
    name: str  # the role: AS_WRITTEN, or the scenario's name
    before_status: str | None  # None: the scenario is absent from that run
    after_status: str | None
    before_excess_bytes: int | None
    after_excess_bytes: int | None
    devices: tuple[DeviceDiff, ...] = ()
    before_scenario: str | None = None  # the scenario that had this role in each run
    after_scenario: str | None = None
    before_need: NeedDiff | None = None
    after_need: NeedDiff | None = None


@dataclass(frozen=True)
class RunDiff:
    """The view of two results side by side (each the one view of its result)."""

    before: ReportView
    after: ReportView
    changed: dict[str, tuple[Any, Any]]  # configuration key -> (before, after)
    scenarios: tuple[ScenarioDiff, ...]


def _excess_label(rd: RunDiff) -> str:
    """The excess rows' heading: the GPU both runs measure it on (cuda:0 unless
    DataParallel's first device is another), or each run's."""
    before, after = rd.before.primary, rd.after.primary
    return f"{after} excess" if before == after else f"{before} / {after} excess"


def _peaks(s: ScenarioView | None) -> dict[str, int]:
    if s is None or not s.measured:
        return {}
    return {d.label: d.peak_allocated_bytes for d in s.devices}


def _need(s: ScenarioView | None) -> NeedDiff | None:
    if s is None or not s.measured or not s.devices:
        return None
    top = max(s.devices, key=lambda d: (d.total_peak_bytes, -d.index))
    return NeedDiff(top.label, top.total_peak_bytes, s.status == "ok")


def _roles(view: ReportView) -> dict[str, str]:
    """role -> scenario: what the user runs (the answer's baseline) as written; every other
    scenario under its own name."""
    return {AS_WRITTEN if s.name == view.baseline else s.name: s.name for s in view.scenarios}


def diff(before: RunResult, after: RunResult) -> RunDiff:
    """Compare two results role by role (:func:`_roles`) and device by device."""
    vb, va = build_view(before), build_view(after)
    changed = {
        k: (getattr(vb, k), getattr(va, k))
        for k in CONFIG_KEYS if getattr(vb, k) != getattr(va, k)
    }
    rb, ra = _roles(vb), _roles(va)
    if rb.get(AS_WRITTEN) == ra.get(AS_WRITTEN):  # the same scenario: its own name
        rb = {s: s for s in rb.values()}
        ra = {s: s for s in ra.values()}
    roles = list(dict.fromkeys([*rb, *ra]))
    out = []
    for role in roles:
        b = vb.scenario(rb[role]) if role in rb else None
        a = va.scenario(ra[role]) if role in ra else None
        pb, pa = _peaks(b), _peaks(a)
        labels = list(dict.fromkeys([*pb, *pa]))
        out.append(ScenarioDiff(
            name=role,
            before_status=b.status if b else None,
            after_status=a.status if a else None,
            before_excess_bytes=b.excess_bytes if b else None,
            after_excess_bytes=a.excess_bytes if a else None,
            devices=tuple(DeviceDiff(lb, pb.get(lb), pa.get(lb)) for lb in labels),
            before_scenario=b.name if b else None, after_scenario=a.name if a else None,
            before_need=_need(b), after_need=_need(a),
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


def _fit_words(n: NeedDiff) -> str:
    return "fits" if n.fits else "out of memory"


def _short_fit(n: NeedDiff) -> str:
    return "fits" if n.fits else "OOM"


def role_title(s: ScenarioDiff) -> str:
    """The role, with the scenario each run had in it where they differ."""
    if s.before_scenario and s.after_scenario and s.before_scenario != s.after_scenario:
        return f"{s.name} ({s.before_scenario} → {s.after_scenario})"
    return s.name


def need_line(s: ScenarioDiff) -> str:
    """``cuda:0 6.79 GiB, out of memory → 6.31 GiB, fits``: the fullest GPU's need and
    whether it fits, before and after ("" where either run did not measure it)."""
    b, a = s.before_need, s.after_need
    if b is None or a is None:
        return ""
    where = b.label if b.label == a.label else f"{b.label} → {a.label}"
    return (f"{where} {fmt_bytes(b.need_bytes)}, {_fit_words(b)} → "
            f"{fmt_bytes(a.need_bytes)}, {_fit_words(a)}")


def _predicted(rd: RunDiff, s: ScenarioDiff) -> str:
    """For an alternative of the before run that is what the after run runs as written (a
    script before and after its suggested change): what it predicted against what the
    after run measured."""
    now = next((r for r in rd.scenarios if r.name == AS_WRITTEN), None)
    if (s.after_status is not None or now is None or now.after_scenario != s.name
            or s.before_need is None or now.after_need is None):
        return ""
    return (f"; it predicted what you run now: its fullest GPU needs "
            f"{fmt_bytes(s.before_need.need_bytes)}, measured now "
            f"{fmt_bytes(now.after_need.need_bytes)}")


def summary(rd: RunDiff) -> list[str]:
    """One line per role: what its fullest GPU needs and whether it fits, cuda:0's peak and
    excess, before → after."""
    lines = []
    for s in rd.scenarios:
        if s.before_status is None or s.after_status is None:
            which = "after" if s.before_status is None else "before"
            lines.append(f"{role_title(s)}: only in the {which} run" + _predicted(rd, s))
            continue
        need = need_line(s)
        head = f"{role_title(s)}: " + (f"{need}; allocated " if need else "")
        d0 = s.devices[0] if s.devices else None
        status = ""
        if s.before_status != s.after_status:
            status = f"; status {_status(s.before_status)} → {_status(s.after_status)}"
        if d0 is None or d0.delta_bytes is None:
            lines.append(f"{head}no measurement to compare{status}")
            continue
        exc = ""
        if s.before_excess_bytes is not None and s.after_excess_bytes is not None \
                and d0 is not None:
            exc = (f", excess over the others {_b(s.before_excess_bytes, True)} → "
                   f"{_b(s.after_excess_bytes, True)}")
        lines.append(
            f"{head}{d0.label} {_b(d0.before_bytes)} → {_b(d0.after_bytes)} "
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
        # the role (with the scenario each run had in it) wraps in a narrow terminal
        table.add_column(col, justify=j, no_wrap=col != "scenario",  # type: ignore[arg-type]
                         ratio=1 if col == "scenario" else None,
                         min_width=18 if col == "scenario" else None)
    for s in rd.scenarios:
        first = True
        rows = s.devices or (DeviceDiff("-", None, None),)
        for d in rows:
            delta = d.delta_bytes
            style = "" if delta is None or delta == 0 else ("green" if delta < 0 else "red")
            table.add_row(
                role_title(s).replace(" (", "\n(").replace(" → ", "\n→ ") if first else "",
                d.label, _b(d.before_bytes), _b(d.after_bytes),
                Text(_b(delta, True), style=style), Text(_pct(d), style=style),
            )
            first = False
        table.add_row("", Text("excess", style="dim"), _b(s.before_excess_bytes, True),
                      _b(s.after_excess_bytes, True), "", "", end_section=s.before_need is None
                      or s.after_need is None)
        if s.before_need is not None and s.after_need is not None:
            table.add_row("", Text("needs", style="dim"),
                          f"{_b(s.before_need.need_bytes)} {_short_fit(s.before_need)}",
                          f"{_b(s.after_need.need_bytes)} {_short_fit(s.after_need)}", "", "",
                          end_section=True)
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
            lines.append(f"| {md(role_title(s)) if k == 0 else ''} | {md(d.label)} | "
                         f"{_b(d.before_bytes)} | {_b(d.after_bytes)} | "
                         f"{_b(d.delta_bytes, True)} | {_pct(d)} |")
        lines.append(f"| | *{md(_excess_label(rd))}* | {_b(s.before_excess_bytes, True)} | "
                     f"{_b(s.after_excess_bytes, True)} | | |")
        if s.before_need is not None and s.after_need is not None:
            lines.append(f"| | *needs (fullest GPU)* | {_b(s.before_need.need_bytes)} "
                         f"{_fit_words(s.before_need)} | {_b(s.after_need.need_bytes)} "
                         f"{_fit_words(s.after_need)} | | |")
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
            xs[0].append(charts.plotly_text(role_title(s)))
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
            rows.append(f"<tr><td>{e(role_title(s)) if k == 0 else ''}</td><td class='l'>"
                        f"{e(d.label)}</td><td>{e(_b(d.before_bytes))}</td>"
                        f"<td>{e(_b(d.after_bytes))}</td><td{cls}>{e(_b(delta, True))}</td>"
                        f"<td{cls}>{e(_pct(d))}</td></tr>")
        rows.append(f"<tr><td></td><td class='l dim'>{e(_excess_label(rd))}</td>"
                    f"<td>{e(_b(s.before_excess_bytes, True))}</td>"
                    f"<td>{e(_b(s.after_excess_bytes, True))}</td><td></td><td></td></tr>")
        if s.before_need is not None and s.after_need is not None:
            rows.append(f"<tr><td></td><td class='l dim'>needs (fullest GPU)</td>"
                        f"<td>{e(_b(s.before_need.need_bytes))} {_fit_words(s.before_need)}"
                        f"</td><td>{e(_b(s.after_need.need_bytes))} "
                        f"{_fit_words(s.after_need)}</td><td></td><td></td></tr>")
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
