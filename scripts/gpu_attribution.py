"""Where a real GPU's allocations differ from the emulator's: every block alive at the peak.

    OUT=/some/dir python scripts/gpu_attribution.py              # on a machine with a GPU
    OUT=/some/dir python scripts/gpu_attribution.py --workload mlp --batch 64

For ``single`` and ``ddp`` (world 1, NCCL, in this process) it records the caching
allocator's history (``torch.cuda.memory._record_memory_history``) over a measured step,
replays the trace to the moment ``memory_allocated`` peaked, and lists every block alive then
with its size and the innermost Python frames that asked for it. It also measures what the
libraries take beside the tensors: ``memory_allocated``'s growth at the first matmul on the
main thread, an ``addmm`` (cuBLASLt), the autograd thread's backward, another thread, a side
stream, and the first convolution (cuDNN: library memory outside the allocator, workspace
inside it). Each part runs in a fresh process. Results: ``$OUT/attribution.json``; the
snapshots as ``$OUT/<part>.pickle`` (``torch.cuda.memory._snapshot`` format, readable at
pytorch.org/memory_viz).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import threading
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

OUT = Path(os.environ.get("OUT", "gpu-attribution-out"))


def _sync_allocated() -> int:
    import torch

    torch.cuda.synchronize()
    return int(torch.cuda.memory_allocated())


def libraries() -> dict[str, Any]:
    """memory_allocated's growth at each library's first use, the outputs freed first."""
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda:0")
    a = torch.randn(256, 1024, device=dev)
    w = torch.randn(1024, 1024, device=dev)
    b = torch.randn(1024, device=dev)
    out: dict[str, Any] = {
        "env": {k: os.environ.get(k) for k in (
            "CUBLAS_WORKSPACE_CONFIG", "TORCH_CUBLASLT_UNIFIED_WORKSPACE",
            "TORCH_CUBLAS_WORKSPACE_CACHE", "CUBLASLT_WORKSPACE_SIZE", "CUDA_MODULE_LOADING")},
        "preferred_blas_library": str(torch.backends.cuda.preferred_blas_library()),
    }

    def grew(name: str, fn: Any) -> None:
        before = _sync_allocated()
        fn()
        out[name] = _sync_allocated() - before

    grew("mm_main_thread", lambda: torch.mm(a, w))
    grew("addmm_main_thread", lambda: torch.addmm(b, a, w))
    grew("linear_bias_main_thread", lambda: F.linear(a, w, b))
    grew("bf16_mm_main_thread", lambda: torch.mm(a.bfloat16(), w.bfloat16()))
    wr = w.clone().requires_grad_(True)

    def backward() -> None:
        (a @ wr).sum().backward()
        wr.grad = None

    grew("backward_autograd_thread", backward)
    t = threading.Thread(target=lambda: torch.mm(a, w))

    def other_thread() -> None:
        t.start()
        t.join()

    grew("mm_other_thread", other_thread)
    s = torch.cuda.Stream()

    def side_stream() -> None:
        with torch.cuda.stream(s):
            torch.mm(a, w)
        torch.cuda.current_stream().wait_stream(s)

    grew("mm_side_stream", side_stream)
    try:
        from dpprof.nvml import libnvml

        nv = libnvml.default_nvml()
        pid = os.getpid()

        def process_used() -> int | None:
            torch.cuda.synchronize()
            procs = nv.processes(0) or []
            return next((p.used_bytes for p in procs if p.pid == pid), None)
    except Exception:  # NVML is optional here
        def process_used() -> int | None:
            return None
    x = torch.randn(32, 64, 56, 56, device=dev, requires_grad=True)
    conv = torch.nn.Conv2d(64, 64, 3, padding=1).to(dev)
    used0, reserved0 = process_used(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    base = _sync_allocated()
    y = conv(x)
    y.sum().backward()
    peak = int(torch.cuda.max_memory_allocated())
    kept = _sync_allocated() - base
    used1, reserved1 = process_used(), torch.cuda.memory_reserved()
    tensors = y.nbytes + x.nbytes + sum(p.nbytes for p in conv.parameters())  # y, grads
    out["conv_first_use"] = {
        "peak_over_start_bytes": peak - base, "kept_bytes": kept,
        "tensor_bytes_of_outputs_and_grads": tensors,
        "workspace_estimate_bytes": peak - base - tensors,
        "outside_allocator_growth_bytes": None if used0 is None or used1 is None
        else (used1 - used0) - (reserved1 - reserved0),
        "cudnn_version": torch.backends.cudnn.version(),
    }
    return out


def alive_at_peak(snapshot: dict[str, Any]) -> dict[str, Any]:
    """Replay device 0's trace; the blocks alive when allocated bytes peaked."""
    trace = snapshot["device_traces"][0]
    live: dict[int, dict[str, Any]] = {}
    total = best = 0
    best_live: dict[int, dict[str, Any]] = {}
    for ev in trace:
        action = ev["action"]
        if action == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
            if total > best:
                best, best_live = total, dict(live)
        elif action == "free_completed":
            gone = live.pop(ev["addr"], None)
            if gone is not None:
                total -= gone["size"]

    def where(ev: dict[str, Any]) -> str:
        frames = [f for f in ev.get("frames", []) if f.get("filename", "").endswith(".py")]
        mine = [f for f in frames if "/torch/" not in f["filename"]][:2]
        inner = frames[:2]
        return " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}"
                          for f in (inner + mine)) or "(no Python frame: C++)"

    blocks = sorted(best_live.values(), key=lambda e: -e["size"])
    by_site = Counter()
    for ev in blocks:
        by_site[where(ev)] += ev["size"]
    return {
        "trace_peak_allocated_bytes": best,
        "blocks": len(blocks),
        "largest": [{"bytes": e["size"], "where": where(e)} for e in blocks[:40]],
        "by_site": [{"bytes": n, "where": w} for w, n in by_site.most_common(40)],
    }


