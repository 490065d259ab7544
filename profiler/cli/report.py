"""``dpprof report``: re-render a saved result, or compare two.

    dpprof report run.json -o run.md
    dpprof report before.json after.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from dpprof.cli.common import check_writable, out, output_paths, shown_path, write_reports
from dpprof.cli.guard import guarded
from dpprof.cli.options import INCLUDE_HOST
from dpprof.errors import DpprofError, UsageError
from dpprof.reports import diff, terminal
from dpprof.reports.escape import for_files, for_terminal, terminal_text, without_host
from dpprof.result import RunResult
from dpprof.saved_result import load, validate, write_atomic
from dpprof.watch.analysis import load_run

# the files dpprof renders from a result: what `report` writes, not what it reads
RENDERED_SUFFIXES = (".md", ".html", ".htm", ".markdown")


def _load_any(path: Path) -> RunResult:
    """A saved result, or a `dpprof watch` samples file (maybe cut short)."""
    if path.suffix.lower() in RENDERED_SUFFIXES:
        beside = path.with_suffix(".json")
        hint = (f"pass {terminal_text(str(beside))}" if beside.is_file() else
                "pass the .json written beside it (dpprof writes one by default, or with "
                "-o run.json)")
        raise UsageError(f"{terminal_text(str(path))} is a rendered report, which dpprof "
                         f"cannot read back; {hint}")
    if path.suffix == ".jsonl":
        # validated as a saved result is: renderers get only what the model allows
        return validate(json.loads(load_run(path).to_json()), str(path))
    return load(path)


def report_cmd(
    results: Annotated[
        list[Path],
        typer.Argument(
            help="A result saved by dpprof (JSON); give two (before.json after.json) to "
            "compare them.",
            show_default=False,
        ),
    ],
    output: Annotated[
        list[str] | None,  # str: a trailing '/' survives to be refused
        typer.Option(
            "--output", "-o", metavar="FILE",
            help="Write these files instead of printing; the suffix picks the format (.html, "
            ".md, and .json for a single result).",
        ),
    ] = None,
    include_host: Annotated[bool, INCLUDE_HOST] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    """Re-render a saved result without running anything, or compare two.

    Example: dpprof report run.json -o run.md; dpprof report before.json after.json
    """
    with guarded(debug):
        if len(results) > 2:
            raise UsageError(
                f"report takes one result, or two to compare (before after); got {len(results)}"
            )
        paths = output_paths(output, "report") if output else []
        runs = [_load_any(r) for r in results]
        if len(runs) == 1:
            if not paths:
                out.print(terminal.render(for_terminal(runs[0])))
                return
            check_writable(paths)
            write_reports(runs[0], paths, quiet=False, include_host=include_host)
            return

        files = [for_files(r) for r in runs]  # no control characters in a file
        public = files if include_host else [without_host(r) for r in files]
        trd = diff.diff(for_terminal(runs[0]), for_terminal(runs[1]))
        if not paths:
            out.print(diff.render_terminal(trd))
            return
        renderers = {"html": diff.render_html, "markdown": diff.render_markdown}
        for p, fmt in paths:
            if fmt not in renderers:
                raise UsageError(
                    f"--output {terminal_text(shown_path(p))}: a comparison of two results is "
                    "written as .html or .md"
                )
        check_writable(paths)
        for p, fmt in paths:
            try:
                pair = public if fmt == "markdown" else files  # for a public issue
                write_atomic(p, renderers[fmt](diff.diff(pair[0], pair[1])))
            except OSError as e:
                raise DpprofError(f"could not write {shown_path(p)}: {e.strerror or e}") from e
            out.print(f"wrote {terminal_text(shown_path(p))}", soft_wrap=True)
