"""The ladder's rungs on a real GPU: what ``torch.cuda`` measures for each, beside the emulator.

    OUT=/some/dir python scripts/gpu_ladder.py                    # on a machine with a GPU
    OUT=/some/dir python scripts/gpu_ladder.py --workload lm --batch 32 --parts bf16,checkpoint
    python scripts/gpu_ladder.py --emulated --record $OUT/ladder.json   # the emulator's side

Each rung (``--parts``, one fresh process each) runs dpprof's own rung workload
(:func:`dpprof.measure.rung_models.rung_workload`) through the cuda backend's ``single``
scenario on cuda:0: mixed precision, activation checkpointing of the repeated blocks, both,
gradient accumulation (``accumK``), and FSDP2 (``fsdp-zero2@N``, ``fsdp-zero3@N``, with
``-bf16`` (``MixedPrecisionPolicy``), ``-checkpoint`` and ``-offload``
(``CPUOffloadPolicy``)) as one rank of N over torch's fake process group: the collectives
return at once, every buffer FSDP2 allocates for them is real, on the streams FSDP2 uses.
An FSDP2 rank gets ``ceil(batch / N)`` rows. The record per rung: the allocator's peaks,
the step time, and the blocks alive at the allocated peak with their allocation sites.
The allocator's history is recorded with ``context="alloc"`` (``GPU_LADDER_HISTORY``: alloc,
all or none): with ``"all"`` (stacks of frees too) torch 2.11 on an H200 failed every
checkpointed rung with ``SystemError: <built-in method dropout ...> returned NULL without
setting an exception`` (a guess, not confirmed: non-reentrant checkpoint stops its
recomputation by raising, and a free recorded with its Python stack while that exception
unwinds loses it), and ran them with ``"alloc"`` or ``"none"`` (the same figures both ways).
``--emulated`` runs the same rungs through the emulator (no GPU needed) with the GPU's
capacity and compute capability read from the record, and prints both side by side.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

OUT = Path(os.environ.get("OUT", "gpu-ladder-out"))
DEFAULT_PARTS = ("plain,bf16,checkpoint,bf16-checkpoint,accum4,bf16-checkpoint-accum4,"
                 "fsdp-zero2@4,fsdp-zero3@4,fsdp-zero3-bf16-checkpoint@4,"
                 "fsdp-zero3-offload@4,fsdp-zero2-offload@4")


def parse(part: str, batch: int) -> tuple[Any, int, int]:
    """The rung a part names, the FSDP2 world (1: none) and the rank's rows."""
    from dpprof.measure.ladder_rungs import Rung

    name, _, world_s = part.partition("@")
    world = int(world_s) if world_s else 1
    words = name.split("-")
    fsdp = words[0] == "fsdp"
    accum = next((int(w[5:]) for w in words if w.startswith("accum")), 1)
    amp = "bfloat16" if "bf16" in words and not fsdp else None
    rung = Rung(name, name, amp, "checkpoint" in words, micro_batches=accum,
                reshard_after_forward=("zero3" in words) if fsdp else None,
                param_dtype="bfloat16" if fsdp and "bf16" in words else None,
                offload="offload" in words)
    return rung, world, math.ceil(batch / world)


def run_part(part: str, workload: str, batch: int, emulated: bool,
             capacity: int = 0, cc: tuple[int, int] = (9, 0)) -> dict[str, Any]:
    import contextlib

    import torch

    from dpprof.emulator.fsdp import emulated_ranks
    from dpprof.measure.rung_models import rung_workload
    from dpprof.scenarios.names import SINGLE
    from dpprof.scenarios.step import StepConfig
    from dpprof.scenarios.workloads import load_workload

    rung, world, rows = parse(part, batch)
    step = StepConfig(batch=rows, warmup=2, steps=3, amp=rung.amp,
                      micro_batches=rung.micro_batches)
    base = step.workload(load_workload(workload))
    fsdp = rung.reshard_after_forward is not None
    if fsdp and not emulated:
        # as the user's code does: the model on its GPU before fully_shard (on the host
        # with CPU offload, which FSDP2 requires), and not moved after
        import copy
        import dataclasses

        from dpprof.backends import cuda_measure
        from dpprof.scenarios.step import build_model

        build = base.model
        if not rung.offload and torch.cuda.is_available():
            base = dataclasses.replace(base, model=lambda: build().cuda())

        def as_placed(wl: Any, device: Any, seed: int) -> Any:
            loss_fn = wl.loss
            if isinstance(loss_fn, torch.nn.Module):
                loss_fn = copy.deepcopy(loss_fn).to(device)
            return build_model(wl, seed), loss_fn

        cuda_measure.model_on_device = as_placed
        import dpprof.backends.cuda as cuda_backend

        cuda_backend.model_on_device = as_placed  # type: ignore[attr-defined]
    wl = rung_workload(base, rung)
    group = emulated_ranks(world) if world > 1 else contextlib.nullcontext()
    if emulated:
        from dpprof.backends.emulated import EmulationConfig, run_scenario

        cfg = EmulationConfig(gpus=1, gpu_memory_bytes=capacity, step=step,
                              compute_capability=cc, count_reserved=True,
                              collectives=world > 1, host_model=rung.offload)
        with group:
            s = run_scenario(SINGLE, wl, cfg)
        d = s.devices[0] if s.devices else None
        return {"status": s.status, "message": s.message[:300],
                "allocated_bytes": d.gpu_allocated_bytes if d else None,
                "reserved_bytes": d.peak_reserved_bytes if d else None}
    from gpu_attribution import alive_at_peak

    from dpprof.backends.cuda import run_local_scenario
    from dpprof.backends.cuda_measure import CudaRunConfig

    gpu = torch.cuda.is_available()  # without: a dry run of the script on CPU tensors
    if not gpu:
        from dpprof.backends import cuda_host

        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from fake_cuda import CpuHost

        cuda_host.HOST = CpuHost(1)
    else:
        torch.cuda.set_device(0)
        history = os.environ.get("GPU_LADDER_HISTORY", "alloc")  # alloc, all or none
        if history != "none":
            torch.cuda.memory._record_memory_history(context=history, max_entries=400_000)
    with group:
        r = run_local_scenario(SINGLE, wl, CudaRunConfig(devices=[0], step=step,
                                                         nvml_interval_s=0.05))
    alive: dict[str, Any] = {}
    if gpu and os.environ.get("GPU_LADDER_HISTORY", "alloc") != "none":
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        alive = alive_at_peak(snap)
        alive["largest"] = alive["largest"][:15]
        alive["by_site"] = alive["by_site"][:25]
    d = r.devices[0]
    return {"status": r.status, "message": r.message[:300], "world": world, "rows": rows,
            "allocated_bytes": d.peak_allocated_bytes, "reserved_bytes": d.peak_reserved_bytes,
            "nvml_peak_used_bytes": d.nvml_peak_used_bytes,
            "step_time_s": r.step_time_s,
            "host_rss_bytes": _rss(), **alive}


