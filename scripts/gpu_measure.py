"""What a real GPU shows beyond the allocator's steady state: the figures the emulator models.

    OUT=/some/dir python scripts/gpu_measure.py                 # on a machine with a GPU
    OUT=/some/dir python scripts/gpu_measure.py --parts rates,cudnn --deadline-s 120
    GPU_MEASURE_DRY=1 OUT=/tmp/m python scripts/gpu_measure.py  # the plumbing, on a CPU

Each part runs in a fresh process (a fresh CUDA context, nothing cached) and appends its
record to ``$OUT/measure.json`` as soon as it ends, so a run cut short keeps what it did:

* ``rates``: the GPU's measured rates: dense matrix products (float32, TF32, bfloat16,
  float16), a device-to-device copy, and the cost of one small kernel (launch and GPU).
* ``kernels``: for each workload (float32 and bfloat16 autocast), the ``single`` step's time
  (CUDA events, median of 10 after 3 warm-up steps) and, from ``torch.profiler`` over one
  more step, every op's device time, FLOPs, input shapes and count, and each kernel's time.
* ``cudnn``: each convolution's workspace: the peak ``memory_allocated`` of a forward and of
  a backward over the tensors they keep, for the built-ins' convolutions and a grid of
  shapes, float32 (TF32 on, torch's default for cuDNN) and bfloat16, ``benchmark`` off
  (torch's default) and on.
* ``rank-W``: a fresh DDP rank (NCCL, world 1) of workload W: the process's NVML used memory,
  the device's, and the allocator's reserved at each stage (context, cuBLAS, cuDNN, the
  process group, the DDP model, each step; NCCL's channels and device allocations as its
  NCCL_DEBUG=INFO log gives them); then each step's peak over six steps, float32
  and bfloat16 autocast, without a pause and with 0.3 s between steps (the first
  iteration's buckets kept until ProcessGroupNCCL's watchdog reaps the all-reduce).
* ``segments-W-RUNG``: a ladder rung (``scripts/gpu_ladder.py``) with the caching allocator's
  segments: each one's size, stream, pool, and what asked for it (``segment_alloc`` events of
  the allocator's history), the reserved bytes over time, and the blocks alive at the peak.
  ``segments-classifier:16:plain`` is ``single`` itself (classifier's reserved, 4 % above
  the emulator's, decided by its cuDNN workspaces' segments).
* ``conv-split``: each convolution's backward in its two cuDNN calls, measured apart
  (``aten.convolution_backward`` with ``output_mask`` for the input's gradient only, then
  the weight's only): the workspace of each, and of the forward, as ``cudnn`` measures them;
  the input's gradient only where the input requires it (a first layer's backward computes
  the weight's alone).

``--jobs N`` runs the memory-only parts (``cudnn``, ``segments-*``) N at a time; the timed
parts (``rates``, ``kernels``, ``rank-*``) run alone. ``--deadline-s`` stops starting parts
once that many seconds have passed and cuts the one running at the deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

OUT = Path(os.environ.get("OUT", "gpu-measure-out"))
DRY = os.environ.get("GPU_MEASURE_DRY") == "1"  # no GPU: every part on the CPU, to test plumbing

# (workload spec, batch) as the earlier records measured them (h100_measured.json's
# benchmark: batch 16, the zoo at 8) and a larger batch where a step is launch-bound
KERNEL_WORKLOADS = ("mlp:64,mlp:512,lm:16,lm:64,attention:16,convnet:32,convnet:256,"
                    "classifier:16,classifier:64,zoo:gpt2:8,zoo:timm_vit:8")
RANK_WORKLOADS = ("mlp", "lm", "attention", "convnet", "classifier", "convnet", "classifier")
SEGMENT_RUNGS = ("lm:32:fsdp-zero3-bf16-checkpoint@4", "lm:32:fsdp-zero3-offload@4",
                 "lm:32:fsdp-zero2-offload@4", "lm:32:fsdp-zero3-bf16-checkpoint-offload@4",
                 "lm:32:fsdp-zero3@4", "attention:64:fsdp-zero2@4",
                 "attention:64:fsdp-zero3-offload@4", "attention:64:fsdp-zero2-offload@4",
                 "attention:64:fsdp-zero3@4", "classifier:16:plain")
# in order of need: the memory-only parts next to each other run together (--jobs)
DEFAULT_PARTS = ["rates", *(f"rank-{w}" for w in RANK_WORKLOADS), "nccl-clique", "cudnn",
                 "cudnn-benchmark", "conv-split",
                 *(f"segments-{r}" for r in SEGMENT_RUNGS), "kernels"]
MEMORY_ONLY = ("cudnn", "conv-split", "segments-", "expandable-")  # cudnn-benchmark too


def _device() -> Any:
    import torch

    return torch.device("cpu" if DRY else "cuda:0")


def _sync() -> None:
    import torch

    if not DRY:
        torch.cuda.synchronize()


def _timed_ms(fn: Callable[[], Any], repeat: int, warmup: int = 3) -> list[float]:
    """Each call's time in ms: CUDA events on a GPU, the wall clock on the dry run."""
    import torch

    for _ in range(warmup):
        fn()
    _sync()
    out = []
    for _ in range(repeat):
        if DRY:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def head() -> dict[str, Any]:
    import torch

    rec: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "dry": DRY, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                 time.gmtime())}
    if not DRY and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        rec.update(gpu=p.name, total_memory_bytes=p.total_memory,
                   compute_capability=[p.major, p.minor],
                   multiprocessors=p.multi_processor_count,
                   cudnn=torch.backends.cudnn.version(),
                   nccl=".".join(map(str, torch.cuda.nccl.version())),
                   matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
                   cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
                   env={k: v for k, v in os.environ.items()
                        if k.startswith(("NCCL_", "CUDA_", "PYTORCH_", "TORCH_NCCL",
                                         "CUBLAS", "CUDNN"))})
    return rec


