"""How fast the largest-batch search is: emulated steps and seconds per scenario.

    python benchmarks/bench_maxbatch.py            # lm on 4 x a100-80gb, multiples of 8

Prints one line per scenario; the figures recorded in ``benchmarks/maxbatch.md`` come from
this script. Meta emulation costs the same at any batch, so the cost is the number of
emulated steps the search needs (extrapolation, galloping, bisection) times one step.
"""

from __future__ import annotations

import sys
import time

from dpprof.backends.emulated import EmulationConfig
from dpprof.emulator.catalog import lookup_gpu
from dpprof.measure.maxbatch_search import probe_emulated, search
from dpprof.scenarios.registry import SCENARIOS
from dpprof.scenarios.step import StepConfig
from dpprof.scenarios.workloads import load_workload


def main(workload: str = "lm", gpu: str = "a100-80gb", gpus: int = 4, multiple: int = 8) -> None:
    wl = load_workload(workload)
    spec = lookup_gpu(gpu)
    cap = spec.total_memory_bytes
    base = EmulationConfig(
        gpus=gpus, gpu_memory_bytes=cap, compute_capability=spec.compute_capability,
        step=StepConfig(batch=multiple),
    )
    print(f"{workload} on {gpus} x {gpu} ({cap} B), multiples of {multiple}")
    total = 0.0
    for name in SCENARIOS:
        t0 = time.perf_counter()
        times: list[float] = []
        probe = probe_emulated(name, wl, base)

        def timed(batch: int, probe=probe, times=times):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            r = probe(batch)
            times.append(time.perf_counter() - t)
            return r

        best, probes, _ = search(timed, multiple, capacity_bytes=cap)
        dt = time.perf_counter() - t0
        total += dt
        print(f"  {name:16s} max batch {best!s:>6}  {len(probes):2d} emulated steps  "
              f"{dt:6.1f} s  ({min(times):.2f} to {max(times):.2f} s per step)")
    print(f"  total {total:.1f} s")


if __name__ == "__main__":
    main(*sys.argv[1:2])
