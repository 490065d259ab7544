"""What every command shares: the consoles, output paths, writing reports, one error line."""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from dpprof.errors import DpprofError, Interrupted, UsageError, WorkloadError
from dpprof.reports.escape import for_files, terminal_text, without_host
from dpprof.reports.formats import file_suffixes, for_path, renderers
from dpprof.result import RunResult
from dpprof.saved_result import write_atomic
from dpprof.scenarios.registry import SCENARIOS

if TYPE_CHECKING:
    from dpprof.scenarios.workloads import Workload

# User text is data: no console markup or :emoji: codes is ever read from what dpprof prints.
err = Console(stderr=True, highlight=False, markup=False, emoji=False)
# piped output without COLUMNS: a terminal's classic width (the tables fit it: the units move
# to the header, many GPUs become cuda:0 against the others' min / median / max)
PIPED_WIDTH = 80
out = Console(highlight=False, markup=False, emoji=False,
              width=None if sys.stdout.isatty() else PIPED_WIDTH)

DEFAULT_DIR = Path("dpprof-reports")
# What each resolved report path is called on the terminal: the path as the user gave it
# (or the default's relative path), not the absolute one it was resolved to.
_shown: dict[Path, str] = {}


def output_width(environ: dict[str, str] | None = None, tty: bool | None = None) -> int | None:
    """stdout's width: ``COLUMNS`` when set (piped or not), the terminal's on a terminal
    (None: rich asks it), else :data:`PIPED_WIDTH`."""
    env = os.environ if environ is None else environ
    columns = env.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    if sys.stdout.isatty() if tty is None else tty:
        return None
    return PIPED_WIDTH


def fit_output_width() -> None:
    """Set :data:`out`'s width for this command (the environment of this invocation)."""
    width = output_width()
    if width is not None:
        out.width = width


def fail(e: Exception, debug: bool) -> typer.Exit:
    if debug:
        err.print(traceback.format_exc(), markup=False)
    code = e.exit_code if isinstance(e, DpprofError) else 1
    err.print(f"dpprof: error: {terminal_text(str(e))}", markup=False, soft_wrap=True)
    return typer.Exit(code=code)




def _resolved(p: Path, shown: str) -> Path:
    """``p`` made absolute now, before the workload runs (it may change directory)."""
    full = Path(os.path.abspath(p))
    _shown[full] = shown
    return full


def shown_path(p: Path) -> str:
    """A report path as the user named it."""
    return _shown.get(p, str(p))


def output_paths(outputs: Sequence[Path | str] | None, stem: str) -> list[tuple[Path, str]]:
    """Each report's absolute path and format: the ``-o`` files, else the default HTML and
    JSON in ``./dpprof-reports/``."""
    if not outputs:
        return [(_resolved(DEFAULT_DIR / f"{stem}.{ext}", str(DEFAULT_DIR / f"{stem}.{ext}")),
                 ext) for ext in ("html", "json")]
    result: list[tuple[Path, str]] = []
    for given in outputs:
        text = str(given)
        if not text.strip():
            raise UsageError("--output is empty; give a file name such as run.html")
        if text.endswith(("/", os.sep)) or Path(text).name in ("", ".", ".."):
            raise UsageError(
                f"--output {terminal_text(text)} names a directory; give a file name such as "
                f"{terminal_text(text.rstrip('/' + os.sep) or '.')}/run.html"
            )
        if "\x00" in text:
            raise UsageError(f"--output {terminal_text(text)}: a file name cannot hold NUL")
        p = _resolved(Path(text), text)
        if any(p == q for q, _ in result):
            raise UsageError(f"--output {terminal_text(text)} given twice")
        renderer = for_path(p)
        if renderer is None:
            raise UsageError(
                f"--output {terminal_text(text)}: unknown format "
                f"{terminal_text(p.suffix) or '(no suffix)'}; end the path "
                f"with one of {', '.join(file_suffixes())}"
            )
        result.append((p, renderer.name))
    return result


