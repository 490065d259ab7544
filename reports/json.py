"""JSON: the result itself (``dpprof report run.json`` reads it back)."""

from __future__ import annotations

from dpprof.result import RunResult


def render(run: RunResult) -> str:
    return run.to_json() + "\n"
