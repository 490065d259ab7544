"""The cuda backend: the paired scenarios on real GPUs, measured two ways per device.

- ``dp-loss-primary`` / ``dp-loss-forward``: the real ``torch.nn.DataParallel`` over the
  chosen devices (``device_ids``; ``output_device`` = the first), in this process
  (:func:`run_local_scenario`, here);
- ``single``: the bare model on the first chosen device, batch ``ceil(B / N)``, in this
  process too;
- ``ddp``: ``DistributedDataParallel``, one process per GPU, through
  :mod:`dpprof.backends.cuda_ddp` (spawned by dpprof, or started by ``torchrun``); each rank
  runs :func:`dpprof.backends.cuda_ddp.measure_ddp_rank`.

The pieces, one module each:

- :mod:`dpprof.backends.cuda_measure`: the measured loop every scenario runs, the allocator's
  peaks per phase, step times, an out-of-memory error recorded as a result;
- :mod:`dpprof.backends.nvml_watch`: NVML's view of the same devices (a sampler thread,
  matched to CUDA indices by UUID; a rank's context on a GPU that is not its own is flagged:
  the DDP "forgot ``set_device``" case);
- :mod:`dpprof.backends.cuda_oom`: out-of-memory errors recognised in what torch raises;
- :mod:`dpprof.backends.cuda_host`: everything the backend asks of the machine
  (:class:`~dpprof.backends.cuda_host.CudaHost`, the
  :class:`~dpprof.backends.cuda_host.DeviceOps` over the chosen devices), which the tests
  replace with a CPU implementation (``tests/fakehost``);
- :mod:`dpprof.backends.cuda_run`: one comparison: the devices chosen, every scenario run,
  the result built.

After an out-of-memory error the frames holding the tensors are dropped, then ``gc`` and
``empty_cache`` give the memory back before the next scenario.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from torch import nn

from dpprof.backends.cuda_host import DeviceOps, host
from dpprof.backends.cuda_measure import (
    CudaRunConfig,
    LoopArgs,
    Measured,
    StepBatches,
    finish_result,
    measure_loop,
    model_on_device,
    watch_for,
)
from dpprof.nvml.queries import NvmlBackend
from dpprof.result import DeviceResult, ScenarioResult
from dpprof.scenarios.registry import find
from dpprof.scenarios.shards import shard_sizes
from dpprof.scenarios.step import scenario_batch
from dpprof.scenarios.workloads import Workload, make_optimizer

__all__ = ["ASSUMPTIONS", "run_local_scenario"]

ASSUMPTIONS = [
    "Measured on real GPUs: DataParallel scenarios through torch.nn.DataParallel in one "
    "process; ddp through DistributedDataParallel (NCCL), one process per GPU.",
    "Allocated/reserved: torch.cuda.max_memory_allocated / max_memory_reserved over the "
    "measured steps (peaks reset at their start); per phase from the first measured step, "
    "with the peaks reset at the start of each phase. A scenario that runs out of memory "
    "before its measured steps reports the peak since its own start (reset there too).",
    "cuBLAS workspaces are caching-allocator blocks (one per cuBLAS handle and stream, "
    "torch's aten/src/ATen/cuda/CublasHandlePool.cpp): they count in allocated and reserved.",
    "NVML used: nvmlDeviceGetMemoryInfo sampled by a thread; a sampled peak is a lower bound. "
    "NVML used minus reserved is what the allocator does not see: the CUDA context and "
    "library code, cuDNN and NCCL buffers allocated outside the caching allocator, and "
    "other processes.",
    "Step time: median over the measured steps of the wall clock (each step ends with "
    "torch.cuda.synchronize), and of CUDA events on the first device's stream. The first "
    "measured step also reads the per-phase peaks (one synchronize per phase), so it is "
    "slower; the median is robust to it. DDP: per step, the slowest rank.",
]


def run_local_scenario(
    name: str,
    wl: Workload,
    cfg: CudaRunConfig,
    ops: DeviceOps | None = None,
    nvml: NvmlBackend | None = None,
    cuda_uuids: Sequence[str] | None = None,
) -> ScenarioResult:
    """Run ``dp-loss-primary``, ``dp-loss-forward`` or ``single`` in this process.

    Never raises for the workload's failures: an OOM or any error becomes the result's
    status, and the memory is given back before returning.
    """
    kind = find(name)
    if kind is None or kind.one_process_per_gpu or not kind.paired:
        raise ValueError(f"{name!r} is not an in-process scenario")
    ops = ops or host().ops(cfg.devices)
    n = len(cfg.devices)
    logical = list(range(n)) if kind.scatters_batch else [0]
    out = Measured()
    watch = watch_for(ops, cfg, nvml, cuda_uuids, [os.getpid()])
    shards = shard_sizes(cfg.step.batch, n)

    def setup() -> LoopArgs:
        ops.set_device(0)
        rank = kind.rank  # single: one GPU's share, DP: the whole batch
        batches = StepBatches(
            lambda k: scenario_batch(wl, cfg.step.seed, k, cfg.step.batch, n, rank),
            cfg.warmup_steps + cfg.steps)
        model, loss_fn = model_on_device(wl, ops.device(0), cfg.step.seed)
        opt = make_optimizer(wl, model, loss_fn)
        model.train()
        ids = cfg.devices if ops.kind == "cuda" else None
        out.rows = kind.samples_per_step(cfg.step.batch, shards)
        return LoopArgs(kind.wrap(model, loss_fn, _InProcess(ids)), loss_fn, opt, batches,
                        kind.loss_inside, wl.step)

    run = measure_loop(ops, cfg, logical, watch, out, setup)
    used = len(shards) if kind.scatters_batch else 1
    devices = []
    for i in logical:
        rows_i = kind.rows_of(shards, i) if i < used else 0
        dev = run.device_result(i, rows_i, i < used) if run else DeviceResult(index=i)
        devices.append(watch.fill(dev, cfg.devices[i]))
    worked = [cfg.devices[i] for i in logical] if out.step_times_s else []
    notes = list(watch.notes(worked))
    strays = []
    pid = os.getpid()
    for cuda, used_bytes in sorted(watch.contexts_of(pid).items()):
        if cuda not in cfg.devices:  # e.g. --devices 2,3 and something touched cuda:0
            strays.append(
                {"rank": None, "pid": pid, "cuda_index": cuda, "used_bytes": used_bytes}
            )
            notes.append(
                f"this process (pid {pid}) holds a CUDA context on cuda:{cuda}, outside the "
                f"chosen GPUs {cfg.devices}"
            )
    result = finish_result(
        ScenarioResult(name=name, batch=cfg.step.batch, devices=tuple(devices),
                       notes=tuple(notes), stray_contexts=tuple(strays)),
        out, cfg, kind.samples_per_step(cfg.step.batch, shards))
    if kind.scatters_batch and len(shards) < n:
        result = dataclasses.replace(result, notes=(*result.notes, (
            f"batch {cfg.step.batch} over {n} GPUs: tensor.chunk makes {len(shards)} chunk(s) "
            f"{shards}, so DataParallel uses only {len(shards)} GPU(s)")))
    return result


class _InProcess:
    """torch's DataParallel over the chosen GPUs (:class:`~dpprof.scenarios.kind.Wrappers`);
    DDP runs in ranks of its own (:func:`dpprof.backends.cuda_ddp.measure_ddp_rank`)."""

    def __init__(self, ids: list[int] | None) -> None:
        self.ids = ids

    def data_parallel(self, module: nn.Module) -> nn.DataParallel[nn.Module]:
        ids = self.ids
        return nn.DataParallel(module, device_ids=ids, output_device=ids[0] if ids else None)

    def ddp(self, model: nn.Module) -> Any:
        raise ValueError("DDP runs one process per GPU, not in this process")
