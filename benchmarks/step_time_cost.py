"""What predicting the step time costs a comparison: ``dpprof compare``'s pipeline (emulated,
the fixes included) with the prediction, as shipped, and without it (the op log off), each
the best of 3 in this process's CPU time, the two taken in turn (the machine is shared:
its load average, before and after, is recorded beside the figures). The goal: at most 10 %.
The same for ``dpprof run`` on scripts of tests/scripts (every run of it: as written, the
alternatives, the ladder where it runs; ``ScriptConfig.predict_time`` off and on).

    python benchmarks/step_time_cost.py        # prints the table, writes step_time_cost.json
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "step_time_cost.json"
CASES = (("mlp", 512), ("lm", 32), ("convnet", 256), ("classifier", 64))
SCRIPTS = HERE.parent / "tests" / "scripts"
# (script and its arguments): DataParallel with its two alternatives; a transformer on one GPU
RUN_CASES = (("dp_loss_outside.py", "--batch-size", "256"), ("transformer_lm.py",))
REPEAT = 3


def _compare_once_s(workload: str, batch: int, predict: bool) -> float:
    from dpprof import pipeline
    from dpprof.pipeline import CompareConfig, run_compare
    from dpprof.scenarios.step import StepConfig

    shipped = pipeline.emulation_config

    def config(*args: Any, **kwargs: Any) -> Any:
        return dataclasses.replace(shipped(*args, **kwargs), predict_time=predict)

    pipeline.emulation_config = config  # type: ignore[assignment]
    try:
        t0 = time.process_time()
        run_compare(CompareConfig(workload=workload, step=StepConfig(batch=batch),
                                  backend="emulated"))
        return time.process_time() - t0
    finally:
        pipeline.emulation_config = shipped  # type: ignore[assignment]


def _run_once_s(argv: tuple[str, ...], predict: bool) -> float:
    from dpprof.script.session import ScriptConfig, parse_command, run_command

    cmd = ["python", str(SCRIPTS / argv[0]), *argv[1:]]
    cfg = ScriptConfig(launch=parse_command(cmd, 4), gpus=4, predict_time=predict)
    t0 = time.process_time()
    run_command(cfg)
    return time.process_time() - t0


def _best_pair_s(once: Callable[[bool], float]) -> tuple[float, float]:
    """The best of :data:`REPEAT` without the prediction and with it, the two taken in
    turn (a load that comes and goes on the shared machine weighs on both alike)."""
    once(True)  # imports and caches warm
    off, on = float("inf"), float("inf")
    for _ in range(REPEAT):
        off = min(off, once(False))
        on = min(on, once(True))
    return off, on


def main() -> None:
    load_before = os.getloadavg()[0]
    rows = []
    for workload, batch in CASES:
        off, on = _best_pair_s(functools.partial(_compare_once_s, workload, batch))
        rows.append({"workload": workload, "batch": batch, "without_s": off, "with_s": on,
                     "cost": on / off - 1})
        print(f"{workload:10} b{batch:<4} compare without the prediction {off:6.2f} s, with it "
              f"{on:6.2f} s: {on / off - 1:+.1%}", flush=True)
    runs = []
    for argv in RUN_CASES:
        off, on = _best_pair_s(functools.partial(_run_once_s, argv))
        runs.append({"script": " ".join(argv), "without_s": off, "with_s": on,
                     "cost": on / off - 1})
        print(f"dpprof run {' '.join(argv):32} without the prediction {off:6.2f} s, with it "
              f"{on:6.2f} s: {on / off - 1:+.1%}", flush=True)
    load = {"cpus": os.cpu_count(), "load_average_1m_before": load_before,
            "load_average_1m_after": os.getloadavg()[0]}
    print(f"load average (1 min) {load_before:.1f} before, "
          f"{load['load_average_1m_after']:.1f} after, on {os.cpu_count()} CPUs")
    OUT.write_text(json.dumps({"about": __doc__.strip().splitlines()[0], "machine": load,
                               "rows": rows, "run_rows": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
