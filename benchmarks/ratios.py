"""What the ratio benchmarks share (``bench_run.py``, ``bench_ladder.py``): CPU seconds of a
call, the least of a few runs, and a ratio's summary over rounds against its goal."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

BEST_OF = 2  # each figure: the least of two runs (the cores are shared)


def cpu_s(fn: Callable[[], object], best_of: int = BEST_OF) -> float:
    """CPU seconds of ``fn()``, the least of ``best_of`` runs (each after a collection)."""
    times = []
    for _ in range(best_of):
        gc.collect()
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return min(times)


def summary(values: list[float], goal: float) -> dict[str, Any]:
    """A ratio over the rounds: median, min-max, every run, and whether the worst met the goal."""
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3), "runs": [round(v, 3) for v in values],
            "goal": f"<= {goal}", "met": max(values) <= goal}
