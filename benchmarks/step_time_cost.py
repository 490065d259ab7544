"""What predicting the step time costs a comparison: ``dpprof compare``'s pipeline (emulated,
the fixes included) with the prediction, as shipped, and without it (the op log off), each
the best of 3 in this process's CPU time (the machine is shared). The goal: at most 10 %.
The same for ``dpprof run`` on scripts of tests/scripts (every run of it: as written, the
alternatives, the ladder where it runs; ``ScriptConfig.predict_time`` off and on).

    python benchmarks/step_time_cost.py        # prints the table, writes step_time_cost.json
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "step_time_cost.json"
CASES = (("mlp", 512), ("lm", 32), ("convnet", 256), ("classifier", 64))
SCRIPTS = HERE.parent / "tests" / "scripts"
# (script and its arguments): DataParallel with its two alternatives; a transformer on one GPU
RUN_CASES = (("dp_loss_outside.py", "--batch-size", "256"), ("transformer_lm.py",))
REPEAT = 3


def _compare_s(workload: str, batch: int, predict: bool) -> float:
    from dpprof import pipeline
    from dpprof.pipeline import CompareConfig, run_compare
    from dpprof.scenarios.step import StepConfig

    shipped = pipeline.emulation_config

    def config(*args: Any, **kwargs: Any) -> Any:
        return dataclasses.replace(shipped(*args, **kwargs), predict_time=predict)

    pipeline.emulation_config = config  # type: ignore[assignment]
    try:
        best = float("inf")
        for _ in range(REPEAT):
            t0 = time.process_time()
            run_compare(CompareConfig(workload=workload, step=StepConfig(batch=batch),
                                      backend="emulated"))
            best = min(best, time.process_time() - t0)
        return best
    finally:
        pipeline.emulation_config = shipped  # type: ignore[assignment]


def _run_s(argv: tuple[str, ...], predict: bool) -> float:
    from dpprof.script.session import ScriptConfig, parse_command, run_command

    cmd = ["python", str(SCRIPTS / argv[0]), *argv[1:]]
    best = float("inf")
    for _ in range(REPEAT):
        cfg = ScriptConfig(launch=parse_command(cmd, 4), gpus=4, predict_time=predict)
        t0 = time.process_time()
        run_command(cfg)
        best = min(best, time.process_time() - t0)
    return best


def main() -> None:
    rows = []
    for workload, batch in CASES:
        _compare_s(workload, batch, True)  # imports and caches warm
        off = _compare_s(workload, batch, False)
        on = _compare_s(workload, batch, True)
        rows.append({"workload": workload, "batch": batch, "without_s": off, "with_s": on,
                     "cost": on / off - 1})
        print(f"{workload:10} b{batch:<4} compare without the prediction {off:6.2f} s, with it "
              f"{on:6.2f} s: {on / off - 1:+.1%}", flush=True)
    runs = []
    for argv in RUN_CASES:
        _run_s(argv, True)  # imports and caches warm
        off = _run_s(argv, False)
        on = _run_s(argv, True)
        runs.append({"script": " ".join(argv), "without_s": off, "with_s": on,
                     "cost": on / off - 1})
        print(f"dpprof run {' '.join(argv):32} without the prediction {off:6.2f} s, with it "
              f"{on:6.2f} s: {on / off - 1:+.1%}", flush=True)
    OUT.write_text(json.dumps({"about": __doc__.strip().splitlines()[0], "rows": rows,
                               "run_rows": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
