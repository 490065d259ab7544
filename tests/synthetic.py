"""Results shaped like real-GPU runs, for testing the renderers without GPUs.

Nothing here was measured: every result says so in its ``notes`` and in the environment
(``"synthetic": true``). The shapes follow what the cuda backend records: peaks from the
caching allocator, NVML "used" samples over seconds with the runner's phases, step times,
an out-of-memory scenario, DDP ranks on two hosts. ``python tests/synthetic.py`` rewrites
the saved copies under ``tests/data/`` (a test checks they match).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from dpprof.answers.answer import settled
from dpprof.result import (
    STATUS_OK,
    STATUS_OOM,
    DeviceResult,
    RunResult,
    ScenarioResult,
    TimelinePoint,
)

GiB = 2**30
MiB = 2**20
DATA = Path(__file__).parent / "data"
SYNTHETIC_NOTE = (
    "synthetic: built by tests/synthetic.py to look like a real-GPU run; nothing here was "
    "measured"
)
PHASES = (("inputs", 0.02), ("forward", 0.30), ("loss", 0.06), ("backward", 0.45),
          ("optimizer", 0.12), ("zero_grad", 0.05))
CONTEXT = 520 * MiB


def _timeline(step_s: float, resident: int, peak: int, points: int = 60) -> list[TimelinePoint]:
    """NVML-like samples over one step: rises through forward, peaks in backward."""
    out = []
    t0 = 0.0
    for phase, share in PHASES:
        n = max(2, round(points * share))
        for k in range(n):
            f = k / n
            if phase == "forward":
                level = resident + (peak - resident) * 0.6 * f
            elif phase == "loss":
                level = resident + (peak - resident) * (0.6 + 0.3 * f)
            elif phase == "backward":
                level = resident + (peak - resident) * (0.9 + 0.1 * math.sin(math.pi * f))
            elif phase == "optimizer":
                level = resident + (peak - resident) * 0.25 * (1 - f)
            else:
                level = resident
            alloc = int(level)
            out.append(TimelinePoint(
                t=round(t0 + share * step_s * f, 5), allocated_bytes=alloc, phase=phase,
                used_bytes=int(alloc * 1.08) + CONTEXT,
            ))
        t0 += share * step_s
    return out


def _device(index: int, peak: int, capacity: int, step_s: float, rows: int,
            breakdown: dict[str, int], node: str | None = None, rank: int | None = None,
            used: bool = True) -> DeviceResult:
    resident = breakdown.get("parameters", 0) + breakdown.get("optimizer_state", 0)
    total = sum(breakdown.values())
    scale = peak / total if total else 1.0
    bd = {k: int(v * scale) for k, v in breakdown.items()}
    bd["other"] = bd.get("other", 0) + peak - sum(bd.values())
    return DeviceResult(
        index=index, peak_allocated_bytes=peak, peak_requested_bytes=int(peak * 0.98),
        capacity_bytes=capacity, breakdown_bytes={k: v for k, v in bd.items() if v},
        peak_reserved_bytes=int(peak * 1.08), context_bytes=CONTEXT,
        nvml_peak_used_bytes=int(peak * 1.08) + CONTEXT, peak_phase="backward",
        rank=rank, node=node, used=used, batch_rows=rows,
        timeline=tuple(_timeline(step_s, min(resident, peak), peak) if used else []),
    )


def _env(gpu: str, capacity: int, n: int, hosts: list[str]) -> dict[str, object]:
    return {
        "synthetic": True,
        "python": "3.11.7", "torch": "2.5.1+cu124", "torch_cuda": "12.4",
        "cuda_available": True, "cuda_device_count": n, "driver": "550.54.15",
        "hostnames": hosts,
        "gpus": [{"cuda_index": i, "name": gpu, "total_memory_bytes": capacity,
                  "uuid": f"GPU-0000000{i}-synthetic"} for i in range(n)],
    }


def _finish(run: RunResult, scenarios: list[ScenarioResult]) -> RunResult:
    run = dataclasses.replace(
        run, scenarios=tuple(scenarios), notes=(SYNTHETIC_NOTE, *run.notes), assumptions=(
            "Synthetic result (tests): shaped like a run of the cuda backend; peaks as "
            "torch.cuda.max_memory_allocated would give them, timelines as NVML samples.",))
    return settled(run)  # the comparison and the one answer, as every command derives them


def _scenarios(capacity: int, gpus: int, batch: int, primary_peak: int, other_peak: int,
               step: dict[str, float]) -> list[ScenarioResult]:
    rows = -(-batch // gpus)
    params, opt = 1 * GiB, 2 * GiB

    def bd(extra: dict[str, int]) -> dict[str, int]:
        return {"parameters": params, "optimizer_state": opt, **extra}

    prim = ScenarioResult(name="dp-loss-primary", batch=batch, max_batch=batch * 3 // 4, devices=(
        _device(0, primary_peak, capacity, step["dp-loss-primary"], rows,
                bd({"gradients": params, "outputs": 9 * GiB, "loss": 14 * GiB,
                    "activations": 9 * GiB, "inputs": 256 * MiB})),
        *(_device(i, other_peak, capacity, step["dp-loss-primary"], rows,
                  {"parameters": params, "gradients": params,
                   "activations": 9 * GiB, "inputs": 64 * MiB})
          for i in range(1, gpus))))
    fwd_peak = other_peak + 4 * GiB
    fwd = ScenarioResult(name="dp-loss-forward", batch=batch, max_batch=batch * 2, devices=(
        _device(0, fwd_peak, capacity, step["dp-loss-forward"], rows,
                bd({"gradients": params, "activations": 10 * GiB, "inputs": 256 * MiB})),
        *(_device(i, other_peak + 1 * GiB, capacity, step["dp-loss-forward"], rows,
                  {"parameters": params, "gradients": params,
                   "activations": 10 * GiB, "inputs": 64 * MiB})
          for i in range(1, gpus))))
    ddp_peak = other_peak + 3 * GiB
    ddp = ScenarioResult(name="ddp", batch=batch, max_batch=batch * 5 // 2, devices=tuple(
        _device(i, ddp_peak, capacity, step["ddp"], rows,
                bd({"gradients": params, "communication": params,
                    "activations": 10 * GiB, "inputs": 64 * MiB}), rank=i)
        for i in range(gpus)))
    single = ScenarioResult(name="single", batch=rows, devices=(
        _device(0, ddp_peak - params, capacity, step["single"], rows,
                bd({"gradients": params, "activations": 10 * GiB})),))
    return [dataclasses.replace(
        s, step_time_s=step[s.name], step_time_spread_s=step[s.name] * 0.04,
        throughput_samples_per_s=(s.batch if s.name != "single" else rows) / step[s.name],
        status=STATUS_OK) for s in (prim, fwd, ddp, single)]


def nvml_run() -> RunResult:
    """Four 80 GB GPUs, every scenario fits; NVML timelines, step times, largest batches."""
    cap = 80 * GiB
    run = RunResult(backend="cuda", workload="synthetic-lm", batch=512, gpus=4,
                    gpu_memory_bytes=cap, dpprof_version="0.1.0",
                    created="2026-01-01T00:00:00+00:00", config={"synthetic": True},
                    environment=_env("NVIDIA A100-SXM4-80GB", cap, 4, ["gpu-node-1"]))
    return _finish(run, _scenarios(cap, 4, 512, 46 * GiB, 14 * GiB, {
        "dp-loss-primary": 0.61, "dp-loss-forward": 0.52, "ddp": 0.41, "single": 0.39}))


def oom_run() -> RunResult:
    """Four 24 GB GPUs: dp-loss-primary runs out of memory on cuda:0 (a measured OOM)."""
    cap = 24 * GiB
    run = RunResult(backend="cuda", workload="synthetic-lm", batch=512, gpus=4,
                    gpu_memory_bytes=cap, dpprof_version="0.1.0",
                    created="2026-01-01T00:00:00+00:00", config={"synthetic": True},
                    environment=_env("NVIDIA GeForce RTX 4090", cap, 4, ["workstation"]))
    steps = {"dp-loss-primary": 0.61, "dp-loss-forward": 0.52, "ddp": 0.41, "single": 0.39}
    scen = _scenarios(cap, 4, 512, 46 * GiB, 14 * GiB, steps)
    # What the GPUs held when the allocation failed, in the loss: the timelines end there.
    failed = _scenarios(cap, 4, 512, cap - 2 * GiB, 14 * GiB, steps)[0]
    devices = tuple(dataclasses.replace(
        d, timeline=d.timeline[:next(k for k, p in enumerate(d.timeline)
                                     if p.phase == "backward")], peak_phase="loss")
        for d in failed.devices)
    scen[0] = dataclasses.replace(
        failed, devices=devices, status=STATUS_OOM, oom_device=0, oom_bytes=3 * GiB,
        step_time_s=None, step_time_spread_s=None, throughput_samples_per_s=None,
        message=("CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total "
                 "capacity of 23.64 GiB of which 1.12 GiB is free."))
    return _finish(run, scen)


def two_node_ddp_run() -> RunResult:
    """DDP over two hosts of two GPUs each (torchrun), next to DataParallel on the first."""
    cap = 40 * GiB
    hosts = ["node-a", "node-b"]
    run = RunResult(backend="cuda", workload="synthetic-lm", batch=256, gpus=4,
                    gpu_memory_bytes=cap, dpprof_version="0.1.0",
                    created="2026-01-01T00:00:00+00:00",
                    config={"synthetic": True, "nnodes": 2, "nproc_per_node": 2},
                    environment=_env("NVIDIA A100-SXM4-40GB", cap, 2, hosts))
    scen = _scenarios(cap, 2, 256, 30 * GiB, 12 * GiB, {
        "dp-loss-primary": 0.5, "dp-loss-forward": 0.45, "ddp": 0.3, "single": 0.28})
    ddp = scen[2]
    template = ddp.devices[0]
    ranks = [dataclasses.replace(template, index=r % 2, rank=r, node=hosts[r // 2])
             for r in range(4)]
    ranks[2] = dataclasses.replace(  # one rank a little heavier
        ranks[2], peak_allocated_bytes=ranks[2].peak_allocated_bytes + 700 * MiB)
    scen[2] = dataclasses.replace(ddp, devices=tuple(ranks), batch=256,
                                  throughput_samples_per_s=256 / 0.3)
    return _finish(run, [dataclasses.replace(s, devices=tuple(
        d if d.node is not None else dataclasses.replace(d, node=hosts[0]) for d in s.devices))
        for s in scen])


SYNTHETIC = {
    "synthetic-nvml.json": nvml_run,
    "synthetic-oom.json": oom_run,
    "synthetic-ddp-2-nodes.json": two_node_ddp_run,
}


def write_all() -> None:
    for name, build in SYNTHETIC.items():
        (DATA / name).write_text(build().to_json() + "\n", encoding="utf-8")
        print(f"wrote {DATA / name}")


if __name__ == "__main__":
    write_all()
