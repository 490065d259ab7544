"""What every command shares: the consoles, output paths, writing reports, one error line."""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path

import typer
from rich.console import Console

from dpprof.errors import DpprofError, UsageError
from dpprof.reports.escape import terminal_text
from dpprof.reports.registry import file_suffixes, for_path, renderers
from dpprof.result import RunResult, write_atomic
from dpprof.scenarios.base import SCENARIOS

# User text is data: no console markup or :emoji: codes is ever read from what dpprof prints.
err = Console(stderr=True, highlight=False, markup=False, emoji=False)
# Piped output gets room for a table of 8 GPUs instead of rich's 80 columns.
out = Console(highlight=False, markup=False, emoji=False,
              width=None if sys.stdout.isatty() else 140)

DEFAULT_DIR = Path("dpprof-reports")


def fail(e: Exception, debug: bool) -> typer.Exit:
    if debug:
        err.print(traceback.format_exc(), markup=False)
    code = e.exit_code if isinstance(e, DpprofError) else 1
    err.print(f"dpprof: error: {terminal_text(str(e))}", markup=False, soft_wrap=True)
    return typer.Exit(code=code)




def output_paths(outputs: Sequence[Path | str] | None, stem: str) -> list[tuple[Path, str]]:
    if not outputs:
        return [(DEFAULT_DIR / f"{stem}.html", "html"), (DEFAULT_DIR / f"{stem}.json", "json")]
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
        p = Path(text)
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
    """Fail before measuring, not after, when a report cannot be written."""
    for p, _ in paths:
        parent = p.parent if str(p.parent) else Path(".")
        if p.is_dir():
            raise UsageError(f"--output {terminal_text(str(p))} is a directory; give a file name "
                             f"such as {terminal_text(str(p))}/run.html")
        try:
            parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".dpprof-check-", dir=parent)
            os.close(fd)
            os.unlink(tmp)
        except OSError as e:
            raise UsageError(
                f"cannot write reports to {terminal_text(str(parent))}/ ({e.strerror or e}); "
                "choose another "
                "place with -o/--output"
            ) from e


def render_to(run: RunResult, fmt: str) -> str:
    """``run`` in the format named ``fmt`` (:mod:`dpprof.reports.registry`)."""
    return renderers()[fmt].render(run)


def write_reports(run: RunResult, paths: list[tuple[Path, str]], quiet: bool) -> list[Path]:
    written = []
    failures = []
    for p, fmt in paths:
        try:
            written.append(write_atomic(p, render_to(run, fmt)))
        except OSError as e:
            failures.append(f"{p}: {e.strerror or e}")
    for w in written:
        if not quiet:
            out.print(f"wrote {terminal_text(str(w))}", soft_wrap=True)
    if failures:
        raise DpprofError("could not write " + "; ".join(failures))
    return written


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
