"""How far the emulator is from real GPUs: the same comparison run both ways.

    python benchmarks/emulator_vs_gpu.py --workload lm --batch 64 --gpus 2

Needs at least two CUDA GPUs (exits 2 otherwise). Runs ``--backend cuda`` and
``--backend emulated`` with the same workload, batch, GPUs and seed, prints per scenario
and device the measured and emulated peaks (allocated from ``torch.cuda.max_memory_allocated``,
reserved from ``max_memory_reserved``) and the relative error, and appends the rows to
``benchmarks/emulator_vs_gpu.jsonl`` with the GPU names and versions, so the figures are
recorded. Nothing here has been run yet: no GPU was available where dpprof was written.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

import torch

from dpprof.pipeline import CompareConfig, run_compare
from dpprof.result import RunResult
from dpprof.scenarios.step import StepConfig
from dpprof.units import fmt_bytes

RECORD = Path(__file__).with_name("emulator_vs_gpu.jsonl")


def _err(emulated: int | None, measured: int | None) -> float | None:
    if not emulated or not measured:
        return None
    return (emulated - measured) / measured


def compare_runs(real: RunResult, emu: RunResult) -> list[dict[str, object]]:
    """One row per scenario and device present in both runs."""
    rows: list[dict[str, object]] = []
    for s in real.scenarios:
        e = emu.scenario(s.name)
        if e is None:
            continue
        for d in s.devices:
            ed = e.device(d.index)
            if ed is None or not d.used:
                continue
            rows.append({
                "scenario": s.name, "device": d.index, "status": [s.status, e.status],
                "measured_allocated_bytes": d.peak_allocated_bytes,
                "emulated_allocated_bytes": ed.peak_allocated_bytes,
                "allocated_error": _err(ed.peak_allocated_bytes, d.peak_allocated_bytes),
                "measured_reserved_bytes": d.peak_reserved_bytes,
                "emulated_reserved_bytes": ed.peak_reserved_bytes,
                "reserved_error": _err(ed.peak_reserved_bytes, d.peak_reserved_bytes),
            })
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="lm")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--gpus", type=int, default=2)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.gpus:
        print(f"needs {args.gpus} CUDA GPUs; found "
              f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}", file=sys.stderr)
        return 2
    common = {"workload": args.workload, "step": StepConfig(batch=args.batch),
              "gpus": args.gpus, "fixes": False}
    props = torch.cuda.get_device_properties(0)
    capacity = props.total_memory
    cc = (props.major, props.minor)
    real = run_compare(CompareConfig(backend="cuda", gpu_memory_bytes=capacity, **common))
    emu = run_compare(CompareConfig(backend="emulated", gpu_memory_bytes=capacity,
                                    compute_capability=cc, **common))
    assert real is not None and emu is not None
    rows = compare_runs(real, emu)
    print(f"{'scenario':<16} {'dev':>3} {'measured':>10} {'emulated':>10} {'error':>7}"
          f" {'reserved':>10} {'emulated':>10} {'error':>7}")
    for r in rows:
        def pct(x: object) -> str:
            return f"{x:+.1%}" if isinstance(x, float) else "-"
        print(f"{r['scenario']:<16} {r['device']:>3} "
              f"{fmt_bytes(r['measured_allocated_bytes']):>10} "  # type: ignore[arg-type]
              f"{fmt_bytes(r['emulated_allocated_bytes']):>10} {pct(r['allocated_error']):>7} "  # type: ignore[arg-type]
              f"{fmt_bytes(r['measured_reserved_bytes']):>10} "  # type: ignore[arg-type]
              f"{fmt_bytes(r['emulated_reserved_bytes']):>10} {pct(r['reserved_error']):>7}")  # type: ignore[arg-type]
    record = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "gpu": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
        "args": vars(args), "rows": rows,
    }
    with RECORD.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    print(f"recorded in {RECORD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