def _rss() -> int | None:
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except (ImportError, OSError):
        return None


def gpu_head() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"gpu": "none (dry run)", "total_memory_bytes": 80 << 30,
                "compute_capability": [9, 0], "torch": torch.__version__, "cuda": None}
    p = torch.cuda.get_device_properties(0)
    return {"gpu": p.name, "total_memory_bytes": p.total_memory,
            "compute_capability": [p.major, p.minor], "torch": torch.__version__,
            "cuda": torch.version.cuda}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="lm")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--parts", default=DEFAULT_PARTS)
    ap.add_argument("--part", help=argparse.SUPPRESS)  # one part, in a fresh process
    ap.add_argument("--emulated", action="store_true",
                    help="run the emulator's side of --record and print both")
    ap.add_argument("--record", type=Path, default=None)
    args = ap.parse_args()
    if args.emulated:
        return compare_emulated(args.record or OUT / "ladder.json")
    if args.part:
        try:
            result = run_part(args.part, args.workload, args.batch, emulated=False)
        except Exception as exc:
            result = {"error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc()[-4000:]}
        print(json.dumps(result, default=str))
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    record_file = OUT / f"ladder-{Path(args.workload).name}-{args.batch}.json"
    results: dict[str, Any] = {"workload": args.workload, "batch": args.batch,
                               **gpu_head(), "parts": {}}
    for name in args.parts.split(","):
        p = subprocess.run([sys.executable, __file__, "--part", name, "--workload",
                            args.workload, "--batch", str(args.batch)],
                           capture_output=True, text=True, timeout=90)
        try:
            results["parts"][name] = json.loads(p.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            results["parts"][name] = {"error": f"exit {p.returncode}",
                                      "stderr": p.stderr[-3000:]}
        record_file.write_text(json.dumps(results, indent=1, default=str))
        r = results["parts"][name]
        print(f"{name:<36} {r.get('status', r.get('error'))!s:<12} "
              f"alloc {r.get('allocated_bytes')} reserved {r.get('reserved_bytes')} "
              f"step {r.get('step_time_s')}", flush=True)
    return 0


def compare_emulated(record: Path) -> int:
    rec = json.loads(record.read_text())
    cc = tuple(rec["compute_capability"])
    print(f"{rec['workload']} batch {rec['batch']} on {rec['gpu']} (torch {rec['torch']})")
    print(f"{'rung':<36} {'allocated':>13} {'emulated':>13} {'error':>7} "
          f"{'reserved':>13} {'emulated':>13} {'error':>7}")
    for name, real in rec["parts"].items():
        if "allocated_bytes" not in real:
            print(f"{name:<36} {real.get('error')}")
            continue
        emu = run_part(name, rec["workload"], rec["batch"], emulated=True,
                       capacity=rec["total_memory_bytes"], cc=cc)  # type: ignore[arg-type]

        def err(key: str, real: dict[str, Any] = real, emu: dict[str, Any] = emu) -> str:
            a, b = real.get(key), emu.get(key)
            return f"{(b - a) / a:+.1%}" if a and b is not None else "-"

        print(f"{name:<36} {real['allocated_bytes']!s:>13} {emu['allocated_bytes']!s:>13} "
              f"{err('allocated_bytes'):>7} {real['reserved_bytes']!s:>13} "
              f"{emu['reserved_bytes']!s:>13} {err('reserved_bytes'):>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