def check_writable(paths: list[tuple[Path, str]]) -> None:
    """Fail before measuring, not after, when a report cannot be written. Creates nothing:
    the directory a report goes to is made when the report is written, so a run that
    measures nothing leaves no empty ``dpprof-reports/`` behind."""
    for p, _ in paths:
        shown = terminal_text(shown_path(p))
        if p.is_dir():
            raise UsageError(f"--output {shown} is a directory; give a file name such as "
                             f"{shown}/run.html")
        parent = p.parent
        existing = parent
        while not existing.exists() and existing.parent != existing:
            existing = existing.parent  # the directories below it are made on writing
        where = terminal_text(str(parent))
        try:
            if not existing.is_dir():
                raise NotADirectoryError(20, "Not a directory")
            fd, tmp = tempfile.mkstemp(prefix=".dpprof-check-", dir=existing)
            os.close(fd)
            os.unlink(tmp)
        except OSError as e:
            raise UsageError(
                f"cannot write reports to {where}/ ({e.strerror or e}); choose another "
                "place with -o/--output"
            ) from e


def render_to(run: RunResult, fmt: str, include_host: bool = False) -> str:
    """``run`` in the format named ``fmt`` (:mod:`dpprof.reports.formats`), in every format
    without the machine's identity (host names, GPU UUIDs, PCI bus ids) unless
    ``include_host``: a report or a result is made to be shared. A human format gets the run
    with control characters stripped from its strings."""
    public = run if include_host else without_host(run)
    if fmt == "json":  # the result itself; JSON escapes control characters
        return renderers()[fmt].render(public)
    return renderers()[fmt].render(for_files(public))


def write_reports(run: RunResult, paths: list[tuple[Path, str]], quiet: bool,
                  include_host: bool = False) -> list[Path]:
    written = []
    failures = []
    for p, fmt in paths:
        try:
            written.append(write_atomic(p, render_to(run, fmt, include_host)))
        except OSError as e:
            failures.append(f"{p}: {e.strerror or e}")
    for w in written:
        if not quiet:
            out.print(f"wrote {terminal_text(shown_path(w))}", soft_wrap=True)
    if failures:
        raise DpprofError("could not write " + "; ".join(failures))
    return written


def progress_bar(counter: str, console: Console, redirect: bool = True) -> Progress:
    """The commands' progress bar on ``console`` (stderr), gone when done: a spinner, the
    step's description, a bar, ``counter`` (a rich format of the task) and the time taken.
    ``redirect``: rich's redirection of stdout and stderr above the bar (``dpprof run``
    keeps a script's streams its own way: :mod:`dpprof.cli.live_output`)."""
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    TextColumn(counter), TimeElapsedColumn(), console=console, transient=True,
                    redirect_stdout=redirect, redirect_stderr=redirect)


def load_user_workload(spec: str) -> Workload:
    """:func:`dpprof.scenarios.workloads.load_workload`, where a workload whose factory
    raises a ``BaseException`` that is not an ``Exception`` (nor an interrupt or an exit) is
    the usage error any other raising factory is."""
    try:
        from dpprof.scenarios.workloads import load_workload  # torch: not for dpprof report

        return load_workload(spec)
    except (Exception, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:
        if isinstance(e, Interrupted):
            raise
        raise WorkloadError(f"workload {spec!r}: raised {type(e).__name__}: {e}") from e


def parse_scenarios(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown or not names:
        raise UsageError(
            f"--scenarios {terminal_text(repr(text))}: unknown "
            f"{terminal_text(', '.join(unknown)) or '(empty)'}; "
            f"choose from {', '.join(SCENARIOS)} (comma-separated)"
        )
    twice = sorted({s for s in names if names.count(s) > 1}, key=names.index)
    if twice:
        raise UsageError(f"--scenarios {text!r}: {', '.join(twice)} given more than once; "
                         "name each scenario once")
    return names
