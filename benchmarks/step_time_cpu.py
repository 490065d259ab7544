"""Check 1 of the step-time model: the method applied to this machine's CPU as the device.

The CPU's peaks are measured by micro-benchmarks (matmuls of ten shapes, square and with a
short side of 32 rows as the workloads' batches give, a small matmul, a convolution, a batch
norm, a copy, step-like elementwise kernels, a tiny op and a view), never fitted to the steps
below. The shapes are an input, not the workloads' own products; run the benchmark a few
times on a shared machine (its rates move by up to 15 % from run to run). The model
(dpprof.emulator.step_time) then plays the emulated step of each built-in workload on those
peaks, the CPU running each op as the host issues it (no queue: synchronous), and the
prediction is compared with the step the CPU measures:

- ``single``: the tutorial's step on the bare model in this process, one thread, in the
  thread's CPU time (the machine is shared: the wall clock would count the others' work);
  the micro-benchmarks are timed the same way; the best of 5 steps;
- ``ddp``: two real gloo ranks (dpprof's own loop, wall clock, the slower rank's step, the
  best of 3 launches), their all-reduce at the bandwidth a two-process gloo all-reduce of
  64 MiB measures here. Two ranks on two shared cores: the least reliable row.

    python benchmarks/step_time_cpu.py            # prints the table, writes step_time_cpu.json
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
OUT = HERE / "step_time_cpu.json"
# (workload, batch): small enough to run in seconds on two cores. single: one process;
# ddp: two gloo ranks (the global batch, half each)
SINGLE = (("mlp", 32), ("convnet", 16), ("classifier", 4), ("attention", 1), ("lm", 1))
DDP = (("mlp", 64), ("convnet", 32), ("classifier", 8))
RUNS = 3  # ddp: launches per case (one measured step each); the best counts (a shared CPU)


def _best_s(fn: Any, repeat: int = 20) -> float:
    """The fastest of ``repeat`` calls, in this thread's CPU time (the machine is shared:
    its wall clock counts the others' work)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return min(times)


# The matmul shapes (M, N, K: M x K times K x N) the CPU's matmul rate is measured at: a
# square one (the peak), and each side in turn short (32 rows, as the workloads' batches give)
# with the other two 2048 or 8192 wide (as their layers and vocabularies are). The model's
# shape terms (TimeConstants.matmul_*_dim_rows) come from these, never from the workloads' steps.
MATMUL_SHAPES = ((1024, 1024, 1024),
                 *((32, a, b) for a, b in ((2048, 2048), (8192, 2048), (2048, 8192))),
                 *((a, 32, b) for a, b in ((2048, 2048), (8192, 2048), (2048, 8192))),
                 *((a, b, 32) for a, b in ((2048, 2048), (8192, 2048), (2048, 8192))))
# The elementwise kernels a step runs besides its matmuls (activations, residual adds, a
# softmax's exp, reductions, the optimizer's in-place updates), each with the bytes it reads
# and writes in tensors of its size, measured at sizes spanning the workloads' tensors: their
# rate, over the copy's, is the model's memory efficiency (TimeConstants.memory_efficiency);
# a copy is the fastest of them, and out-of-place ones at 64 MiB pay the fresh pages of their
# output.
ELEMENTWISE_MIB = (1, 4, 16, 64)


def _elementwise_s(numel: int) -> list[tuple[float, float]]:
    """(bytes read and written, seconds) of each of the step-like elementwise kernels on
    tensors of ``numel`` floats."""
    a, b = torch.randn(numel), torch.randn(numel)
    positive, dst = torch.rand(numel) + 0.5, torch.randn(numel)
    size = 4 * numel
    kernels = ((lambda: torch.add(a, b), 3), (lambda: torch.relu(a), 2),
               (lambda: torch.nn.functional.gelu(a), 2), (lambda: torch.exp(a), 2),
               (lambda: a.sum(), 1), (lambda: dst.add_(a), 3), (lambda: dst.mul_(0.999), 2),
               (lambda: dst.addcdiv_(a, positive, value=1e-3), 4),
               (lambda: torch.sqrt(positive), 2))
    return [(tensors * size, _best_s(fn, 10)) for fn, tensors in kernels]


