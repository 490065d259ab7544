"""What the ratio benchmarks share (``bench_run.py``, ``bench_ladder.py``; ``bench_emulator.py``
takes its CPU seconds from here): CPU seconds of a call, the least of a few runs, the rounds
measured side by side, a ratio's summary over rounds against its goal, and the record's
head."""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
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


def rounds(cases: Mapping[str, tuple[Callable[[], object], Callable[[], object]]],
           repeat: int) -> tuple[dict[str, list[float]], dict[str, list[tuple[float, float]]]]:
    """Each case's (baseline, ours) measured side by side in every round: the ratios ours /
    baseline, and the CPU seconds (baseline, ours), per case."""
    raw: dict[str, list[float]] = {k: [] for k in cases}
    secs: dict[str, list[tuple[float, float]]] = {k: [] for k in cases}
    for r in range(repeat):
        print(f"round {r + 1}/{repeat}", flush=True)
        for name, (base, ours) in cases.items():
            b = cpu_s(base)
            o = cpu_s(ours)
            raw[name].append(o / b)
            secs[name].append((b, o))
    return raw, secs


def machine() -> dict[str, Any]:
    """Where and when a benchmark ran: the first fields of every recorded result."""
    import torch

    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }


def record_head() -> dict[str, Any]:
    """Where and how a ratio benchmark ran: the first fields of its recorded results."""
    return {
        **machine(),
        "method": "CPU time of the process, in process, each figure the least of two runs, "
                  "ratios side by side in a round, min-max over rounds; cores shared",
    }


def summary(values: list[float], goal: float | None) -> dict[str, Any]:
    """A ratio over the rounds: median, min-max, every run, and whether the worst met the
    goal (None: a reference figure, with no goal of its own)."""
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3), "runs": [round(v, 3) for v in values],
            "goal": None if goal is None else f"<= {goal}",
            "met": None if goal is None else max(values) <= goal}
