"""Terminal: a rich table (one row per scenario, one column per GPU) and the verdict.

Renders the result's :class:`~dpprof.reports.view.ReportView` only.
"""

from __future__ import annotations

import io

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from dpprof.reports import answers
from dpprof.reports.base import Renderer
from dpprof.reports.common import run_title
from dpprof.reports.view import DeviceView, ReportView, ScenarioView, build_view
from dpprof.result import RunResult
from dpprof.units import fmt_bytes


def render(run: RunResult) -> Group:
    """The terminal view of ``run``."""
    return render_view(build_view(run))


def _cells(view: ReportView, s: ScenarioView) -> list[DeviceView | None]:
    """One cell per column of the table (None: nothing to show)."""
    return [s.cells[k] if k < len(s.cells) else None for k in range(len(view.columns))]


def render_view(view: ReportView) -> Group:
    if view.watch is not None:  # `dpprof watch -- CMD`: its own view (reports/watch.py)
        from dpprof.reports.watch import render_terminal

        return render_terminal(view)
    # Text, not str: a workload or scenario name is shown as is, never read as rich markup.
    table = Table(title=Text(run_title(view)), title_justify="left", header_style="bold",
                  box=box.SIMPLE_HEAD)
    table.add_column("scenario", no_wrap=True)
    for label in view.columns:
        table.add_column(label, justify="right", no_wrap=True)
    table.add_column("cuda:0 excess", justify="right", no_wrap=True)
    table.add_column("max/mean", justify="right", no_wrap=True)
    table.add_column("status", no_wrap=True)
    for s in view.scenarios:
        cells: list[Text | str] = [Text(s.name)]
        for d in _cells(view, s):
            if d is None:
                cells.append(Text("-", style="dim"))
                continue
            cells.append(Text(fmt_bytes(d.peak_allocated_bytes),
                              style="bold red" if d.over_capacity else ""))
        cells.append("-" if s.excess_bytes is None else fmt_bytes(s.excess_bytes, signed=True))
        cells.append("-" if s.imbalance is None else f"{s.imbalance:.2f}")
        style = {"ok": "green", "OOM": "bold red"}.get(s.status_label, "red")
        cells.append(Text(s.status_label, style=style))
        table.add_row(*cells)
    parts: list[Group | Table | Text] = [table]
    gpu = _gpu_table(view)
    if gpu is not None:
        parts.append(gpu)
    parts.append(Text(view.headline.verdict, style="bold"))  # or why there is none
    for s in view.scenarios:
        if s.message and s.status != "ok":
            parts.append(Text(f"{s.name}: {s.message}", style="red"))
        if s.traceback_tail:
            parts.append(Text("\n".join(f"  {line}" for line in s.traceback_tail), style="dim"))
        for note in s.notes:
            parts.append(Text(f"{s.name}: {note}", style="dim"))
    parts += answers.terminal_parts(view)
    return Group(*parts)


def _gpu_table(view: ReportView) -> Group | None:
    """Allocated (above) is what the tensors hold; a GPU also reserves allocator segments
    and holds the context: shown separately, never folded into allocated."""
    rows = [s for s in view.scenarios if s.measured and s.has_reserved]
    if not rows:
        return None
    title = Text("on a GPU: reserved (allocator segments, cuBLAS workspaces included) + CUDA "
                 "context")  # a line of its own: a table's title wraps to the table's width
    table = Table(header_style="bold", box=box.SIMPLE_HEAD)
    table.add_column("scenario", no_wrap=True)
    for label in view.columns:
        table.add_column(label, justify="right", no_wrap=True)
    for s in rows:
        cells: list[Text | str] = [s.name]
        for d in _cells(view, s):
            if d is None or d.peak_reserved_bytes is None:
                cells.append(Text("-", style="dim"))
                continue
            text = f"{fmt_bytes(d.peak_reserved_bytes)} + {fmt_bytes(d.context_bytes or 0)}"
            cells.append(Text(text, style="bold red" if d.total_over_capacity else ""))
        table.add_row(*cells)
    return Group(title, table)


class TerminalRenderer(Renderer):
    """The terminal view as plain text."""

    name = "terminal"
    suffix = None
    description = "The terminal view as plain text."

    def render_view(self, view: ReportView) -> str:
        from rich.console import Console

        console = Console(record=True, width=160, color_system=None, file=io.StringIO())
        console.print(render_view(view))
        return console.export_text()
