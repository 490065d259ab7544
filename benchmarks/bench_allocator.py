"""How fast the caching allocator's replay is: 60,000 random allocations and frees (small and large
blocks, freed at random), the events tests/test_allocator.py replays for correctness, timed
here. The goal: well under two seconds (a `dpprof compare` replays a few thousand per
scenario; a 70B model's FSDP2 rung some hundred thousand).

    python benchmarks/bench_allocator.py      # prints the best of 5
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_allocator import random_events

from dpprof.emulator.allocator_replay import simulate

GOAL_S = 2.0


def main() -> None:
    events = random_events(100_000)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        simulate(events)
        best = min(best, time.perf_counter() - t0)
    print(f"{len(events):,} events replayed in {best:.3f} s (best of 5); goal < {GOAL_S} s: "
          f"{'met' if best < GOAL_S else 'NOT MET'}")


if __name__ == "__main__":
    main()