# the convolution measured: (batch, in channels, side) -> out channels, 3 x 3, no padding
CONV_SHAPE = (8, 32, 28, 64)


def conv_gemm() -> tuple[int, int, int]:
    """The micro-benchmark's convolution as the GEMM the model reads it as (M, N, K)."""
    n, c_in, side, c_out = CONV_SHAPE
    return (n * (side - 2) ** 2, c_out, c_in * 9)


def cpu_peaks() -> dict[str, Any]:
    """This CPU's rates, measured: what the datasheet is for a GPU."""
    shapes = []
    for m, n, inner in MATMUL_SHAPES:
        a, b = torch.randn(m, inner), torch.randn(inner, n)
        shapes.append([m, n, inner, _best_s(lambda a=a, b=b: torch.mm(a, b), 10)])
    s = 64
    sa, sb = torch.randn(s, s), torch.randn(s, s)
    small_mm_s = _best_s(lambda: torch.mm(sa, sb), 200)
    big = torch.randn(16 * 2**20)  # 64 MiB
    dst = torch.empty_like(big)
    copy = 2 * big.numel() * 4 / _best_s(lambda: dst.copy_(big), 10)
    batch, c_in, side, c_out = CONV_SHAPE
    x = torch.randn(batch, c_in, side, side)
    w = torch.randn(c_out, c_in, 3, 3)
    m, n, inner = conv_gemm()
    conv = 2 * m * n * inner / _best_s(lambda: torch.nn.functional.conv2d(x, w), 10)
    y = torch.randn(32, 64, 26, 26)
    bn_bytes = 2 * y.numel() * 4
    bn = bn_bytes / _best_s(lambda: torch.nn.functional.batch_norm(
        y, None, None, training=True), 10)
    elementwise = [pair for mib in ELEMENTWISE_MIB for pair in _elementwise_s(mib * 2**18)]
    # their rates' harmonic mean: each kernel counted by the time a byte of it takes
    elementwise_rate = len(elementwise) / sum(seconds / nbytes
                                              for nbytes, seconds in elementwise)
    p = torch.ones(1, requires_grad=True)
    q = torch.ones(1, requires_grad=True)
    tiny_op = _best_s(lambda: torch.add(p, q), 2000)
    view = _best_s(lambda: p.view(-1), 2000)
    square = shapes[0]
    return {"matmul_flops_per_s": 2 * square[0] * square[1] * square[2] / square[3],
            "matmul_shapes_mnk_s": shapes, "small_matmul_s": small_mm_s,
            "memory_bytes_per_s": copy, "elementwise_bytes_per_s": elementwise_rate,
            "conv_flops_per_s": conv,
            "batch_norm_bytes_per_s": bn, "tiny_op_s": tiny_op, "view_s": view,
            "threads": float(torch.get_num_threads())}


def matmul_rate_and_shape(shapes: list[list[float]]) -> tuple[float, float, float]:
    """The peak and the shape terms (outer, inner rows) that best explain the measured
    matmuls: ``t = F / peak * (1 + outer (1/M + 1/N) + inner / K)``, linear in
    (1/peak, outer/peak, inner/peak); least squares on the relative error, a term that
    comes out negative dropped."""
    rows, times = [], []
    for m, n, inner, seconds in shapes:
        flops = 2 * m * n * inner
        rows.append([flops / seconds, flops * (1 / m + 1 / n) / seconds,
                     flops / inner / seconds])
        times.append(1.0)
    keep = [0, 1, 2]
    while True:
        a = torch.tensor([[r[i] for i in keep] for r in rows], dtype=torch.float64)
        x = torch.linalg.lstsq(a, torch.tensor(times, dtype=torch.float64)[:, None]).solution
        coef = dict(zip(keep, x[:, 0].tolist(), strict=True))
        negative = [i for i in keep[1:] if coef[i] < 0]
        if not negative:
            break
        keep.remove(negative[0])
    inv_peak = coef[0]
    return 1 / inv_peak, coef.get(1, 0.0) / inv_peak, coef.get(2, 0.0) / inv_peak