# ------------------------------------------------------------------------------------ rates


def rates() -> dict[str, Any]:
    import torch

    dev = _device()
    n = 512 if DRY else 8192
    out: dict[str, Any] = {"matmul_n": n}
    for name, dtype, tf32 in (("float32", torch.float32, False), ("tf32", torch.float32, True),
                              ("bfloat16", torch.bfloat16, False),
                              ("float16", torch.float16, False)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a = torch.randn(n, n, device=dev, dtype=dtype)
        b = torch.randn(n, n, device=dev, dtype=dtype)
        ms = _timed_ms(lambda a=a, b=b: a @ b, repeat=10)
        out[f"matmul_{name}_tflops"] = 2 * n**3 / (statistics.median(ms) * 1e-3) / 1e12
        del a, b
    torch.backends.cuda.matmul.allow_tf32 = False
    for mib in (64, 1024):
        x = torch.empty(mib << 20, dtype=torch.uint8, device=dev)
        y = torch.empty_like(x)
        ms = _timed_ms(lambda x=x, y=y: y.copy_(x), repeat=10)
        # read and written: the bytes a copy moves
        out[f"copy_{mib}mib_gbytes_per_s"] = 2 * x.numel() / (statistics.median(ms) * 1e-3) / 1e9
        del x, y
    tiny = torch.zeros(1, device=dev)

    def launches() -> None:
        for _ in range(1000):
            tiny.add_(1)

    ms = _timed_ms(launches, repeat=5, warmup=1)
    out["small_kernel_us_back_to_back"] = statistics.median(ms)  # ms per 1000 = us each
    t0 = time.perf_counter()
    for _ in range(1000):
        tiny.add_(1)
    out["small_kernel_host_us"] = (time.perf_counter() - t0) * 1e3  # ms per 1000 = us each
    _sync()
    return out


# ---------------------------------------------------------------------------------- kernels


def _workload(spec: str) -> Any:
    from dpprof.scenarios.workloads import load_workload

    if spec.startswith("zoo:"):
        sys.path.insert(0, str(HERE.parent / "tests"))
        return load_workload(f"{HERE.parent / 'tests' / 'zoo.py'}:{spec[4:]}")
    return load_workload(spec)


def _step_fn(spec: str, rows: int, amp: str | None) -> tuple[Callable[[], Any], dict[str, Any]]:
    """The tutorial's step (as dpprof's ``single`` runs it) and what it is made of."""
    import torch

    from dpprof.scenarios.workloads import make_optimizer

    dev = _device()
    wl = _workload(spec)
    torch.manual_seed(0)
    model = wl.model().to(dev)
    loss_fn = wl.loss
    if isinstance(loss_fn, torch.nn.Module):
        loss_fn = loss_fn.to(dev)
    opt = make_optimizer(wl, model, loss_fn)
    batches = [wl.batch(rows, dev) for _ in range(2)]
    counter = [0]
    dtype = getattr(torch, amp) if amp else None

    def call(x: Any) -> Any:
        if isinstance(x, dict):
            return model(**x)
        return model(*x) if isinstance(x, tuple) else model(x)

    def step() -> Any:
        x, y = batches[counter[0] % 2]
        counter[0] += 1
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(call(x), y)
        loss.backward()
        opt.step()
        return loss

    params = sum(p.numel() for p in model.parameters())
    return step, {"parameters": params, "optimizer": type(opt).__name__}


def kernels(specs: str = KERNEL_WORKLOADS) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    out: dict[str, Any] = {"runs": []}
    for item in specs.split(","):
        spec, _, rows_s = item.rpartition(":")
        rows = int(rows_s)
        if DRY:
            rows = min(rows, 4)
        for amp in (None, "bfloat16"):
            rec: dict[str, Any] = {"workload": spec, "batch": rows, "amp": amp}
            out["runs"].append(rec)
            try:
                step, about = _step_fn(spec, rows, amp)
                rec.update(about)
                ms = _timed_ms(step, repeat=3 if DRY else 10, warmup=3)
                rec["step_ms"] = ms
                rec["step_ms_median"] = statistics.median(ms)
                acts = [ProfilerActivity.CPU] + ([] if DRY else [ProfilerActivity.CUDA])
                with profile(activities=acts, record_shapes=True, with_flops=True) as prof:
                    step()
                    _sync()
                ops = []
                for e in prof.key_averages(group_by_input_shape=True):
                    dev_us = getattr(e, "self_device_time_total", 0) or 0
                    cpu_us = e.self_cpu_time_total
                    if dev_us <= 0 and cpu_us < 5:
                        continue
                    ops.append({"op": e.key, "shapes": str(e.input_shapes)[:300],
                                "count": e.count, "self_device_us": round(dev_us, 2),
                                "self_cpu_us": round(cpu_us, 2),
                                "flops": int(e.flops or 0)})
                ops.sort(key=lambda o: -o["self_device_us"])
                rec["ops"] = ops[:120]
                by_kernel: dict[str, list[float]] = {}
                for ev in prof.events():
                    if str(ev.device_type).endswith("CUDA") and ev.device_time_total:
                        by_kernel.setdefault(ev.name[:160], []).append(ev.device_time_total)
                rec["kernels"] = sorted(
                    ({"kernel": k, "count": len(v), "total_us": round(sum(v), 2)}
                     for k, v in by_kernel.items()), key=lambda r: -r["total_us"])[:80]
                rec["kernel_total_us"] = round(sum(sum(v) for v in by_kernel.values()), 2)
            except Exception as e:  # one workload's failure is a row, not the end
                rec["error"] = f"{type(e).__name__}: {e}"[:500]
            finally:
                if not DRY:
                    torch.cuda.empty_cache()
            print(f"kernels {spec} b{rows} {amp}: {rec.get('step_ms_median', rec.get('error'))}",
                  file=sys.stderr, flush=True)
            _partial(out)
    return out


def _partial(result: Any) -> None:
    """What a long part has so far, for its parent to keep if the deadline cuts it."""
    path = os.environ.get("GPU_MEASURE_PARTIAL")
    if path:
        Path(path).write_text(json.dumps(result, default=str))


# ------------------------------------------------------------------------------------ cudnn


def _conv_grid() -> list[tuple[int, int, int, int, int, int, int]]:
    """(N, C_in, H=W, C_out, kernel, stride, padding): the built-ins' convolutions, then a
    grid over the shapes image models use."""
    builtins = [(32, 1, 28, 32, 3, 1, 0), (32, 32, 26, 64, 3, 1, 0),   # convnet
                (16, 3, 112, 64, 3, 2, 1), (16, 64, 56, 128, 3, 2, 1),  # classifier
                (16, 128, 28, 256, 3, 2, 1),
                (64, 3, 112, 64, 3, 2, 1), (64, 64, 56, 128, 3, 2, 1),
                (64, 128, 28, 256, 3, 2, 1), (256, 1, 28, 32, 3, 1, 0),
                (256, 32, 26, 64, 3, 1, 0),
                (8, 3, 224, 64, 7, 2, 3), (8, 64, 56, 64, 3, 1, 1),     # a ResNet's
                (8, 64, 56, 128, 1, 2, 0), (8, 256, 14, 256, 3, 1, 1),
                (8, 3, 224, 192, 16, 16, 0)]                            # a ViT's patches
    grid = []
    for n in (8, 64):
        for c_in, side in ((3, 224), (64, 56), (256, 14)):
            for c_out in (64, 256):
                for k, s in ((1, 1), (3, 1), (3, 2), (7, 2)):
                    grid.append((n, c_in, side, c_out, k, s, k // 2))
    return builtins + grid


def _over_the_grid(dry_shapes: int, requires_grad: bool,
                   measure: Callable[[dict[str, Any], Any, Any, int, int], None],
                   **fields: Any) -> list[dict[str, Any]]:
    """A row for each convolution of the grid, in float32 and bfloat16 (dry: its first
    ``dry_shapes`` shapes, float32): the shape, ``fields``, and what ``measure(row, x, w,
    stride, padding)`` writes in it (an error it raises, the row's); the cache emptied after
    each."""
    import torch

    dev = _device()
    rows = []
    grid = _conv_grid()[:dry_shapes] if DRY else _conv_grid()
    for dtype in (torch.float32, torch.bfloat16):
        for n, c_in, side, c_out, k, s, p in grid:
            if DRY and dtype is torch.bfloat16:
                continue
            x = torch.randn(n, c_in, side, side, device=dev, dtype=dtype,
                            requires_grad=requires_grad)
            w = torch.randn(c_out, c_in, k, k, device=dev, dtype=dtype,
                            requires_grad=requires_grad)
            row: dict[str, Any] = {"n": n, "c_in": c_in, "side": side, "c_out": c_out,
                                   "kernel": k, "stride": s, "padding": p,
                                   "dtype": str(dtype).split(".")[-1], **fields}
            try:
                measure(row, x, w, s, p)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            del x, w
            if not DRY:
                torch.cuda.empty_cache()
    return rows


def cudnn(benchmark: bool = False) -> dict[str, Any]:
    """Each convolution's workspace, forward and backward, at its first call (where cuDNN's
    engine is picked) and again. ``benchmark``: with torch.backends.cudnn.benchmark on, in a
    process of its own (its part): torch keys its plan cache without the flag
    (ConvolutionParams), so after a pass with it off the trials would never run; the first
    call's peak then holds the trials' workspace (Conv_v8.cpp, generate_and_filter_plans:
    the largest any candidate engine asks, up to the free memory)."""
    import torch
    import torch.nn.functional as F

    def measure(row: dict[str, Any], x: Any, w: Any, s: int, p: int) -> None:
        for first in (True, False):  # the first call picks; the second reuses
            _sync()
            base = _allocated()
            _reset_peak()
            y = F.conv2d(x, w, None, s, p)
            _sync()
            fwd = _peak() - base - y.nbytes
            gy = torch.randn_like(y)
            _sync()
            base2 = _allocated()
            _reset_peak()
            gx, gw = torch.autograd.grad(y, (x, w), gy)
            _sync()
            bwd = _peak() - base2 - gx.nbytes - gw.nbytes
            key = "first" if first else "again"
            row[f"forward_workspace_bytes_{key}"] = fwd
            row[f"backward_workspace_bytes_{key}"] = bwd
            del y, gy, gx, gw
        row.update(x_bytes=x.nbytes, w_bytes=w.nbytes,
                   y_shape=list(F.conv2d(x.detach(), w.detach(), None, s, p).shape))

    torch.backends.cudnn.benchmark = benchmark
    try:
        return {"rows": _over_the_grid(6, True, measure, benchmark=benchmark)}
    finally:
        torch.backends.cudnn.benchmark = False


def conv_split() -> dict[str, Any]:
    """Each convolution's backward as cuDNN's two calls (the input's gradient, the weight's),
    measured apart: the peak ``memory_allocated`` of each beyond the gradient it returns."""
    import torch

    conv_bwd = torch.ops.aten.convolution_backward.default

    def measure(row: dict[str, Any], x: Any, w: Any, s: int, p: int) -> None:
        y = torch.nn.functional.conv2d(x, w, None, s, p)
        gy = torch.randn_like(y)
        for name, mask in (("input_grad", [True, False, False]),
                           ("weight_grad", [False, True, False])):
            _sync()
            base = _allocated()
            _reset_peak()
            out = conv_bwd(gy, x, w, None, [s, s], [p, p], [1, 1], False, [0, 0], 1, mask)
            _sync()
            kept = sum(t.nbytes for t in out if t is not None)
            row[f"{name}_workspace_bytes"] = _peak() - base - kept
            del out
        row.update(x_bytes=x.nbytes, w_bytes=w.nbytes, y_bytes=y.nbytes)

    return {"rows": _over_the_grid(4, False, measure)}


def _allocated() -> int:
    import torch

    return 0 if DRY else int(torch.cuda.memory_allocated())


def _reset_peak() -> None:
    import torch

    if not DRY:
        torch.cuda.reset_peak_memory_stats()


def _peak() -> int:
    import torch

    return 0 if DRY else int(torch.cuda.max_memory_allocated())


# ------------------------------------------------------------------------------------- rank


def _nvml_reader() -> Callable[[], dict[str, int | None]]:
    """NVML's used memory: this process's (None where the container hides PIDs) and the
    device's."""
    pid = os.getpid()
    try:
        from dpprof.nvml import libnvml

        nv = libnvml.default_nvml()
        if not nv.status().available:
            raise RuntimeError(nv.status().reason)
    except Exception:
        return lambda: {"process_used_bytes": None, "device_used_bytes": None}

    def read() -> dict[str, int | None]:
        procs = nv.processes(0) or []
        mine = next((p.used_bytes for p in procs if p.pid == pid), None)
        mem = nv.memory(0)
        return {"process_used_bytes": mine,
                "device_used_bytes": mem.used if mem else None}

    return read


def _nccl_log(text: str) -> dict[str, Any]:
    """What NCCL_DEBUG=INFO (INIT, ALLOC) printed that sizes its memory on the GPU: its
    channels, and every device allocation as asked (cuMem rounds each up to 2 MiB), for
    dpprof.emulator.nccl_memory's fixed part."""
    import re

    channels = re.findall(r"(\d+) coll channels, (?:\d+ collnet channels, )?(\d+) nvls channels",
                          text)
    sizes = [int(n) for n in re.findall(
        r"(?:Cuda Alloc Size|Allocated shareable buffer \S+ size) (\d+)", text)]
    return {"coll_channels": int(channels[-1][0]) if channels else None,
            "nvls_channels": int(channels[-1][1]) if channels else None,
            "device_allocations": len(sizes), "device_allocated_bytes": sum(sizes),
            "lines": [line for line in text.splitlines()
                      if "channels" in line or "Alloc Size" in line][:400]}


def _stages() -> tuple[list[dict[str, Any]], Callable[[str], None]]:
    """The readings at each stage of a part (NVML's used memory, the allocator's), and the
    function that takes one."""
    import torch

    nvml = _nvml_reader()
    stages: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    def stage(name: str) -> None:
        _sync()
        row: dict[str, Any] = {"stage": name, **nvml(), "t_s": round(time.perf_counter() - t0, 3)}
        if not DRY:
            row.update(reserved_bytes=int(torch.cuda.memory_reserved()),
                       allocated_bytes=int(torch.cuda.memory_allocated()))
        stages.append(row)

    return stages, stage


def _nccl_logged(name: str) -> Path:
    """NCCL's own account of its channels and device allocations, asked of it (read at its
    init) into the file returned."""
    log = OUT / f"nccl-{name}-{os.getpid()}.log"
    os.environ.setdefault("NCCL_DEBUG", "INFO")
    os.environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT,ALLOC")
    os.environ.setdefault("NCCL_DEBUG_FILE", str(log))
    return log


def nccl_clique() -> dict[str, Any]:
    """torch.cuda.nccl's communicator on one GPU (``ncclCommInitAll`` over [0], as
    DataParallel's broadcast and reduce make one on each of their GPUs), then a process
    group's beside it in the same process: NVML's growth at each, for
    dpprof.emulator.nccl_memory's fixed part of a communicator torch.cuda.nccl makes, and
    whether a second communicator in one process costs it again (the code loaded once)."""
    import torch
    import torch.distributed as dist

    stages, stage = _stages()
    stage("start")
    dev = _device()
    torch.empty(1, device=dev)
    stage("context")
    a = torch.randn(512, 512, device=dev)
    (a @ a).sum().item()
    stage("cublas")
    log = _nccl_logged("clique")
    out: dict[str, Any] = {"stages": stages}
    if DRY:  # a CPU build has no torch.cuda.nccl: the plumbing only
        return out
    t = torch.ones(1 << 20, device=dev)
    torch.cuda.nccl.all_reduce([t])
    stage("nccl_clique")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=dev)
    try:
        dist.all_reduce(t)
        stage("process_group")
    finally:
        dist.destroy_process_group()
    if log.exists():
        out["nccl"] = _nccl_log(log.read_text(errors="replace"))
    return out


def rank(workload: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpprof.scenarios.workloads import make_optimizer

    nvml = _nvml_reader()
    stages, stage = _stages()
    stage("start")
    dev = _device()
    if not DRY:
        torch.cuda.set_device(0)
    torch.empty(1, device=dev)
    stage("context")
    a = torch.randn(512, 512, device=dev)
    (a @ a).sum().item()
    stage("cublas")
    wl = _workload(workload)
    uses_conv = any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in wl.model().modules())
    if uses_conv:
        x = torch.randn(2, 3, 16, 16, device=dev, requires_grad=True)
        torch.nn.functional.conv2d(x, torch.randn(8, 3, 3, 3, device=dev)).sum().backward()
        stage("cudnn")
    backend = "gloo" if DRY else "nccl"
    nccl_log = _nccl_logged(workload)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            device_id=None if DRY else dev)
    t = torch.ones(1 << 20, device=dev)
    dist.all_reduce(t)
    stage("process_group")
    out: dict[str, Any] = {"workload": workload, "uses_conv": uses_conv, "stages": stages,
                           "runs": []}
    if nccl_log.exists():
        out["nccl"] = _nccl_log(nccl_log.read_text(errors="replace"))
    rows = 16 if workload in ("lm", "attention", "classifier") else 64
    if DRY:
        rows = 2
    try:
        for amp, pause_s in ((None, 0.0), ("bfloat16", 0.0), ("bfloat16", 0.3)):
            torch.manual_seed(0)
            model = DDP(wl.model().to(dev), device_ids=None if DRY else [0])
            loss_fn = wl.loss.to(dev) if isinstance(wl.loss, torch.nn.Module) else wl.loss
            opt = make_optimizer(wl, model, loss_fn)
            params = sum(p.nbytes for p in model.parameters())
            stage(f"ddp_built amp={amp} pause={pause_s}")
            steps = []
            for _ in range(6):
                x, y = wl.batch(rows, dev)
                _sync()
                start = _allocated()
                _reset_peak()
                t1 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp is not None):
                    loss = loss_fn(model(x), y)
                loss.backward()
                opt.step()
                _sync()
                steps.append({"start_bytes": start, "peak_bytes": _peak(),
                              "end_bytes": _allocated(),
                              "step_s": round(time.perf_counter() - t1, 5), **nvml()})
                del x, y, loss
                time.sleep(pause_s)
            stage(f"after_steps amp={amp} pause={pause_s}")
            out["runs"].append({"amp": amp, "pause_s": pause_s, "rows": rows,
                                "param_bytes": params, "steps": steps,
                                "bucket_bytes": [b.buffer().nbytes for b in
                                                 _buckets(model)]})
            del model, opt
            if not DRY:
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    return out


