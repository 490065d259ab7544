"""Terminal: a rich table (one row per scenario, one column per GPU) and the verdict.

Renders the result's :class:`~dpprof.reports.view.ReportView` only.
"""

from __future__ import annotations

import io
import re

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from dpprof.reports import answer_sections
from dpprof.reports.renderer import Renderer
from dpprof.reports.sentences import percent, run_title, samples, step_time, times
from dpprof.reports.view import DeviceView, ReportView, ScenarioView
from dpprof.reports.view_builder import build_view
from dpprof.reports.watch_sections import render_terminal
from dpprof.result import RunResult
from dpprof.units import fmt_bytes, unit_for


def render(run: RunResult) -> Group:
    """The terminal view of ``run``."""
    return render_view(build_view(run))


def _cells(view: ReportView, s: ScenarioView) -> list[DeviceView | None]:
    """One cell per column of the table (None: nothing to show)."""
    return [s.cells[k] if k < len(s.cells) else None for k in range(len(view.columns))]


def render_view(view: ReportView) -> Group:
    if view.watch is not None:  # `dpprof watch -- CMD`: its own view (reports/watch_sections.py)

        return render_terminal(view)
    parts: list[RenderableType] = [_peak_table(view)]
    gpu = _gpu_table(view)
    if gpu is not None:
        parts.append(gpu)
    parts.append(Text(view.headline.verdict, style="bold"))  # or why there is none
    if view.speed_sentence:
        parts.append(Text(view.speed_sentence, style="bold"))
    timing = _timing_table(view)
    if timing is not None:
        parts.append(timing)
    for s in view.scenarios:
        if s.message and s.status != "ok":
            parts.append(Text(f"{s.name}: {s.message}", style="red"))
        if s.traceback_tail:
            parts.append(Text("\n".join(f"  {line}" for line in s.traceback_tail), style="dim"))
    # the run's own notes (why an alternative was not run, a synthetic result), then each
    # scenario's
    parts += [Text(note, style="dim") for note in (*view.run_notes, *_scenario_notes(view))]
    parts += _writes(view)
    parts += answer_sections.terminal_parts(view)
    return Group(*parts)


TERMINAL_WRITE_ROWS = 12  # the rest are in the JSON and HTML reports


def _writes(view: ReportView) -> list[RenderableType]:
    """What ``dpprof run``'s script wrote (into its private overlays), and the seal's
    check: loud where a file of the user's changed."""
    w = view.writes
    if w is None:
        return []
    parts: list[RenderableType] = [Text(w.summary, style="bold red" if w.changed else "dim")]
    parts += [Text(f"  {c}", style="red") for c in w.changed]
    if w.rows:
        table = _table(("run", "left"), ("path", "left"), ("size", "right"), ("", "left"),
                       narrow=True)
        # the note wraps, and a long path folds: at 80 columns, each kept on one line, the
        # note squeezed the run and the path down to an ellipsis each, and a checkpoint's
        # path ("out/checkpoint-3/pytorch_model_fsdp_0/.metadata") the note to "virtu…"
        table.columns[1].no_wrap = False
        table.columns[1].overflow = "fold"
        table.columns[-1].no_wrap = False
        table.columns[-1].min_width = 22
        for r in w.rows[:TERMINAL_WRITE_ROWS]:
            size = fmt_bytes(r.size_bytes) if r.kind in ("file", "link") else r.kind
            path = r.path + ("/" if r.kind == "folder" else "")
            table.add_row(r.run, path, size, r.note)
        parts.append(table)
    more = w.more + max(0, len(w.rows) - TERMINAL_WRITE_ROWS)
    if more:
        parts.append(Text(f"... and {more} more (every one in the JSON and HTML reports)",
                          style="dim"))
    return parts


# ---- fitting the width ------------------------------------------------------------------


class FirstThatFits:
    """The first of several layouts of one table whose natural width fits the console (the
    last one otherwise): wide terminals keep every GPU with its units, 80 columns get the
    units in the header, many GPUs cuda:0 against the others' min / median / max."""

    def __init__(self, *layouts: tuple[RenderableType, Table]) -> None:
        self.layouts = layouts  # (what to print, the table whose width decides)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        unbounded = options.update_width(UNBOUNDED)  # Measurement.get clamps to the width
        for shown, table in self.layouts[:-1]:
            if Measurement.get(console, unbounded, table).maximum <= options.max_width:
                yield shown
                return
        yield self.layouts[-1][0]


UNBOUNDED = 1_000_000  # columns: a table's natural width, unconstrained
def in_unit(n: int, size: int, signed: bool = False) -> str:
    """``n`` bytes as a number of ``size``-byte units, three significant digits: ``69.5``,
    ``0.40``, ``0``; a non-zero value too small to show is ``<0.01``."""
    sign = "-" if n < 0 else "+" if signed and n > 0 else ""
    v = abs(n) / size
    if v == 0:
        return "0" if not signed else "+0"
    if v < 0.005:
        return f"{sign}<0.01"
    digits = 0 if v >= 100 or size == 1 else 1 if v >= 10 else 2
    return f"{sign}{v:.{digits}f}"


