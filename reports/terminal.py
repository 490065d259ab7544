"""Terminal: a rich table (one row per scenario, one column per GPU) and the verdict."""

from __future__ import annotations

import io

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from dpprof.reports import answers
from dpprof.reports.base import Renderer
from dpprof.result import STATUS_OK, STATUS_OOM, RunResult
from dpprof.units import fmt_bytes


def render(run: RunResult) -> Group:
    if run.watch is not None:  # `dpprof watch -- CMD`: its own view (reports/watch.py)
        from dpprof.reports.watch import render_terminal

        return render_terminal(run)
    title = (
        f"{run.workload} · batch {run.batch} · {run.gpus} GPUs of "
        f"{fmt_bytes(run.gpu_memory_bytes)} · {run.backend}"
    )
    # Text, not str: a workload or scenario name is shown as is, never read as rich markup.
    table = Table(title=Text(title), title_justify="left", header_style="bold",
                  box=box.SIMPLE_HEAD)
    table.add_column("scenario", no_wrap=True)
    for i in range(run.gpus):
        table.add_column(f"cuda:{i}", justify="right", no_wrap=True)
    table.add_column("cuda:0 excess", justify="right", no_wrap=True)
    table.add_column("max/mean", justify="right", no_wrap=True)
    table.add_column("status", no_wrap=True)
    for s in run.scenarios:
        cells: list[Text | str] = [Text(s.name)]
        for i in range(run.gpus):
            d = s.device(i)
            if d is None or not d.used or s.status not in (STATUS_OK, STATUS_OOM):
                cells.append(Text("-", style="dim"))
                continue
            over = d.peak_allocated_bytes > d.capacity_bytes > 0
            cells.append(Text(fmt_bytes(d.peak_allocated_bytes), style="bold red" if over else ""))
        c = run.comparison.scenarios.get(s.name)
        cells.append(fmt_bytes(c.primary_excess_bytes, signed=True) if c else "-")
        cells.append(f"{c.imbalance:.2f}" if c else "-")
        status = {STATUS_OK: Text("ok", style="green"), STATUS_OOM: Text("OOM", style="bold red")}
        cells.append(status.get(s.status, Text(s.status, style="red")))
        table.add_row(*cells)
    parts: list[Group | Table | Text] = [table]
    gpu = _gpu_table(run)
    if gpu is not None:
        parts.append(gpu)
    parts.append(Text(run.comparison.verdict, style="bold"))
    for s in run.scenarios:
        if s.message and s.status != STATUS_OK:
            parts.append(Text(f"{s.name}: {s.message}", style="red"))
        if s.traceback and s.status not in (STATUS_OK, STATUS_OOM):
            tail = s.traceback.rstrip().splitlines()[-6:]  # where the error is
            parts.append(Text("\n".join(f"  {line}" for line in tail), style="dim"))
        for note in s.notes:
            if "Traceback" not in note:
                parts.append(Text(f"{s.name}: {note}", style="dim"))
    parts += answers.terminal_parts(run)
    return Group(*parts)


def _gpu_table(run: RunResult) -> Group | None:
    """Allocated (above) is what the tensors hold; a GPU also reserves allocator segments
    and holds the context: shown separately, never folded into allocated."""
    rows = [s for s in run.scenarios if s.status in (STATUS_OK, STATUS_OOM)
            and any(d.peak_reserved_bytes is not None for d in s.devices)]
    if not rows:
        return None
    title = Text("on a GPU: reserved (allocator segments, cuBLAS workspaces included) + CUDA "
                 "context")  # a line of its own: a table's title wraps to the table's width
    table = Table(header_style="bold", box=box.SIMPLE_HEAD)
    table.add_column("scenario", no_wrap=True)
    for i in range(run.gpus):
        table.add_column(f"cuda:{i}", justify="right", no_wrap=True)
    for s in rows:
        cells: list[Text | str] = [s.name]
        for i in range(run.gpus):
            d = s.device(i)
            if d is None or not d.used or d.peak_reserved_bytes is None:
                cells.append(Text("-", style="dim"))
                continue
            text = f"{fmt_bytes(d.peak_reserved_bytes)} + {fmt_bytes(d.context_bytes or 0)}"
            over = d.total_peak_bytes > d.capacity_bytes > 0
            cells.append(Text(text, style="bold red" if over else ""))
        table.add_row(*cells)
    return Group(title, table)


class TerminalRenderer(Renderer):
    """The terminal view as plain text."""

    name = "terminal"
    suffix = None
    description = "The terminal view as plain text."

    def render(self, run: RunResult) -> str:
        from rich.console import Console

        console = Console(record=True, width=160, color_system=None, file=io.StringIO())
        console.print(render(run))
        return console.export_text()
