"""The ladder on every zoo model and the built-in ``lm``, where plain DDP does not fit a
24 GB card. One command::

    python benchmarks/ladder_zoo.py             # prints, writes benchmarks/ladder_zoo.json
    python benchmarks/ladder_zoo.py lm gpt2     # only these models

Per model, on 4 emulated GPUs (meta tensors), through the API ``dpprof compare`` uses
(:func:`dpprof.pipeline.run_compare` with ``CompareConfig(ladder=True)``, ``--scenarios ddp
--no-fixes``):

1. **the batch**: the smallest power of two (from 4 rows per GPU up) at which ``ddp``'s
   fullest GPU needs more than an RTX 4090 holds (23.64 GiB, counting reserved memory and
   the CUDA context as the out-of-memory check does): just past where DDP stops fitting,
   so each rung is measured at the point a user first reaches for it;
2. **the ladder** at that batch, once per card (``--gpu rtx-4090`` and ``--gpu h100-80gb``:
   each card's own context model and kernel choices; the ladder forced on where DDP fits):
   per rung the peak allocated bytes of cuda:0 and of the fullest GPU, the need of the
   fullest GPU (reserved + context), whether it fits, and the cheapest rung that fits
   (:func:`dpprof.measure.ladder.cheapest_fit`; ``ddp`` itself where it already fits);
3. **the time**: wall seconds of the comparison with the ladder and without it (``ddp``
   alone, run just before), each the least of two runs, on each card (the 24 GB card's
   in the table); the ladder's own time is the difference.

``flags`` lists what looks wrong (:func:`flags`): every rung is meant to lower DDP's peak
(accumulation and FSDP2 on the same per-GPU rows), the two rungs together more than either.

Needs the ``zoo`` extra (see pyproject.toml) for the zoo's models.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from ratios import machine  # beside this file

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
ZOO_FILE = TESTS / "zoo.py"
GPUS = 4
SMALL, LARGE = "rtx-4090", "h100-80gb"
FIRST_ROWS_PER_GPU = 4
MAX_BATCH = 2**26  # the search gives up here (a model that never fills 24 GB)
GIB = 2**30
TIMED_RUNS = 2  # each wall time the least of two (the cores are shared)


def models() -> dict[str, str]:
    """Short name -> workload spec: the built-in ``lm``, then the zoo."""
    sys.path.insert(0, str(TESTS))
    from zoo import ZOO

    return {"lm": "lm"} | {name: f"{ZOO_FILE}:{name}" for name in ZOO}


def config(spec: str, batch: int, gpu: str, ladder: bool) -> Any:
    from dpprof.emulator.catalog import lookup_gpu
    from dpprof.pipeline import CompareConfig
    from dpprof.scenarios.step import StepConfig

    g = lookup_gpu(gpu)
    return CompareConfig(workload=spec, gpus=GPUS, step=StepConfig(batch=batch),
                         gpu_memory_bytes=g.total_memory_bytes, gpu=g.key,
                         compute_capability=g.compute_capability, scenarios=("ddp",),
                         fixes=False, ladder=ladder)


def ddp_figures(run: Any) -> dict[str, Any]:
    s = run.scenario("ddp")
    used = [d for d in s.devices if d.used]
    return {"status": s.status, "cuda0_peak_allocated_bytes": used[0].peak_allocated_bytes,
            "max_peak_allocated_bytes": max(d.peak_allocated_bytes for d in used),
            "need_bytes": max(d.total_peak_bytes for d in used)}


def smallest_oom_batch(spec: str, wl: Any) -> tuple[int, list[list[int]]]:
    """The smallest power-of-two batch (4 rows per GPU and up) at which ddp does not fit the
    24 GB card; with each batch tried and ddp's need there."""
    from dpprof.pipeline import run_compare

    tried: list[list[int]] = []
    batch = GPUS * FIRST_ROWS_PER_GPU
    while batch <= MAX_BATCH:
        f = ddp_figures(run_compare(config(spec, batch, SMALL, ladder=False), workload=wl))
        tried.append([batch, f["need_bytes"]])
        if f["status"] == "oom":
            return batch, tried
        if f["status"] != "ok":
            raise SystemExit(f"{spec}: ddp at batch {batch}: {f['status']}")
        batch *= 2
    raise SystemExit(f"{spec}: ddp fits 24 GB up to batch {MAX_BATCH}")