def _buckets(model: Any) -> list[Any]:
    """DDP's gradient buckets as the reducer holds them now (empty if torch hides them)."""
    try:
        return list(model.reducer._get_zeros_like_grad_buckets())
    except Exception:
        return []


# --------------------------------------------------------------------------------- segments


def segments(spec: str) -> dict[str, Any]:
    import torch
    from gpu_ladder import run_part

    workload, batch_s, part = spec.split(":", 2)
    if not DRY:
        torch.cuda.set_device(0)
    os.environ["GPU_LADDER_HISTORY"] = "none"  # ours below, with segment events
    if not DRY:
        torch.cuda.memory._record_memory_history(context="alloc", max_entries=600_000)
    rec = run_part(part, workload, int(batch_s), emulated=False)
    if DRY:
        return rec
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    from gpu_attribution import alive_at_peak

    rec["segments"] = [
        {"size": s["total_size"], "stream": s["stream"], "pool": list(s["segment_pool_id"]),
         "type": s["segment_type"], "allocated": s["allocated_size"],
         "blocks": [[b["size"], b["state"][0]] for b in s["blocks"]][:60]}
        for s in snap["segments"]]
    events, reserved, peak, peak_at = [], 0, 0, -1
    for i, ev in enumerate(snap["device_traces"][0]):
        if ev["action"] not in ("segment_alloc", "segment_free", "segment_map",
                                "segment_unmap"):
            continue
        grow = ev["action"] in ("segment_alloc", "segment_map")
        reserved += ev["size"] if grow else -ev["size"]
        if reserved > peak:
            peak, peak_at = reserved, i
        frames = [f"{Path(f['filename']).name}:{f['line']} {f['name']}"
                  for f in ev.get("frames", []) if f.get("filename", "").endswith(".py")]
        events.append({"i": i, "action": ev["action"], "size": ev["size"],
                       "stream": ev["stream"], "reserved": reserved, "where": frames[:6]})
    rec["segment_events"] = events[:400]
    rec["trace_peak_reserved_bytes"], rec["trace_peak_reserved_at"] = peak, peak_at
    alive = alive_at_peak(snap)
    rec["largest"], rec["by_site"] = alive["largest"][:20], alive["by_site"][:25]
    return rec


