"""Regenerate the results that dpprof itself produced, saved under ``tests/data/``.

    python scripts/make_test_data.py

- ``emulated-lm.json``: the default comparison (``dpprof compare``: lm, batch 512, 4
  emulated GPUs of 80 GiB, meta tensors), its timelines thinned to 120 points per device
  (maxima of equal slices, so every peak survives) to keep the file small;
- ``cpu-mlp.json``: ``dpprof compare --compute -w mlp -b 16`` (CPU tensors, real losses).

The synthetic real-GPU-shaped results come from ``tests/synthetic.py``.
"""

from __future__ import annotations

from pathlib import Path

from dpprof.pipeline import CompareConfig, run_compare
from dpprof.result import RunResult, TimelinePoint, write_atomic

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
POINTS = 120


def thin(points: list[TimelinePoint], keep: int = POINTS) -> list[TimelinePoint]:
    """At most ``keep`` points: the largest of each of ``keep`` equal slices."""
    if len(points) <= keep:
        return points
    step = len(points) / keep
    out = []
    for k in range(keep):
        chunk = points[int(k * step): int((k + 1) * step)]
        if chunk:
            out.append(max(chunk, key=lambda p: p.allocated_bytes))
    return out


def thinned(run: RunResult) -> RunResult:
    for s in run.scenarios:
        for d in s.devices:
            d.timeline = thin(d.timeline)
    run.notes.append(
        f"timelines thinned to {POINTS} points per device for the test data "
        "(the maxima of equal slices)"
    )
    return run


def main() -> None:
    run = thinned(run_compare(CompareConfig()))
    write_atomic(DATA / "emulated-lm.json", run.to_json() + "\n")
    cpu = run_compare(CompareConfig(workload="mlp", batch=16, compute=True))
    write_atomic(DATA / "cpu-mlp.json", cpu.to_json() + "\n")
    for name in ("emulated-lm.json", "cpu-mlp.json"):
        print(f"wrote {DATA / name} ({(DATA / name).stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
