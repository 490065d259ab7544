"""What every report format is: a name, the file suffix that picks it, and ``render``.

One class per format, each in its own module (``html.py``, ``markdown.py``, ``json.py``,
``terminal.py``); :mod:`dpprof.reports.registry` lists them. Every renderer reads the same
result, through the shared view of :mod:`dpprof.reports.common` (attribution, recommended
fixes, OOM lines, provenance), so the formats say the same things.
"""

from __future__ import annotations

from typing import ClassVar

from dpprof.result import RunResult


class Renderer:
    """A report format."""

    name: ClassVar[str]  # "html", "markdown", "json", "terminal"
    suffix: ClassVar[str | None]  # ".html" for -o run.html; None: not a file format
    description: ClassVar[str]  # one line for --help and error messages

    def render(self, run: RunResult) -> str:
        """The report as text."""
        raise NotImplementedError
