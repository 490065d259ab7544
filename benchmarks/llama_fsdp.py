"""The ladder's FSDP2 ZeRO-3 rung on the Llama-70B shape (``llama_shape.py``) at world 64.
One command::

    python benchmarks/llama_fsdp.py                 # prints, writes benchmarks/llama_fsdp.json
    python benchmarks/llama_fsdp.py --profile 30 --no-write  # the timed run under cProfile

What it runs is what the ladder's rung runs (:func:`dpprof.measure.ladder.evaluate`): one
rank of 64, torch's own ``fully_shard`` on each of the 80 decoder layers and at the root
(``reshard_after_forward=True``) over a fake process group of 64
(:func:`dpprof.emulator.fsdp.emulated_ranks`), the ``single`` scenario's rows (batch 64:
one row of 4096 tokens per rank), on an H100 80 GB (compute capability 9.0), reserved memory,
the CUDA context and NCCL's memory counted, over meta tensors. The workload is pure
bfloat16 (parameters, gradients and AdamW's moments in bf16, as ``llama_shape`` declares).

Goal: the rung in under 60 s wall on the development machine (2 shared cores). The figures:
the rung's wall and CPU seconds in process (after one small warm-up of the imports and
FSDP2's first calls on ``lm``, not timed), the rank's peak allocated bytes, its need (reserved
+ context, as the out-of-memory check counts) and the breakdown at the peak, against a
back-of-envelope of the sharded state; and the same rung run again in the process (what
the first run spent once: building the shape, DTensor's sharding propagation's caches,
the meta kernels' memo).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Any

from ratios import machine  # beside this file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
WORLD = 64
BATCH = 64  # one row per rank
GPU = "h100-80gb"
GOAL_S = 60.0


def zero3_rung(wl: Any, world: int, batch: int) -> Any:
    """The ZeRO-3 rung as the ladder measures it: ``single``'s rows on one rank of ``world``,
    the model under ``fully_shard`` (each repeated block, then the root)."""
    from dpprof.backends.emulated import EmulationConfig, run_scenario
    from dpprof.emulator.catalog import lookup_gpu
    from dpprof.emulator.fsdp import emulated_ranks
    from dpprof.measure.rung_models import fully_sharded
    from dpprof.scenarios.names import SINGLE
    from dpprof.scenarios.step import StepConfig

    spec = lookup_gpu(GPU)
    cfg = EmulationConfig(gpus=world, gpu_memory_bytes=spec.total_memory_bytes,
                          step=StepConfig(batch=batch), count_reserved=True,
                          compute_capability=spec.compute_capability, collectives=True)
    with emulated_ranks(world):
        return run_scenario(SINGLE, fully_sharded(wl, reshard_after_forward=True), cfg)


def envelope(world: int) -> dict[str, int]:
    """The sharded state per rank from the config alone (bf16: 2 B per element): parameters,
    gradients, AdamW's two moments, each 1/world of the model (FSDP2 pads each parameter's
    dim 0 to a multiple of world: a few KB here); one decoder layer unsharded (the
    all-gather's output) and the root's parameters (embedding, final norm, output
    projection), which FSDP2 keeps unsharded between the root's forward and backward."""
    from llama_shape import LLAMA_70B as c

    p = c.parameter_count()
    d, kv = c.d_model, c.kv_heads * c.head_dim
    layer = d * d + 2 * d * kv + d * d + 3 * d * c.ffn + 2 * d
    root = 2 * c.vocab * d + d
    return {"parameters": p, "sharded_state_bytes": 4 * 2 * p // world,
            "one_layer_unsharded_bytes": 2 * layer, "root_unsharded_bytes": 2 * root,
            "one_row_logits_bytes": 2 * c.seq * c.vocab}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=WORLD)
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="run the timed rung under cProfile; print the N heaviest functions")
    ap.add_argument("--no-write", action="store_true", help="do not write llama_fsdp.json")
    args = ap.parse_args()
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    from llama_shape import llama70b

    from dpprof.scenarios.workloads import load_workload

    # warm-up (not timed): imports, FSDP2's and DTensor's first calls, on a small model
    zero3_rung(load_workload("lm"), 4, 4)
    load = os.getloadavg()
    prof = cProfile.Profile() if args.profile else None
    t0, c0 = time.perf_counter(), time.process_time()
    if prof is not None:
        prof.enable()
    s = zero3_rung(llama70b(), args.world, args.batch)
    if prof is not None:
        prof.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    # the same rung again in this process: what the first run's one-off costs were
    t0, c0 = time.perf_counter(), time.process_time()
    zero3_rung(llama70b(), args.world, args.batch)
    again_wall, again_cpu = time.perf_counter() - t0, time.process_time() - c0
    if s.status not in ("ok", "oom") or not s.devices:
        raise SystemExit(f"the rung did not run: {s.status}: {s.message}")
    d = next(x for x in s.devices if x.used)
    env = envelope(args.world)
    gib = 2**30
    print(f"FSDP2 ZeRO-3, Llama-70B shape ({env['parameters'] / 1e9:.2f}e9 parameters), "
          f"world {args.world}, batch {args.batch} ({d.batch_rows} row(s) per rank), {GPU}")
    print(f"  wall {wall:.1f} s, CPU {cpu:.1f} s (goal < {GOAL_S:.0f} s wall: "
          f"{'met' if wall < GOAL_S else 'NOT MET'}); load average before {load[0]:.1f}")
    print(f"  per-rank peak allocated {d.peak_allocated_bytes / gib:.2f} GiB, need (reserved "
          f"+ context) {d.total_peak_bytes / gib:.2f} GiB: {s.status} on {GPU}; "
          f"peak in {d.peak_phase}")
    for k, v in sorted(d.breakdown_bytes.items(), key=lambda kv: -kv[1]):
        print(f"    {k:<24} {v / gib:8.2f} GiB")
    print(f"  envelope: sharded state {env['sharded_state_bytes'] / gib:.2f} GiB, one layer "
          f"unsharded {env['one_layer_unsharded_bytes'] / gib:.2f} GiB, root unsharded "
          f"{env['root_unsharded_bytes'] / gib:.2f} GiB")
    print(f"  the same rung again in this process: wall {again_wall:.1f} s, CPU "
          f"{again_cpu:.1f} s")
    profile: list[str] = []
    if prof is not None:
        print("  (times above under cProfile: not the benchmark's figures)")
        for order in ("cumulative", "tottime"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(order).print_stats(args.profile)
            print(out.getvalue())
        profile = out.getvalue().splitlines()
    if not args.no_write:
        result = {
            **machine(),
            "load_average_before": round(load[0], 2),
            "world": args.world, "batch": args.batch, "gpu": GPU,
            "rows_per_rank": d.batch_rows, "status": s.status,
            "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "goal_wall_s": GOAL_S,
            "met": wall < GOAL_S, "profiled": bool(args.profile),
            "again_in_process_wall_s": round(again_wall, 2),
            "again_in_process_cpu_s": round(again_cpu, 2),
            "peak_allocated_bytes": d.peak_allocated_bytes,
            "need_bytes": d.total_peak_bytes, "peak_phase": d.peak_phase,
            "breakdown_bytes": d.breakdown_bytes, "envelope": env,
        }
        if profile:
            result["profile_tottime"] = profile
        (HERE / "llama_fsdp.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {HERE / 'llama_fsdp.json'}")


if __name__ == "__main__":
    main()
