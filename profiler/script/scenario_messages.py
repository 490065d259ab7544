"""The words of a script run's scenario where it ended badly: an error's first line, and
the GPU's out-of-memory error raised in the run (:mod:`dpprof.emulator.oom_guard`), caught by
nobody, with the need measured past it."""

from __future__ import annotations

import dataclasses

from dpprof.emulator.oom_guard import OutOfMemoryRaised
from dpprof.result import STATUS_ERROR, STATUS_OOM, ScenarioResult

__all__ = ["headline", "past_the_oom", "stopped_by_oom"]

_HEADLINE_CHARS = 300  # of an error's message, in the report's headline


def headline(text: str) -> str:
    """``": "`` and the first line of an error's message (torch's CheckpointException holds
    each rank's traceback; the report's traceback keeps the whole), or nothing."""
    lines = text.strip().splitlines()
    if not lines:
        return ""
    first = lines[0].strip()
    if len(first) > _HEADLINE_CHARS:
        first = first[:_HEADLINE_CHARS].rstrip() + "..."
    return f": {first}" + (" (more in the traceback)" if len(lines) > 1 else "")


def stopped_by_oom(s: ScenarioResult, raised: OutOfMemoryRaised,
                   traceback: str | None) -> ScenarioResult:
    """``s`` out of memory where the run raised it and the script did not catch it."""
    return dataclasses.replace(s, status=STATUS_OOM, oom_device=raised.device,
                               oom_bytes=raised.allocated_bytes + raised.requested_bytes,
                               message=f"out of memory: {raised.words()}", traceback=traceback)


def past_the_oom(s: ScenarioResult, stopped: OutOfMemoryRaised) -> ScenarioResult:
    """The scenario of a run past the out-of-memory error a GPU stops the script at (and
    the script did not catch): out of memory there, with what it needs from the run past
    it."""
    where = (f"on a GPU the script stops at {stopped.words()}, which it does not catch; "
             "run on past it here to measure what it needs")
    if s.status == STATUS_OOM:
        return dataclasses.replace(s, message=f"{s.message}; {where}")
    if s.status == STATUS_ERROR:
        return dataclasses.replace(s, notes=(*s.notes, where))
    return dataclasses.replace(
        s, status=STATUS_OOM, oom_device=stopped.device,
        oom_bytes=stopped.allocated_bytes + stopped.requested_bytes,
        message=f"out of memory: {where}")
