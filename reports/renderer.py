"""What every report format is: a name, the file suffix that picks it, and ``render``.

One class per format, each in its own module (``html.py``, ``markdown.py``, ``json.py``,
``terminal.py``); :mod:`dpprof.reports.formats` lists them by name and by file suffix.

The contract: a human format renders the one view of a result
(:class:`dpprof.reports.view.ReportView`, built once by
:func:`dpprof.reports.view_builder.build_view`) and nothing else, in :meth:`Renderer.render_view`;
so every format shows the same numbers under the same labels. JSON is the exception: it
writes the result itself (the saved session that ``dpprof report run.json`` renders again).
"""

from __future__ import annotations

from typing import ClassVar

from dpprof.reports.view import ReportView
from dpprof.reports.view_builder import build_view
from dpprof.result import RunResult


class Renderer:
    """A report format."""

    name: ClassVar[str]  # "html", "markdown", "json", "terminal"
    suffix: ClassVar[str | None]  # ".html" for -o run.html; None: not a file format
    description: ClassVar[str]  # one line for --help and error messages

    def render(self, run: RunResult) -> str:
        """The report as text: the view of ``run``, rendered."""
        return self.render_view(build_view(run))

    def render_view(self, view: ReportView) -> str:
        """The report of a view as text."""
        raise NotImplementedError
