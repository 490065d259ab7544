"""What the ladder adds to a comparison. One command:

    python benchmarks/bench_ladder.py              # prints, writes benchmarks/results_ladder.json
    python benchmarks/bench_ladder.py --repeat 5   # min-max over 5 rounds (default 3)

Cost is CPU time of this process (``time.process_time``), in process (``run_compare``),
one warm-up of each case first (imports, first calls), each figure the least of two runs,
the ratio measured side by side in a round; the min-max is over the rounds; torch on one
intra-op thread (on shared cores the spinning of idle threads counts as CPU time).

The ratio: ``dpprof compare`` with the ladder (``--ladder``) / the same comparison without it
(``--no-ladder``), all four scenarios and the fixes on, goal <= 2; recorded beside it, the
goal's other reading, the ladder's own cost (with - without) / the comparison without it;
for

1. ``lm`` at batch 512 on 4 RTX 4090s (24 GB): ddp is out of memory, so a plain
   ``dpprof compare`` measures the ladder (bf16, checkpointing, both, and the fewest
   micro-batches that fit: 2 here);
2. ``lm`` at batch 512 on 4 A100s (80 GB): everything fits, the ladder only on ``--ladder``;
3. ``classifier`` at batch 512 on 4 RTX 4090s (no repeated blocks: bf16 and accumulation).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from ratios import record_head, rounds, summary

HERE = Path(__file__).resolve().parent
GOAL = 2.0


def compare(workload: str, batch: int, gpus: int, gpu: str, ladder: bool
            ) -> Callable[[], object]:
    from dpprof.emulator.catalog import lookup_gpu
    from dpprof.pipeline import CompareConfig, run_compare
    from dpprof.scenarios.step import StepConfig

    spec = lookup_gpu(gpu)
    cfg = CompareConfig(workload=workload, gpus=gpus, step=StepConfig(batch=batch),
                        gpu_memory_bytes=spec.total_memory_bytes, gpu=spec.key,
                        compute_capability=spec.compute_capability, ladder=ladder)
    return lambda: run_compare(cfg)


CASES = {
    "lm_b512_4x_rtx4090": ("lm", 512, 4, "rtx-4090"),
    "lm_b512_4x_a100_80gb": ("lm", 512, 4, "a100-80gb"),
    "classifier_b512_4x_rtx4090": ("classifier", 512, 4, "rtx-4090"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="rounds (min-max over them)")
    ap.add_argument("--no-write", action="store_true", help="do not write results_ladder.json")
    args = ap.parse_args()
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    torch.set_num_threads(1)
    cases = {name: (compare(*c, ladder=False), compare(*c, ladder=True))
             for name, c in CASES.items()}
    rungs: dict[str, list[str]] = {}
    for name, (base, ours) in cases.items():  # warm-up: imports, first calls
        base()
        run: Any = ours()
        rungs[name] = [f"{f.title}: needs {f.need_bytes}" for f in run.fixes
                       if f.name.startswith("ladder-")]
    load_before = os.getloadavg()  # the cores are shared: how busy they were, 1/5/15 min
    raw, secs = rounds(cases, args.repeat)
    load_after = os.getloadavg()
    results: dict[str, Any] = {
        **record_head(),
        "load_average": {"before": [round(x, 2) for x in load_before],
                         "after": [round(x, 2) for x in load_after]},
        "ratios": {k: summary(v, GOAL) for k, v in raw.items()},
        # the other reading of the goal: what the ladder adds (with - without), over the
        # comparison without it; the same rounds
        "ladder_own_cost_ratios": {k: summary([o / b - 1 for b, o in v], GOAL)
                                   for k, v in secs.items()},
        "cpu_s": {k: {"no_ladder": [round(b, 3) for b, _ in v],
                      "ladder": [round(o, 3) for _, o in v]} for k, v in secs.items()},
        "rungs": rungs,
    }
    for k, s in results["ratios"].items():
        mark = "met" if s["met"] else "NOT MET"
        b = [x for x, _ in secs[k]]
        o = [y for _, y in secs[k]]
        print(f"  {k:<28} {s['median']:.2f}  (min {s['min']:.2f} - max {s['max']:.2f}, "
              f"{len(s['runs'])} rounds; goal {s['goal']}: {mark}); CPU s without "
              f"{min(b):.2f}-{max(b):.2f}, with {min(o):.2f}-{max(o):.2f}")
    for k, s in results["ladder_own_cost_ratios"].items():
        mark = "met" if s["met"] else "NOT MET"
        print(f"  {k:<28} ladder's own cost / comparison {s['median']:.2f}  (min "
              f"{s['min']:.2f} - max {s['max']:.2f}; goal {s['goal']} read so: {mark})")
    print(f"  load average (1, 5, 15 min) before {load_before[0]:.2f} {load_before[1]:.2f} "
          f"{load_before[2]:.2f}, after {load_after[0]:.2f} {load_after[1]:.2f} "
          f"{load_after[2]:.2f}")
    if not args.no_write:
        (HERE / "results_ladder.json").write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {HERE / 'results_ladder.json'}")


if __name__ == "__main__":
    main()