# ----------------------------------------------------------------------------------- record


def trimmed(measure: dict[str, Any]) -> dict[str, Any]:
    """A run's figures as tests keep them: each part's result and versions; per-op times of
    aten ops only (the kernels' names are kept per run, totalled), segments' blocks dropped."""
    out: dict[str, Any] = {"about": "measured by scripts/gpu_measure.py; figures only, "
                                    "nothing emulated", "parts": {}}
    for name, part in measure["parts"].items():
        if not part.get("ok"):
            out["parts"][name] = {k: part.get(k) for k in ("ok", "error")}
            continue
        res = part["result"]
        if name == "kernels":
            for run in res["runs"]:
                run["ops"] = [o for o in run.get("ops", [])
                              if o["op"].startswith("aten::") and o["self_device_us"] > 0]
                run["kernels"] = run.get("kernels", [])[:20]
        if name.startswith(("segments-", "expandable-")):
            for seg in res.get("segments", []):
                seg.pop("blocks", None)
        head_keys = ("gpu", "torch", "cuda", "cudnn", "nccl", "compute_capability",
                     "total_memory_bytes", "date_utc", "cudnn_allow_tf32", "matmul_allow_tf32")
        out.setdefault("head", {k: part.get(k) for k in head_keys})
        out["parts"][name] = {"wall_s": part.get("wall_s"), "result": res}
    return out


