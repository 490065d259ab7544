"""An emulated rank's allocations, split as the checks against torch.profiler compare them."""

from __future__ import annotations

from typing import Any

from dpprof.backends.memtrace import SCALAR_BYTES
from dpprof.emulator.dispatch_state import HOST


def live_at_start_and_step(trace: dict[str, Any]) -> tuple[int, list[int]]:
    """From ``run_scenario``'s ``trace`` (rank 0's device and the host, blocks over a
    scalar): the bytes live when the measured step began, and the step's signed sizes."""
    events = trace["rt"].storages.events
    kept = [e.requested for e in events[:trace["step_end"]]
            if e.device in (0, HOST) and abs(e.requested) > SCALAR_BYTES]
    n_before = len([e for e in events[:trace["step_start"]]
                    if e.device in (0, HOST) and abs(e.requested) > SCALAR_BYTES])
    return sum(kept[:n_before]), kept[n_before:]
