"""Every report format, by name and by file suffix (``-o run.html`` picks HTML)."""

from __future__ import annotations

from pathlib import Path

from dpprof.reports.renderer import Renderer


def renderers() -> dict[str, Renderer]:
    """Every format by name (imported on first use: the HTML one carries plotly.js)."""
    # deferred: plotly (the HTML format), imported only when a report is written
    from dpprof.reports.html import HtmlRenderer
    from dpprof.reports.json import JsonRenderer
    from dpprof.reports.markdown import MarkdownRenderer
    from dpprof.reports.terminal import TerminalRenderer

    found: list[Renderer] = [HtmlRenderer(), JsonRenderer(), MarkdownRenderer(),
                             TerminalRenderer()]
    return {r.name: r for r in found}


def file_suffixes() -> dict[str, Renderer]:
    """The file formats by suffix (``.html``, ``.json``, ``.md``)."""
    return {r.suffix: r for r in renderers().values() if r.suffix}


def for_path(path: Path) -> Renderer | None:
    """The format a report file's suffix asks for, or None."""
    return file_suffixes().get(path.suffix.lower())