# ------------------------------------------------------------------------------------- main


def run_one(name: str) -> Any:
    if name == "rates":
        return rates()
    if name == "kernels":
        return kernels(os.environ.get("GPU_MEASURE_KERNELS", KERNEL_WORKLOADS))
    if name == "cudnn":
        return cudnn()
    if name == "cudnn-benchmark":
        return cudnn(benchmark=True)
    if name == "conv-split":
        return conv_split()
    if name.startswith("rank-"):
        return rank(name[5:])
    if name == "nccl-clique":
        return nccl_clique()
    if name.startswith("segments-"):
        return segments(name[9:])
    if name.startswith("expandable-"):
        # the same record under expandable segments: torch reads the setting at its first
        # allocation, and this part's process has made none yet
        os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
        return segments(name[11:])
    raise SystemExit(f"unknown part {name!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default=",".join(DEFAULT_PARTS))
    ap.add_argument("--part", help=argparse.SUPPRESS)  # one part, in this (fresh) process
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--deadline-s", type=float, default=300.0)
    ap.add_argument("--record", nargs=2, type=Path, metavar=("MEASURE_JSON", "RECORD_JSON"),
                    help="write a run's measure.json, trimmed, as a record for tests/data")
    args = ap.parse_args()
    if args.record:
        src, dst = args.record
        dst.write_text(json.dumps(trimmed(json.loads(src.read_text())), indent=1) + "\n")
        return 0
    if args.part:
        t0 = time.perf_counter()
        try:
            result = {"ok": True, **head(), "result": run_one(args.part)}
        except Exception as e:
            result = {"ok": False, "error": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc()[-4000:]}
        result["wall_s"] = round(time.perf_counter() - t0, 2)
        sys.stdout.write("\n@@RESULT@@" + json.dumps(result, default=str) + "\n")
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    record: dict[str, Any] = {"parts": {}}
    lock = threading.Lock()
    target = OUT / "measure.json"

    def launch(name: str) -> None:
        left = args.deadline_s - (time.monotonic() - start)
        if left < 10:
            res: dict[str, Any] = {"ok": False, "error": "deadline: not started"}
        else:
            partial = OUT / f".partial-{os.getpid()}-{abs(hash(name))}.json"
            env = {**os.environ, "GPU_MEASURE_PARTIAL": str(partial)}
            try:
                p = subprocess.run([sys.executable, __file__, "--part", name], env=env,
                                   capture_output=True, text=True, timeout=left)
                tail = p.stdout.rpartition("@@RESULT@@")[2]
                res = json.loads(tail) if tail.strip() else {
                    "ok": False, "error": f"exit {p.returncode}", "stderr": p.stderr[-3000:]}
            except subprocess.TimeoutExpired:
                res = {"ok": False, "error": f"deadline: cut after {left:.0f} s"}
                if partial.exists():
                    res["partial"] = json.loads(partial.read_text())
            partial.unlink(missing_ok=True)
        with lock:
            record["parts"][name] = res
            target.write_text(json.dumps(record, indent=1, default=str))
        print(f"[{time.monotonic() - start:6.1f} s] {name}: "
              f"{'ok' if res.get('ok') else res.get('error')}", flush=True)

    parts = [p for p in args.parts.split(",") if p]
    i = 0
    while i < len(parts):
        if not parts[i].startswith(MEMORY_ONLY):
            launch(parts[i])  # alone on the GPU: its times and NVML readings are its own
            i += 1
            continue
        j = i
        while j < len(parts) and parts[j].startswith(MEMORY_ONLY):
            j += 1
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            list(pool.map(launch, parts[i:j]))
        i = j
    print(f"done in {time.monotonic() - start:.0f} s: {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
