"""JSON: the result itself (``dpprof report run.json`` reads it back)."""

from __future__ import annotations

from dpprof.reports.base import Renderer
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
