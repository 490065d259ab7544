"""One comparison on real GPUs: choose the devices, run every scenario, build the result.

- :func:`select_devices`: ``--gpus N`` (the first N visible GPUs) or ``--devices 2,3``;
- :func:`cuda_compare`: the scenarios in this process (DataParallel, single) and the ``ddp``
  ranks spawned one per GPU (:func:`dpprof.backends.cuda_ddp.spawn_ddp` over
  :mod:`dpprof.backends.ranks`, NCCL);
- :func:`torchrun_compare`: the ``ddp`` scenario when torchrun started this process: every
  rank measures its device, rank 0 gets every rank's measurement and builds the result
  (one device row per rank, with its node).

What the machine offers (visible GPUs, device operations, the ranks' process group) comes
from :func:`dpprof.backends.cuda_host.host`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from dpprof.backends.cuda import ASSUMPTIONS, run_local_scenario
from dpprof.backends.cuda_ddp import DdpJob, RankInfo, ddp_scenario, rank_entry, spawn_ddp
from dpprof.backends.cuda_host import DeviceOps, host
from dpprof.backends.cuda_measure import CudaRunConfig
from dpprof.errors import UsageError
from dpprof.result import RunResult, ScenarioResult
from dpprof.scenarios.measured_loop import loop_description
from dpprof.scenarios.registry import scenario
from dpprof.scenarios.workloads import Workload

if TYPE_CHECKING:
    from dpprof.pipeline import CompareConfig

__all__ = ["cuda_compare", "ddp_job", "run_config", "select_devices", "torchrun_compare"]

Progress = Callable[[str, int, int], None]

def select_devices(gpus: int | None, devices: Sequence[int] | None, visible: int) -> list[int]:
    """The CUDA indices to use, or :class:`UsageError` naming what is wrong."""
    if devices:
        bad = [d for d in devices if d < 0 or d >= visible]
        if bad:
            raise UsageError(
                f"--devices {','.join(map(str, devices))}: no CUDA device "
                f"{', '.join(map(str, bad))} (this process sees {visible}: 0..{visible - 1}; "
                "CUDA_VISIBLE_DEVICES renumbers them)"
            )
        if len(set(devices)) != len(devices):
            raise UsageError("--devices lists a GPU twice; give each CUDA index once")
        if gpus is not None and gpus != len(devices):
            raise UsageError(
                f"--gpus {gpus} and --devices {','.join(map(str, devices))} disagree; "
                "give one of them"
            )
        return list(devices)
    n = visible if gpus is None else gpus
    if n > visible:
        raise UsageError(f"--gpus {n}: only {visible} CUDA GPU(s) visible; use --gpus {visible}")
    if n < 1:
        raise UsageError("no CUDA GPU visible; use --backend emulated")
    return list(range(n))


def run_config(cfg: CompareConfig, devices: list[int]) -> CudaRunConfig:
    return CudaRunConfig(devices=devices, step=cfg.step.resolved("cuda"),
                         nvml_interval_s=cfg.nvml_interval_s, debug=cfg.debug)


def ddp_job(ccfg: CudaRunConfig, cfg: CompareConfig, run_id: str | None = None) -> DdpJob:
    machine = host()
    job = DdpJob(
        workload=cfg.workload, cfg=ccfg, backend=machine.ddp_backend,
        device=machine.ddp_device, timeout_s=cfg.ddp_timeout_s,
    )
    if run_id is not None:  # torchrun: every rank must use the same store keys
        job.run_id = run_id
    return job


def _measured(run: RunResult, ccfg: CudaRunConfig, cfg: CompareConfig, gpus: int,
              **config: Any) -> RunResult:
    """``run`` (made by the runner) as measured on ``gpus`` CUDA GPUs: its backend, its
    assumptions, and the options the measurement used added to its ``config``."""
    loop = loop_description(ccfg.warmup_steps + ccfg.steps, ccfg.steps)
    return dataclasses.replace(
        run, backend="cuda", gpus=gpus,
        assumptions=(ASSUMPTIONS[0], "Measured: " + loop + ".", *ASSUMPTIONS[1:]),
        config={**run.config, "loop": loop, "warmup_steps": ccfg.warmup_steps,
                "steps": ccfg.steps, "devices": list(ccfg.devices),
                "nvml_interval_s": ccfg.nvml_interval_s, "ddp_timeout_s": cfg.ddp_timeout_s,
                "gpus": gpus, **config})


def _capacity(ops: DeviceOps, fallback: int) -> int:
    """The smallest GPU's memory (``fallback`` where the devices cannot tell)."""
    caps = [ops.capacity(i) for i in range(len(ops.devices))]
    known = [c for c in caps if c is not None]
    return min(known) if known and len(known) == len(caps) else fallback


def cuda_compare(
    run: RunResult,
    cfg: CompareConfig,
    wl: Workload,
    visible: int,
    progress: Progress | None = None,
) -> RunResult:
    """``run`` (made by the runner) with every scenario of ``cfg`` measured on the chosen
    GPUs. The DDP ranks load the workload from ``cfg.workload`` (a spec)."""
    devices = select_devices(cfg.gpus, cfg.devices, visible)
    scenarios = cfg.scenarios
    ccfg = run_config(cfg, devices)
    run = _measured(run, ccfg, cfg, len(devices))
    ops = host().ops(devices)
    run = dataclasses.replace(run, gpu_memory_bytes=_capacity(ops, run.gpu_memory_bytes))
    # ddp first: its ranks must find the GPUs as a real DDP job does, without this process's
    # CUDA context (hundreds of MiB per GPU, never given back) that the in-process scenarios
    # create; reading the devices' properties above creates none
    order = sorted(scenarios, key=lambda name: not scenario(name).one_process_per_gpu)
    done: dict[str, ScenarioResult] = {}
    for i, name in enumerate(order):
        if progress:
            progress(name, i, len(order))
        if scenario(name).one_process_per_gpu:
            outcomes = spawn_ddp(ddp_job(ccfg, cfg), len(devices))
            done[name] = ddp_scenario(outcomes, ccfg, len(devices))
        else:
            done[name] = run_local_scenario(name, wl, ccfg, ops)
    return dataclasses.replace(run, scenarios=run.scenarios + tuple(
        done[name] for name in scenarios))


def torchrun_compare(run: RunResult, cfg: CompareConfig, info: RankInfo) -> RunResult | None:
    """This rank's part of ``ddp`` under torchrun; the result on rank 0, None elsewhere."""
    devices = list(cfg.devices) if cfg.devices else []
    ccfg = run_config(cfg, devices)
    run_id = "torchrun-" + os.environ.get("TORCHELASTIC_RUN_ID", "none")
    outcomes = rank_entry(ddp_job(ccfg, cfg, run_id), info)
    if outcomes is None:
        return None
    run = _measured(run, ccfg, cfg, info.world_size, torchrun=True,
                    world_size=info.world_size)
    caps = [d.capacity_bytes for o in outcomes for d in o.devices if d.capacity_bytes]
    scenarios = (*run.scenarios, ddp_scenario(outcomes, ccfg, info.world_size))
    nodes = sorted({(d.node_rank, d.node) for s in scenarios for d in s.devices},
                   key=lambda x: (x[0] is None, x[0] or 0))
    return dataclasses.replace(
        run, scenarios=scenarios,
        gpu_memory_bytes=min(caps) if caps else run.gpu_memory_bytes,
        notes=(*run.notes, f"torchrun: {info.world_size} ranks on {len(nodes)} node(s), "
               f"{math.ceil(run.batch / info.world_size)} rows each"))
