"""What the NVML sampler costs the steps it times, as a mechanism, over the tests' fake NVML.

    python benchmarks/sampler_cost.py              # 1, 4, 8 GPUs; 0.2 ms per NVML call

The sampler thread reads, every interval, each GPU's memory, utilisation and process list;
in Python each reading holds the GIL for a moment, and with real NVML each call also costs
the driver's time (measured by ``dpprof check`` on a GPU: "one tick"). Here the fake NVML
spends ``--call-ms`` of CPU per call (a busy wait under the GIL: the worst case), and a
CPU training step (:func:`dpprof.backends.cuda_measure.step_closure` over the CPU stand-in) is
timed with the sampler off and on (:func:`dpprof.self_check.sampler_cost`). Prints a table and
appends it to ``benchmarks/sampler_cost.txt``. No assertion: on a GPU, ``dpprof check``
measures the real cost.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from fake_cuda import CpuOps  # noqa: E402
from fake_nvml import FakeDevice, FakeNvml  # noqa: E402

from dpprof.backends.cuda_measure import step_closure  # noqa: E402
from dpprof.scenarios.workloads import load_workload  # noqa: E402
from dpprof.self_check import sampler_cost  # noqa: E402

RECORD = HERE / "sampler_cost.txt"


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def slow_nvml(gpus: int, call_s: float, ranks: int) -> FakeNvml:
    """``gpus`` fake GPUs whose every query takes ``call_s``; each lists ``ranks`` processes
    (every DDP rank on every GPU, as NVML does with peer access)."""

    def used(n: int) -> int:
        _busy(call_s)
        return 2**30 + n

    def procs(n: int) -> list[tuple[int, int]]:
        _busy(call_s)
        return [(1000 + r, 2**28) for r in range(ranks)]

    return FakeNvml([FakeDevice(f"GPU-{i:08x}-0000-0000-0000-000000000000", used=used,
                                util=lambda n: (_busy(call_s), 50)[1], processes=procs)
                     for i in range(gpus)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="1,4,8")
    ap.add_argument("--call-ms", type=float, default=0.2)
    ap.add_argument("--interval", type=float, default=0.02)
    ap.add_argument("--workload", default="mlp")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    ops = CpuOps([0])
    step = step_closure(load_workload(args.workload), ops, args.batch)
    lines = [f"# {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')} "
             f"{args.workload} batch {args.batch}, {args.call_ms} ms per NVML call, "
             f"every {args.interval * 1e3:.0f} ms",
             f"{'gpus':>4} {'tick ms':>8} {'step off ms':>12} {'step on ms':>11} {'slowdown':>9}"]
    for gpus in (int(g) for g in args.gpus.split(",")):
        nvml = slow_nvml(gpus, args.call_ms / 1e3, ranks=gpus)
        c = sampler_cost(ops, nvml, list(range(gpus)), args.interval, step, steps=args.steps)
        lines.append(f"{gpus:>4} {c['tick_s'] * 1e3:>8.2f} {c['step_off_s'] * 1e3:>12.2f} "
                     f"{c['step_on_s'] * 1e3:>11.2f} {c['slowdown']:>+9.1%}")
    print("\n".join(lines))
    with RECORD.open("a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