def _table(*header: tuple[str, str], title: Text | None = None, narrow: bool = False
           ) -> Table:
    """A table of the terminal's style; ``header``: (label, "left" | "right") per column. No
    cell wraps (a label may hold its own line break). ``narrow``: columns two spaces apart,
    not three."""
    table = Table(title=title, title_justify="left", header_style="bold",
                  box=box.SIMPLE_HEAD, padding=(0, 0, 0, 1) if narrow else (0, 1))
    for label, justify in header:
        table.add_column(label, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    return table


def _head(label: str) -> str:
    """A GPU's column label for a narrow table: the host on a line of its own
    (``node-a/`` over ``cuda:0``)."""
    return label.replace("/", "/\n")


def _status(s: ScenarioView) -> Text:
    style = {"ok": "green", "OOM": "bold red"}.get(s.status_label, "red")
    return Text(s.status_label, style=style)


def _spread(devices: list[DeviceView | None], key: str = "peak_allocated_bytes"
            ) -> list[DeviceView | None]:
    """The GPUs after the first with the least, the median and the most ``key``."""
    others = sorted((d for d in devices[1:] if d is not None and getattr(d, key) is not None),
                    key=lambda d: getattr(d, key))
    if not others:
        return [None, None, None]
    return [others[0], others[len(others) // 2], others[-1]]


def _peak_table(view: ReportView) -> FirstThatFits:
    """Peak allocated per GPU per scenario, with cuda:0's excess and max/mean."""
    title = Text(run_title(view))  # Text: a name is shown as is, never read as markup
    rows = [(s, _cells(view, s)) for s in view.scenarios]
    peaks = [d.peak_allocated_bytes for _, cells in rows for d in cells if d is not None]
    excesses = [s.excess_bytes for s, _ in rows if s.excess_bytes is not None]
    unit, size = unit_for(peaks + excesses)

    def cell(d: DeviceView | None, text: str | None = None) -> Text:
        if d is None:
            return Text("-", style="dim")
        shown = text if text is not None else fmt_bytes(d.peak_allocated_bytes)
        return Text(shown, style="bold red" if d.over_capacity else "")

    def tail(s: ScenarioView, condensed: bool) -> list[Text | str]:
        if s.excess_bytes is None:
            excess = "-"
        else:
            excess = (in_unit(s.excess_bytes, size, signed=True) if condensed
                      else fmt_bytes(s.excess_bytes, signed=True))
        return [excess, "-" if s.imbalance is None else f"{s.imbalance:.2f}", _status(s)]

    def value(d: DeviceView | None) -> Text:
        return cell(d, in_unit(d.peak_allocated_bytes, size)) if d is not None else cell(None)

    # every GPU, each cell with its unit
    full = _table(("scenario", "left"), *((c, "right") for c in view.columns),
                  (f"{view.primary} excess", "right"), ("max/mean", "right"), ("status", "left"),
                  title=title)
    for s, cells in rows:
        full.add_row(Text(s.name), *(cell(d) for d in cells), *tail(s, False))
    # every GPU, one unit for the table, in its title
    title_in_unit = Text(f"{run_title(view)} · peak allocated in {unit}")
    short = _table(("scenario", "left"), *((_head(c), "right") for c in view.columns),
                   (f"{view.primary}\nexcess", "right"), ("max/mean", "right"), ("status", "left"),
                   title=title_in_unit, narrow=True)
    for s, cells in rows:
        short.add_row(Text(s.name), *(value(d) for d in cells), *tail(s, True))
    # cuda:0, and the other GPUs' min / median / max
    spread = _table(("scenario", "left"), (_head(view.columns[0]) if view.columns
                                          else "cuda:0", "right"),
                    ("others\nmin", "right"), ("\nmedian", "right"), ("\nmax", "right"),
                    (f"{view.primary}\nexcess", "right"), ("max/mean", "right"), ("status", "left"),
                    title=title_in_unit, narrow=True)
    for s, cells in rows:
        spread.add_row(Text(s.name), *(value(d) for d in [cells[0] if cells else None,
                                                          *_spread(cells)]), *tail(s, True))
    return FirstThatFits((full, full), (short, short), (spread, spread))


def _scenario_notes(view: ReportView) -> list[str]:
    """Each scenario's notes, a note several scenarios share once, after their names; the
    kernels each one picked, which differ only in their counts, once for all, in one line:
    "kernels as on sm_80: dropout:fused, ..." (the counts per scenario are in the reports'
    notes)."""
    said: dict[str, list[str]] = {}  # note -> the scenarios that have it, in order
    kernels: dict[str, dict[str, list[str]]] = {}  # capability -> op -> variants
    for s in view.scenarios:
        for note in s.notes:
            m = KERNEL_NOTE.fullmatch(note)
            if m is None:
                said.setdefault(note, []).append(s.name)
                continue
            ops = kernels.setdefault(m.group(1), {})
            for choice in m.group(2).split(", "):
                op, _, variant = choice.rsplit(" x", 1)[0].partition(":")
                if variant not in ops.setdefault(op, []):
                    ops[op].append(variant)
    lines = [f"{', '.join(names)}: {note}" for note, names in said.items()]
    for cc, ops in kernels.items():
        picked = ", ".join(f"{op}:{'/'.join(v)}" if any(v) else op for op, v in ops.items())
        major, minor = cc.split(".")
        lines.append(f"kernels as on sm_{major}{minor}: {picked}")
    return lines


# the emulator's note of the kernels a scenario chose (dpprof.backends.emulated)
KERNEL_NOTE = re.compile(r"kernels as on a GPU of compute capability (\d+\.\d+): "
                         r"((?:[\w.]+(?::[\w.]+)? x\d+)(?:, [\w.]+(?::[\w.]+)? x\d+)*)")


def _gpu_table(view: ReportView) -> RenderableType | None:
    """Allocated (above) is what the tensors hold; a GPU also reserves allocator segments
    and holds the context: shown separately, never folded into allocated."""
    rows = [(s, _cells(view, s)) for s in view.scenarios if s.measured and s.has_reserved]
    if not rows:
        return None
    what = "on a GPU: reserved (allocator segments, cuBLAS workspaces included)"
    devices = [d for _, cells in rows for d in cells
               if d is not None and d.peak_reserved_bytes is not None]
    contexts = {d.context_bytes or 0 for d in devices}
    unit, size = unit_for([d.peak_reserved_bytes or 0 for d in devices])
    one_context = len(contexts) == 1

    def cell(d: DeviceView | None, condensed: bool) -> Text:
        if d is None or d.peak_reserved_bytes is None:
            return Text("-", style="dim")
        if not condensed:
            text = f"{fmt_bytes(d.peak_reserved_bytes)} + {fmt_bytes(d.context_bytes or 0)}"
        elif one_context:
            text = in_unit(d.peak_reserved_bytes, size)
        else:
            text = (f"{in_unit(d.peak_reserved_bytes, size)}+"
                    f"{in_unit(d.context_bytes or 0, size)}")
        return Text(text, style="bold red" if d.total_over_capacity else "")

    nccl = {d.nccl_bytes for d in devices if d.nccl_bytes}
    # DDP's ranks and DataParallel's GPUs hold NCCL communicators, of different sizes
    context = "CUDA context" + (f" (+ {fmt_bytes(nccl.pop())} for NCCL's communicators)"
                                if len(nccl) == 1 else " (+ NCCL's communicators)" if nccl else "")
    # a line of its own: a table's title wraps to the table's width
    full_title = Text(f"{what} + {context}")
    short_title = Text(
        f"{what} in {unit}, + the CUDA context ({fmt_bytes(contexts.pop())} on each GPU)"
        if one_context else f"{what} + {context}, in {unit}")
    full = _table(("scenario", "left"), *((c, "right") for c in view.columns))
    short = _table(("scenario", "left"), *((_head(c), "right") for c in view.columns),
                   narrow=True)
    spread = _table(("scenario", "left"), (_head(view.columns[0]) if view.columns
                                          else "cuda:0", "right"),
                    ("others\nmin", "right"), ("\nmedian", "right"), ("\nmax", "right"),
                    narrow=True)
    for s, cells in rows:
        full.add_row(s.name, *(cell(d, False) for d in cells))
        short.add_row(s.name, *(cell(d, True) for d in cells))
        spread.add_row(s.name, *(cell(d, True) for d in [
            cells[0] if cells else None, *_spread(cells, "peak_reserved_bytes")]))
    return FirstThatFits((Group(full_title, full), full), (Group(short_title, short), short),
                         (Group(short_title, spread), spread))


def _timing_table(view: ReportView) -> RenderableType | None:
    """Each scenario's step time (predicted: marked so; measured beside it on real GPUs),
    its speed-up over one GPU, and how busy cuda:0 and the busiest other GPU are."""
    rows = [t for t in view.timings if t.predicted_step_s is not None]
    if not rows:
        return None
    measured = any(t.measured_step_s is not None for t in rows)
    table = _table(("scenario", "left"), ("step*", "right"), ("samples/s*", "right"),
                   ("x 1 GPU*", "right"), *((("measured", "right"),) if measured else ()),
                   (f"busy: {view.primary}*", "right"), ("others*", "right"),
                   title=Text("step time (* predicted without a GPU)"), narrow=True)
    for t in rows:
        step = t.predicted_step_s or 0.0
        busy = [b.busy_s / step if step else 0.0 for b in t.busy]
        others = busy[1:]
        table.add_row(
            t.scenario, step_time(t.predicted_step_s), samples(t.predicted_samples_per_s),
            times(t.speedup_predicted),
            *((step_time(t.measured_step_s) if t.measured_step_s is not None else "-",)
              if measured else ()),
            percent(busy[0]) if busy else "-",
            f"{percent(min(others))}-{percent(max(others))}" if others else "-")
    return table


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