def ladder_on(spec: str, wl: Any, batch: int, gpu: str) -> tuple[dict[str, Any], float, float]:
    """The ladder at ``batch`` on ``gpu``: its figures, the wall seconds of the comparison
    without the ladder and with it."""
    from dpprof.fixes.policy import LADDER_PREFIX
    from dpprof.measure.ladder import cheapest_fit
    from dpprof.pipeline import run_compare

    without = with_ladder = float("inf")
    for _ in range(TIMED_RUNS):
        t0 = time.perf_counter()
        run_compare(config(spec, batch, gpu, ladder=False), workload=wl)
        without = min(without, time.perf_counter() - t0)
        t0 = time.perf_counter()
        run = run_compare(config(spec, batch, gpu, ladder=True), workload=wl)
        with_ladder = min(with_ladder, time.perf_counter() - t0)
    ddp = ddp_figures(run)
    ddp["fits"] = ddp["status"] == "ok"
    rungs = [{"name": f.name, "title": f.title,
              "cuda0_peak_allocated_bytes": f.primary_peak_bytes,
              "max_peak_allocated_bytes": f.max_peak_bytes, "need_bytes": f.need_bytes,
              "fits": f.need_bytes is not None and f.need_bytes <= run.gpu_memory_bytes}
             for f in run.fixes if f.name.startswith(LADDER_PREFIX)]
    fit = cheapest_fit(run)
    return ({"capacity_bytes": run.gpu_memory_bytes, "ddp": ddp, "rungs": rungs,
             "cheapest_fit": "ddp" if ddp["fits"] else (fit.name if fit else None)},
            without, with_ladder)


def flags(small: dict[str, Any], large: dict[str, Any]) -> list[str]:
    """What looks wrong: a rung above DDP's peak (on the fullest GPU); the two rungs
    together above either alone (in peak, or in need by over 0.25 GiB); checkpointing that
    saves under 1 % of DDP's peak; FSDP2's rungs missing where checkpointing found blocks
    (their emulation failed: the ladder leaves a failed rung out); a rung whose need differs
    between the cards by over 1 GiB more than DDP's does (same peaks: only the context and
    the cuBLAS workspaces differ)."""
    out: list[str] = []
    ddp_peak = small["ddp"]["max_peak_allocated_bytes"]
    by = {r["name"]: r for r in small["rungs"]}
    for r in small["rungs"]:
        if (r["max_peak_allocated_bytes"] or 0) > ddp_peak:
            out.append(f"{short(r['name'])}: fullest GPU's peak "
                       f"{r['max_peak_allocated_bytes'] / GIB:.2f} GiB above ddp's "
                       f"{ddp_peak / GIB:.2f}")
    both = by.get("ladder-bf16-checkpoint", by.get("ladder-fp16-checkpoint"))
    alone = [r for n, r in by.items() if n in ("ladder-checkpoint", "ladder-bf16",
                                                  "ladder-fp16")]
    for a in alone if both is not None else []:
        if both["max_peak_allocated_bytes"] > a["max_peak_allocated_bytes"]:
            out.append(f"{short(both['name'])}'s peak "
                       f"({both['max_peak_allocated_bytes'] / GIB:.2f} GiB) above "
                       f"{short(a['name'])} alone ({a['max_peak_allocated_bytes'] / GIB:.2f})")
        elif both["need_bytes"] > a["need_bytes"] + GIB // 4:
            out.append(f"{short(both['name'])}'s need ({both['need_bytes'] / GIB:.2f} GiB) "
                       f"above {short(a['name'])} alone ({a['need_bytes'] / GIB:.2f}) with a "
                       f"lower peak ({both['max_peak_allocated_bytes'] / GIB:.2f} against "
                       f"{a['max_peak_allocated_bytes'] / GIB:.2f}): more reserved, unused")
    ckpt = by.get("ladder-checkpoint")
    if ckpt is not None and ddp_peak - ckpt["max_peak_allocated_bytes"] < ddp_peak / 100:
        out.append(f"checkpoint saves {(ddp_peak - ckpt['max_peak_allocated_bytes']) / GIB:.2f}"
                   f" GiB of ddp's {ddp_peak / GIB:.2f}")
    if ckpt is not None and not any(n.startswith("ladder-fsdp2") for n in by):
        out.append("no FSDP2 rung (its emulation failed; the ladder drops it silently)")
    ddp_delta = small["ddp"]["need_bytes"] - large["ddp"]["need_bytes"]
    big = {r["name"]: r for r in large["rungs"]}
    for name, r in by.items():
        o = big.get(name)
        if o is None or o["max_peak_allocated_bytes"] != r["max_peak_allocated_bytes"]:
            continue
        delta = r["need_bytes"] - o["need_bytes"]
        if abs(delta - ddp_delta) > GIB:
            out.append(f"{short(name)}: same peaks on both cards, need "
                       f"{r['need_bytes'] / GIB:.2f} GiB on {SMALL} and "
                       f"{o['need_bytes'] / GIB:.2f} on {LARGE} (ddp's differ by "
                       f"{ddp_delta / GIB:.2f})")
    return out


