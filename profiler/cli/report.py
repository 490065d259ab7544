"""``dpprof report``: re-render a saved result, or compare two.

    dpprof report run.json -o run.md
    dpprof report before.json after.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from dpprof.cli.common import check_writable, out, output_paths, write_reports
from dpprof.cli.guard import guarded
from dpprof.errors import DpprofError, UsageError
from dpprof.reports.escape import for_terminal, terminal_text
from dpprof.result import RunResult, load, validate, write_atomic


def _load_any(path: Path) -> RunResult:
    """A saved result, or a `dpprof watch` samples file (maybe cut short)."""
    if path.suffix == ".jsonl":
        from dpprof.watch.monitor import load_run

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
            "--output", "-o",
            help="Write these files instead of printing; the suffix picks the format (.html, "
            ".md, and .json for a single result).",
        ),
    ] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    """Re-render a saved result without running anything, or compare two.

    Example: dpprof report run.json -o run.md; dpprof report before.json after.json
    """
    from dpprof.reports import terminal

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
            write_reports(runs[0], paths, quiet=False)
            return
        from dpprof.reports import diff

        rd = diff.diff(runs[0], runs[1])
        trd = diff.diff(for_terminal(runs[0]), for_terminal(runs[1]))
        if not paths:
            out.print(diff.render_terminal(trd))
            return
        renderers = {"html": diff.render_html, "markdown": diff.render_markdown}
        for p, fmt in paths:
            if fmt not in renderers:
                raise UsageError(
                    f"--output {p}: a comparison of two results is written as .html or .md"
                )
        check_writable(paths)
        for p, fmt in paths:
            try:
                write_atomic(p, renderers[fmt](rd))
            except OSError as e:
                raise DpprofError(f"could not write {p}: {e.strerror or e}") from e
            out.print(f"wrote {terminal_text(str(p))}", soft_wrap=True)
