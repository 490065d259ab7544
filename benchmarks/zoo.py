"""The real-model zoo (``tests/zoo.py``): per model, the emulated peaks per scenario, the
CPU check against ``torch.profiler`` and the time each took. One command::

    python benchmarks/zoo.py            # prints, writes benchmarks/zoo.json

Per model (batch 4 over 2 virtual GPUs, 2 rows per GPU, the tutorial loop, 2 iterations):

* ``peaks``: the emulated peak allocated bytes of cuda:0 (and the heaviest other GPU) for
  every scenario over meta tensors (the default), and the seconds each took;
* ``cpu_check``: ``single`` on real CPU tensors under ``torch.profiler`` (profiled from
  before the model is built) against the emulator over CPU tensors: the bytes live when the
  measured iteration began (both sides), the iteration's absolute peak (both sides), the
  CPU-only kernel scratch live at most at once (what the profiler may exceed the emulator
  by), and the emulator's peak over meta tensors; with the seconds taken.

Needs the ``zoo`` extra (see pyproject.toml).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
ZOO = TESTS / "zoo.py"
ROWS = 2


def scenario_peaks(name: str) -> dict[str, Any]:
    from dpprof.backends.emulated import EmulationConfig, run_scenario
    from dpprof.scenarios.registry import SCENARIOS
    from dpprof.scenarios.step import StepConfig
    from dpprof.scenarios.workloads import load_workload

    out: dict[str, Any] = {}
    wl = load_workload(f"{ZOO}:{name}")
    for scenario in SCENARIOS:
        t0 = time.perf_counter()
        r = run_scenario(scenario, wl, EmulationConfig(
            gpus=2, gpu_memory_bytes=2**40,
            step=StepConfig(batch=2 * ROWS),
        ))
        entry: dict[str, Any] = {"status": r.status, "seconds": round(time.perf_counter() - t0, 3)}
        if r.status == "ok":
            entry["cuda0_peak_allocated_bytes"] = r.devices[0].peak_allocated_bytes
            entry["others_max_peak_allocated_bytes"] = max(
                (d.peak_allocated_bytes for d in r.devices[1:]), default=0)
        else:
            entry["message"] = r.message
        out[scenario] = entry
    return out


def cpu_check(name: str) -> dict[str, Any]:
    sys.path.insert(0, str(TESTS))
    from test_fidelity import emulated_step
    from test_zoo import _running, cpu_only_peak

    from dpprof.backends.gloo import RankSpec, run_rank
    from dpprof.backends.memtrace import SCALAR_BYTES, Alloc, peak_of
    from dpprof.scenarios.step import StepConfig

    spec = f"{ZOO}:{name}"
    t0 = time.perf_counter()
    measured = run_rank(RankSpec(workload=spec, step=StepConfig(batch=ROWS * 2), wrap="none"),
                        0, 2)
    t_profiler = time.perf_counter() - t0
    records = [Alloc(0, s, op, p) for s, op, p in measured.step_events if abs(s) > SCALAR_BYTES]
    t0 = time.perf_counter()
    start, cpu = emulated_step(spec, "single", ROWS, True)
    t_cpu = time.perf_counter() - t0
    out: dict[str, Any] = {
        "profiler_start_bytes": measured.start_large_requested_bytes,
        "emulator_start_bytes": start,
        "profiler_peak_bytes": (measured.start_large_requested_bytes or 0) + peak_of(records),
        "emulator_cpu_peak_bytes": start + max(0, *_running(cpu)),
        "cpu_only_scratch_bytes": cpu_only_peak(records, cpu),
        "profiler_seconds": round(t_profiler, 3),
        "emulator_cpu_seconds": round(t_cpu, 3),
    }
    try:
        t0 = time.perf_counter()
        mstart, meta = emulated_step(spec, "single", ROWS, False)
        out["emulator_meta_peak_bytes"] = mstart + max(0, *_running(meta))
        out["emulator_meta_seconds"] = round(time.perf_counter() - t0, 3)
    except AssertionError as e:  # the scenario failed over meta
        out["emulator_meta_error"] = str(e).splitlines()[0][:200]
    diff = out["profiler_peak_bytes"] - out["emulator_cpu_peak_bytes"]
    out["agrees"] = (out["profiler_start_bytes"] == start
                     and 0 <= diff <= out["cpu_only_scratch_bytes"])
    return out


def main() -> None:
    sys.path.insert(0, str(TESTS))
    from zoo import ZOO as NAMES

    results: dict[str, Any] = {}
    for name in NAMES:
        t0 = time.perf_counter()
        entry = {"peaks": scenario_peaks(name), "cpu_check": cpu_check(name)}
        entry["seconds"] = round(time.perf_counter() - t0, 3)
        results[name] = entry
        peaks = entry["peaks"]
        chk = entry["cpu_check"]
        cells = "  ".join(
            f"{s} {p['cuda0_peak_allocated_bytes']:>11,}" if p["status"] == "ok"
            else f"{s} {p['status']}" for s, p in peaks.items())
        meta = chk.get("emulator_meta_peak_bytes", chk.get("emulator_meta_error"))
        print(f"{name:14} {cells}")
        print(f"{'':14} cpu check: profiler {chk['profiler_peak_bytes']:,} B, emulator "
              f"{chk['emulator_cpu_peak_bytes']:,} B (start {chk['profiler_start_bytes']:,} vs "
              f"{chk['emulator_start_bytes']:,}), CPU-only scratch <= "
              f"{chk['cpu_only_scratch_bytes']:,} B, meta {meta}; "
              f"{'agrees' if chk['agrees'] else 'DISAGREES'}; {entry['seconds']:.1f} s")
    (HERE / "zoo.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {HERE / 'zoo.json'}")


if __name__ == "__main__":
    main()