def measure(name: str, spec: str) -> dict[str, Any]:
    from dpprof.scenarios.workloads import load_workload

    wl = load_workload(spec)
    t0 = time.perf_counter()
    batch, tried = smallest_oom_batch(spec, wl)
    search_s = time.perf_counter() - t0
    small, without_s, with_s = ladder_on(spec, wl, batch, SMALL)
    large, without80_s, with80_s = ladder_on(spec, wl, batch, LARGE)
    return {"workload": wl.name, "batch": batch, "rows_per_gpu": -(-batch // GPUS),
            "batch_search": tried, "batch_search_s": round(search_s, 2),
            "cards": {SMALL: small, LARGE: large},
            "wall_s": {"compare_without_ladder": round(without_s, 2),
                       "compare_with_ladder": round(with_s, 2),
                       "ladder": round(with_s - without_s, 2),
                       "compare_without_ladder_80gb": round(without80_s, 2),
                       "compare_with_ladder_80gb": round(with80_s, 2),
                       "ladder_80gb": round(with80_s - without80_s, 2)},
            "flags": flags(small, large)}


def short(rung: str) -> str:
    return rung.removeprefix("ladder-")


def table(results: dict[str, Any]) -> list[str]:
    """One line per model and rung: peaks (GiB, the 24 GB run), need and fit on each card."""
    head = (f"{'model':<14} {'batch':>8} {'rung':<28} {'cuda:0':>7} {'fullest':>7} "
            f"{'need 24':>8} {'fit':>4} {'need 80':>8} {'fit':>4}")
    lines = [head, "-" * len(head)]
    for name, m in results.items():
        small, large = m["cards"][SMALL], m["cards"][LARGE]
        big = {r["name"]: r for r in large["rungs"]}
        rows = [("ddp", small["ddp"], large["ddp"])]
        rows += [(r["name"], r, big.get(r["name"])) for r in small["rungs"]]
        rows += [(r["name"], None, r) for r in large["rungs"]
                 if r["name"] not in {x["name"] for x in small["rungs"]}]
        for i, (rung, a, b) in enumerate(rows):
            ref = a or b
            label = short(rung)
            title = ref.get("title", "")
            if "micro-batches" in title:
                label += f" ({title.rsplit('(', 1)[-1].rstrip(')')}"
                label = label if label.endswith(")") else label + ")"
            lines.append(
                f"{name if i == 0 else '':<14} {m['batch'] if i == 0 else '':>8} {label:<28} "
                f"{ref['cuda0_peak_allocated_bytes'] / GIB:7.2f} "
                f"{ref['max_peak_allocated_bytes'] / GIB:7.2f} "
                + (f"{a['need_bytes'] / GIB:8.2f} {'yes' if a['fits'] else 'no':>4} "
                   if a else f"{'-':>8} {'-':>4} ")
                + (f"{b['need_bytes'] / GIB:8.2f} {'yes' if b['fits'] else 'no':>4}"
                   if b else f"{'-':>8} {'-':>4}"))
        w = m["wall_s"]
        fit24, fit80 = (short(c["cheapest_fit"] or "none") for c in (small, large))
        lines.append(f"{'':<14} {'':>8} cheapest fit: 24 GB {fit24}, 80 GB {fit80}; ladder "
                     f"{w['ladder']:.1f} s (compare {w['compare_with_ladder']:.1f} s with, "
                     f"{w['compare_without_ladder']:.1f} s without)")
        lines += [f"{'':<14} {'':>8} FLAG: {f}" for f in m["flags"]]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", help="short names (default: lm and the whole zoo)")
    ap.add_argument("--no-write", action="store_true", help="do not write ladder_zoo.json")
    args = ap.parse_args()
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    torch.set_num_threads(1)
    wanted = models()
    unknown = [m for m in args.models if m not in wanted]
    if unknown:
        raise SystemExit(f"unknown model(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(wanted)}")
    names = args.models or list(wanted)
    load = os.getloadavg()
    results = {}
    for name in names:
        print(f"{name} ...", flush=True)
        results[name] = measure(name, wanted[name])
    lines = table(results)
    print("\n".join(lines))
    if not args.no_write:
        out = {
            **machine(),
            "load_average_before": round(load[0], 2),
            "method": f"run_compare, emulated, meta tensors, {GPUS} GPUs, --scenarios ddp "
                      "--no-fixes --ladder, once per card; batch: the smallest power of two "
                      f"(from {FIRST_ROWS_PER_GPU} rows per GPU) where ddp needs more than "
                      f"{SMALL}; wall seconds in process, each the least of {TIMED_RUNS} runs, "
                      "torch on one thread, cores shared",
            "gpus": GPUS, "models": results, "table": lines,
        }
        (HERE / "ladder_zoo.json").write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {HERE / 'ladder_zoo.json'}")


if __name__ == "__main__":
    main()
