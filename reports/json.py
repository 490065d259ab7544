"""JSON: the result itself, not a view of it (``dpprof report run.json`` reads it back and
renders it again in any format): the one format that bypasses
:class:`dpprof.reports.view.ReportView`."""

from __future__ import annotations

from dpprof.reports.renderer import Renderer
from dpprof.reports.view import ReportView
from dpprof.result import RunResult


def render(run: RunResult) -> str:
    return run.to_json() + "\n"


class JsonRenderer(Renderer):
    """The result itself (dpprof report reads it back)."""

    name = "json"
    suffix = '.json'
    description = "The result itself (dpprof report reads it back)."

    def render(self, run: RunResult) -> str:
        return render(run)

    def render_view(self, view: ReportView) -> str:
        raise TypeError("JSON is the result itself, not a view: call render(run)")
