"""How far the emulator is from real GPUs: the same comparison run both ways.

    python benchmarks/emulator_vs_gpu.py                      # every visible GPU, all models
    python benchmarks/emulator_vs_gpu.py --gpus 1 --workloads lm,tests/zoo.py:gpt2 --batch 16

Needs at least one CUDA GPU (exits 2 otherwise). For each workload (the built-ins and, when
``tests/zoo.py``'s libraries are installed, the real-model zoo) it runs ``--backend cuda``
and ``--backend emulated`` with the same workload, batch, GPUs, seed and the GPU's capacity
and compute capability, then prints, per scenario and device:

* allocated: ``torch.cuda.max_memory_allocated`` against the emulated peak;
* reserved: ``max_memory_reserved`` against the simulated caching allocator;
* the device total: NVML's peak "used" against the emulated reserved + modelled context.

The rows (with errors, and any scenario's failure) are appended to
``benchmarks/emulator_vs_gpu.jsonl`` with the GPU's name and the versions. With one GPU,
DataParallel and DDP run over that single device: the rows still check ``single``, the
reserved model and the context. Nothing here has been run on a GPU yet: none was available
where dpprof was written.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dpprof.pipeline import CompareConfig, run_compare
from dpprof.result import RunResult
from dpprof.scenarios.step import StepConfig
from dpprof.scenarios.workloads import BUILTINS
from dpprof.self_check import compare_rows
from dpprof.units import fmt_bytes

RECORD = Path(__file__).with_name("emulator_vs_gpu.jsonl")
ZOO_FILE = Path(__file__).resolve().parent.parent / "tests" / "zoo.py"


def compare_runs(real: RunResult, emu: RunResult) -> list[dict[str, Any]]:
    """One row per scenario and used device present in both runs (``dpprof check``'s)."""
    return compare_rows(real, emu)


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def default_workloads(importable: Callable[[str], bool] = _importable) -> list[str]:
    """The built-ins, then each zoo model whose library is installed (``tests/zoo.py``
    imports without them; its models import their library when built)."""
    names = list(BUILTINS)
    sys.path.insert(0, str(ZOO_FILE.parent))
    try:
        import zoo  # tests/zoo.py: models from configs, no weights

        missing = sorted({zoo.NEEDS[n] for n in zoo.ZOO if not importable(zoo.NEEDS[n])})
        names += [f"{ZOO_FILE}:{name}" for name in zoo.ZOO if importable(zoo.NEEDS[name])]
        if missing:
            print(f"zoo models without {', '.join(missing)} skipped; pip install -e '.[zoo]'",
                  file=sys.stderr)
    except ImportError as e:
        print(f"zoo skipped ({e}); pip install -e '.[zoo]'", file=sys.stderr)
    finally:
        sys.path.remove(str(ZOO_FILE.parent))
    return names


def _pct(x: object) -> str:
    return f"{x:+.1%}" if isinstance(x, float) else "-"


def _b(x: object) -> str:
    return fmt_bytes(x) if isinstance(x, int) else "-"


def print_rows(workload: str, rows: list[dict[str, object]]) -> None:
    print(f"\n{workload}")
    print(f"{'scenario':<16} {'dev':>3} {'allocated':>10} {'emulated':>10} {'error':>7}"
          f" {'reserved':>10} {'emulated':>10} {'error':>7}"
          f" {'NVML used':>10} {'emu total':>10} {'error':>7}")
    for r in rows:
        print(f"{r['scenario']!s:<16} {r['device']!s:>3} "
              f"{_b(r['measured_allocated_bytes']):>10} {_b(r['emulated_allocated_bytes']):>10} "
              f"{_pct(r['allocated_error']):>7} "
              f"{_b(r['measured_reserved_bytes']):>10} {_b(r['emulated_reserved_bytes']):>10} "
              f"{_pct(r['reserved_error']):>7} "
              f"{_b(r['nvml_peak_used_bytes']):>10} {_b(r['emulated_total_bytes']):>10} "
              f"{_pct(r['total_error']):>7}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="",
                    help="comma-separated workload specs (default: built-ins and the zoo)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--gpus", type=int, default=0, help="0: every visible GPU")
    ap.add_argument("--amp", choices=("bfloat16", "float16"), default=None,
                    help="forward and loss under torch.autocast with this dtype")
    args = ap.parse_args()
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = args.gpus or visible
    if visible < 1 or gpus > visible:
        print(f"needs {max(gpus, 1)} CUDA GPU(s); found {visible}", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    cc = (props.major, props.minor)
    workloads = [w for w in args.workloads.split(",") if w] or default_workloads()
    for workload in workloads:
        common = {"workload": workload, "step": StepConfig(batch=args.batch, amp=args.amp),
                  "gpus": gpus,
                  "fixes": False, "gpu_memory_bytes": props.total_memory,
                  "count_reserved": True}
        t0 = time.perf_counter()
        record: dict[str, object] = {
            "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "gpu": props.name, "gpus": gpus, "torch": torch.__version__,
            "cuda": torch.version.cuda, "workload": workload, "batch": args.batch,
            "amp": args.amp,
        }
        try:  # one workload that cannot run (a missing library, a bug) is a row, not the end
            real = run_compare(CompareConfig(backend="cuda", **common))
            t1 = time.perf_counter()
            emu = run_compare(CompareConfig(backend="emulated", compute_capability=cc, **common))
            t2 = time.perf_counter()
        except Exception as e:
            record["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
            record["traceback"] = traceback.format_exc()
            print(f"\n{workload}: {record['error']}", file=sys.stderr)
        else:
            assert real is not None and emu is not None
            rows = compare_runs(real, emu)
            print_rows(workload, rows)
            record.update(cuda_wall_s=round(t1 - t0, 2), emulated_wall_s=round(t2 - t1, 2),
                          rows=rows)
        with RECORD.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    print(f"\nrecorded in {RECORD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
