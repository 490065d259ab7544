"""Regenerate the results that dpprof itself produced, saved under ``tests/data/``.

    python scripts/make_test_data.py

- ``emulated-lm.json``: the default comparison (``dpprof compare``: lm, batch 512, 4
  emulated GPUs of the default A100 80GB, meta tensors), its timelines thinned to 120
  points per device (maxima of equal slices, so every peak survives) to keep the file small;
- ``cpu-mlp.json``: ``dpprof compare --compute -w mlp -b 16`` (CPU tensors, real losses).

The synthetic real-GPU-shaped results come from ``tests/synthetic.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from dpprof.pipeline import CompareConfig, run_compare
from dpprof.result import RunResult, TimelinePoint
from dpprof.saved_result import write_atomic
from dpprof.scenarios.step import StepConfig

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
POINTS = 120


def thin(points: Sequence[TimelinePoint], keep: int = POINTS) -> tuple[TimelinePoint, ...]:
    """At most ``keep`` points: the largest of each of ``keep`` equal slices."""
    if len(points) <= keep:
        return tuple(points)
    step = len(points) / keep
    out = []
    for k in range(keep):
        chunk = points[int(k * step): int((k + 1) * step)]
        if chunk:
            out.append(max(chunk, key=lambda p: p.allocated_bytes))
    return tuple(out)


def thinned(run: RunResult | None) -> RunResult:
    assert run is not None
    return dataclasses.replace(
        run, scenarios=tuple(dataclasses.replace(s, devices=tuple(
            dataclasses.replace(d, timeline=thin(d.timeline)) for d in s.devices))
            for s in run.scenarios),
        notes=(*run.notes, f"timelines thinned to {POINTS} points per device for the test data "
               "(the maxima of equal slices)"))


def _ran(run: RunResult | None) -> RunResult:
    assert run is not None  # None only for torchrun ranks other than 0
    return run


def build() -> dict[str, RunResult]:
    """Every result this script saves, by file name, as dpprof produces it now."""
    return {
        "emulated-lm.json": thinned(run_compare(CompareConfig())),
        "cpu-mlp.json": _ran(run_compare(CompareConfig(
            workload="mlp", compute=True,
            step=StepConfig(batch=16),
        ))),
    }


def main() -> None:
    for name, run in build().items():
        write_atomic(DATA / name, run.to_json() + "\n")
        print(f"wrote {DATA / name} ({(DATA / name).stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