def _all_reduce_rank(rank: int, world: int, port: int, out: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    t = torch.ones(16 * 2**20)  # 64 MiB
    for _ in range(2):
        dist.all_reduce(t)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(min(times))
    dist.destroy_process_group()


def gloo_bus_bytes_per_s() -> float:
    """A two-process gloo all-reduce of 64 MiB here, as a ring's bus bandwidth."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    procs = [ctx.Process(target=_all_reduce_rank, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    seconds = q.get(timeout=300)
    for p in procs:
        p.join()
    nbytes = 16 * 2**20 * 4
    return 2 * (2 - 1) / 2 * nbytes / seconds


def cpu_model(peaks: dict[str, Any], link_bytes_per_s: float) -> tuple[Any, Any]:
    from dpprof.emulator.step_time import DeviceRates, TimeConstants, matmul_shape_efficiency

    mm, outer, inner = matmul_rate_and_shape(peaks["matmul_shapes_mnk_s"])
    shaped = TimeConstants(
        matmul_efficiency=1.0, matmul_half_flops=0.0, memory_efficiency=1.0,
        conv_efficiency=1.0, norm_passes=1.0, kernel_gap_s=0.0, host_op_s=0.0,
        host_view_s=0.0, step_overhead_s=0.0, matmul_outer_dim_rows=outer,
        matmul_inner_dim_rows=inner)
    small_flops = 2 * 64**3
    # a matmul's time = (F + half) / (peak x shape): the small one's measured time gives
    # half (its host cost, the tiny op's, taken off)
    small_shape = matmul_shape_efficiency((64, 64, 64), shaped)
    half = max((peaks["small_matmul_s"] - peaks["tiny_op_s"]) * mm * small_shape
               - small_flops, 0.0)
    rates = DeviceRates(
        matmul_flops_per_s={"float32": mm, "tf32": mm},  # no TF32 on a CPU
        memory_bytes_per_s=peaks["memory_bytes_per_s"],
        link_bytes_per_s=link_bytes_per_s, host_link_bytes_per_s=peaks["memory_bytes_per_s"],
        interconnect="memory", synchronous=True)
    m, n, k_dim = conv_gemm()
    conv_flops = 2 * m * n * k_dim
    # the convolution's rate over what a matmul of its GEMM's shape would reach
    conv_vs_matmul = (peaks["conv_flops_per_s"] / mm * (conv_flops + half) / conv_flops
                      / matmul_shape_efficiency((m, n, k_dim), shaped))
    # a kernel that is not a matmul moves its bytes at the step-like elementwise kernels'
    # rate; a batch norm's passes over its tensors at that rate give its measured rate
    memory = min(peaks["elementwise_bytes_per_s"] / peaks["memory_bytes_per_s"], 1.0)
    k = dataclasses.replace(
        shaped, matmul_half_flops=half, conv_efficiency=conv_vs_matmul,
        memory_efficiency=memory,
        norm_passes=max(peaks["memory_bytes_per_s"] * memory
                        / peaks["batch_norm_bytes_per_s"], 1.0),
        host_op_s=peaks["tiny_op_s"], host_view_s=peaks["view_s"], link_efficiency=1.0,
        collective_latency_s=0.0)
    return rates, k


def single_steps(workload: str, batch: int, steps: int = 5) -> list[float]:
    """The tutorial's step (zero_grad, forward, loss, backward, the foreach optimizer), each
    in this thread's CPU time, after two warm-up steps."""
    from dpprof.scenarios.workloads import load_workload, make_optimizer

    wl = load_workload(workload)
    torch.manual_seed(0)
    model = wl.model()
    loss_fn = wl.loss
    opt = make_optimizer(wl, model, loss_fn)
    for group in opt.param_groups:
        if group.get("foreach") is None and not group.get("fused"):
            group["foreach"] = True  # as on a GPU, and as the emulator steps
    x, y = wl.batch(batch, torch.device("cpu"))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = (model(**x) if isinstance(x, dict) else model(*x) if isinstance(x, tuple)
               else model(x))
        loss = loss_fn(out, y)
        loss.backward()
        opt.step()

    for _ in range(2):
        step()
    out = []
    for _ in range(steps):
        t0 = time.thread_time()
        step()
        out.append(time.thread_time() - t0)
    return out


def ddp_steps(workload: str, batch: int) -> list[float]:
    """Two fresh gloo ranks under DDP, RUNS times: the slower rank's measured step (wall
    clock: a rank waits for the other in the all-reduce)."""
    from dpprof.backends.gloo import RankSpec, launch
    from dpprof.scenarios.step import StepConfig

    out = []
    for _ in range(RUNS):
        spec = RankSpec(workload=workload, step=StepConfig(batch=batch, warmup=2),
                        memory="none", wrap="ddp")
        ranks = launch(spec, 2)
        out.append(max(r.step_time_s for r in ranks if r.step_time_s is not None))
    return out


def predicted(workload: str, batch: int, scenario: str, gpus: int, rates: Any,
              k: Any) -> float:
    from dpprof.backends.emulated import EmulationConfig, run_scenario
    from dpprof.emulator.step_time import predict_step
    from dpprof.scenarios.step import StepConfig
    from dpprof.scenarios.workloads import load_workload

    trace: dict[str, Any] = {}
    cfg = EmulationConfig(gpus=gpus, gpu_memory_bytes=1 << 50, step=StepConfig(batch=batch),
                          ddp_backend="gloo")
    r = run_scenario(scenario, load_workload(workload), cfg, trace=trace)
    if r.status != "ok":
        raise RuntimeError(r.message)
    return predict_step(trace["rt"].op_log.records, rates, k, [0]).step_time_s


def main() -> None:
    torch.set_num_threads(1)  # one core: CPU time is then the time the work takes
    os.environ["OMP_NUM_THREADS"] = "1"  # and one each for the gloo ranks (two cores)
    peaks = cpu_peaks()
    link = gloo_bus_bytes_per_s()
    rates, k = cpu_model(peaks, link)
    print(f"CPU peaks: {peaks}; gloo all-reduce bus {link / 1e9:.2f} GB/s")
    print(f"constants: {k}")
    rows = []
    for scenario, cases in (("single", SINGLE), ("ddp", DDP)):
        world = 1 if scenario == "single" else 2
        for workload, batch in cases:
            times = single_steps(workload, batch) if world == 1 else ddp_steps(workload, batch)
            pred = predicted(workload, batch, scenario, world, rates, k)
            best = min(times)
            row = {"scenario": scenario, "workload": workload, "batch": batch,
                   "measured_best_s": best, "measured_median_s": statistics.median(times),
                   "predicted_s": pred, "error": pred / best - 1}
            rows.append(row)
            print(f"{scenario:6} {workload:10} b{batch:<4} measured best {best * 1e3:9.1f} ms "
                  f"(median {row['measured_median_s'] * 1e3:9.1f}) predicted "
                  f"{pred * 1e3:9.1f} ms  error {row['error']:+.1%}", flush=True)
    for scenario in ("single", "ddp"):
        errs = [abs(r["error"]) for r in rows if r["scenario"] == scenario]
        print(f"{scenario}: mean |error| {statistics.mean(errs):.1%} over {len(errs)} "
              f"workloads (worst {max(errs):.1%})")
    OUT.write_text(json.dumps({
        "about": "benchmarks/step_time_cpu.py: the step-time model on this CPU as the "
                 "device (peaks measured by micro-benchmarks) against its measured steps",
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__,
                    "python": sys.version.split()[0]},
        "peaks": peaks, "gloo_bus_bytes_per_s": link,
        "constants": dataclasses.asdict(k), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