def scenario(kind: str, workload: str, batch: int, amp: str | None = None) -> dict[str, Any]:
    import torch

    from dpprof.backends.cuda import run_local_scenario
    from dpprof.backends.cuda_ddp import measure_ddp_rank
    from dpprof.backends.cuda_measure import CudaRunConfig
    from dpprof.scenarios.step import StepConfig
    from dpprof.scenarios.workloads import load_workload

    cfg = CudaRunConfig(devices=[0], nvml_interval_s=0.05,
                        step=StepConfig(batch=batch, warmup=1, steps=2, amp=amp))
    wl = cfg.step.workload(load_workload(workload))
    torch.cuda.set_device(0)
    torch.cuda.memory._record_memory_history(max_entries=500_000)
    if kind == "ddp":
        import torch.distributed as dist

        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda:0"))
        try:
            m = measure_ddp_rank(wl, cfg, 0, 1, 0)
        finally:
            dist.destroy_process_group()
        status, devices = m.status, m.devices
    else:
        r = run_local_scenario(kind, wl, cfg)
        status, devices = r.status, r.devices
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(OUT / f"{kind}.pickle", "wb") as f:
        pickle.dump(snap, f)
    d = devices[0]
    return {"status": status, "reported_peak_allocated_bytes": d.peak_allocated_bytes,
            "reported_peak_reserved_bytes": d.peak_reserved_bytes,
            "nvml_peak_used_bytes": d.nvml_peak_used_bytes,
            "nvml_unexplained_bytes": d.nvml_unexplained_bytes, **alive_at_peak(snap)}


def ddp_timing(workload: str, batch: int, backend: str, pause_s: float) -> dict[str, Any]:
    """DDP (world 1) step by step: each step's peak allocated over the tensors it started
    with, with ``pause_s`` between steps. A params-sized excess that fades with the pause is
    a buffer the process group keeps until its watchdog reaps the finished collective."""
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpprof.scenarios.workloads import load_workload

    wl = load_workload(workload)
    torch.cuda.set_device(0)
    dev = torch.device("cuda:0")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            device_id=dev if backend == "nccl" else None)
    try:
        torch.manual_seed(0)
        model = DDP(wl.model().to(dev), device_ids=[0])
        opt = wl.optimizer(model.parameters()) if wl.optimizer else torch.optim.SGD(
            model.parameters(), lr=1e-3)
        params = sum(p.nbytes for p in model.parameters())
        steps = []
        for _ in range(6):
            x, y = wl.batch(batch, dev)
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            opt.zero_grad(set_to_none=True)
            loss = wl.loss(model(x), y)
            loss.backward()
            opt.step()
            torch.cuda.synchronize()
            steps.append({"start_bytes": start,
                          "peak_bytes": int(torch.cuda.max_memory_allocated()),
                          "end_bytes": int(torch.cuda.memory_allocated())})
            del x, y, loss
            time.sleep(pause_s)
    finally:
        dist.destroy_process_group()
    return {"backend": backend, "pause_s": pause_s, "param_bytes": params, "steps": steps}


def part(name: str, workload: str, batch: int, amp: str | None = None) -> dict[str, Any]:
    if name == "libraries":
        return libraries()
    if name.startswith("timing-"):  # timing-BACKEND-PAUSE
        _, backend, pause = name.split("-")
        return ddp_timing(workload, batch, backend, float(pause))
    return scenario(name, workload, batch, amp)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="mlp")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--amp", choices=("bfloat16", "float16"), default=None)
    ap.add_argument("--part", help=argparse.SUPPRESS)  # one part, in a fresh process
    ap.add_argument("--parts", default="libraries,single,ddp",
                    help="which parts, in order (also timing-nccl-0, timing-nccl-0.5, "
                         "timing-gloo-0: DDP step by step with that pause)")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.part:
        try:
            result = part(args.part, args.workload, args.batch, args.amp)
        except Exception as exc:
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        print(json.dumps(result, default=str))
        return 0
    results: dict[str, Any] = {"workload": args.workload, "batch": args.batch}
    for name in args.parts.split(","):
        p = subprocess.run([sys.executable, __file__, "--part", name, "--workload",
                            args.workload, "--batch", str(args.batch),
                            *(["--amp", args.amp] if args.amp else [])],
                           capture_output=True, text=True, timeout=240)
        try:
            results[name] = json.loads(p.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            results[name] = {"error": f"exit {p.returncode}", "stderr": p.stderr[-3000:]}
        (OUT / "attribution.json").write_text(json.dumps(results, indent=1, default=str))
        print(name, json.dumps(results[name], default=str)[:3000], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
