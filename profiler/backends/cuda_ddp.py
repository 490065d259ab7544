"""The ``cuda`` backend's ``ddp`` ranks: the per-rank body over :mod:`dpprof.backends.ranks`.

What one rank measures (:func:`measure_ddp_rank`) and the ``ddp`` result from every rank's
measurement (:func:`ddp_scenario`) are here too.

The processes (spawn or torchrun), the process group, the timeouts, the failure reporting
through the c10d store and the NCCL abort watcher are :mod:`dpprof.backends.ranks`, shared with the
``cpu`` backend (:mod:`dpprof.backends.gloo`). Here:

- :class:`DdpJob`: what every rank needs (workload spec, :class:`CudaRunConfig` with the
  step's options, DDP's and the dtype among them, ``backend`` ``"nccl"`` | ``"gloo"``,
  ``device`` ``"cuda"`` | ``"cpu"``, collective timeout, run id);
  it is the picklable body: called in a rank, it measures that rank's device
  (:func:`measure_ddp_rank`, CUDA events, NVML, OOM as a result);
- :func:`rank_entry` ``(job, info, store=None)``: one rank through
  :func:`dpprof.backends.ranks.run_in_group`; on rank 0 every rank's :class:`Measured` (None
  elsewhere), a rank that raised or never reported as an error :class:`Measured`;
- :func:`spawn_ddp` ``(job, world)``: dpprof starts the ranks itself
  (:func:`dpprof.backends.ranks_spawn.spawn_ranks`), every rank's :class:`Measured`;
- :class:`RankInfo`, :func:`torchrun_info`: from :mod:`dpprof.backends.ranks`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import statistics
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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
from dpprof.backends.ranks import (
    DEFAULT_TIMEOUT_S,
    Group,
    RankInfo,
    RankOutcome,
    run_in_group,
    torchrun_info,
)
from dpprof.backends.ranks_spawn import spawn_ranks
from dpprof.nvml.queries import NvmlBackend
from dpprof.result import STATUS_ERROR, STATUS_OK, STATUS_OOM, DeviceResult, ScenarioResult
from dpprof.scenarios.names import DDP
from dpprof.scenarios.step import scenario_batch
from dpprof.scenarios.workloads import Workload, load_workload, make_optimizer
from dpprof.units import fmt_bytes

__all__ = [
    "DdpJob",
    "RankInfo",
    "ddp_scenario",
    "measure_ddp_rank",
    "rank_entry",
    "spawn_ddp",
    "torchrun_info",
]


@dataclass
class DdpJob:
    """What every rank needs; picklable (it travels to spawned processes)."""

    workload: str  # a workload spec (built-in name, module:function, file.py:function)
    cfg: CudaRunConfig
    backend: str = "nccl"  # "nccl" | "gloo"
    device: str = "cuda"  # "cuda" | "cpu"
    timeout_s: float = DEFAULT_TIMEOUT_S  # collective timeout, and the bound on every wait
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def __post_init__(self) -> None:
        self.group()  # validates backend and device

    def group(self) -> Group:
        return Group(backend=self.backend, device=self.device,
                     devices=tuple(self.cfg.devices) or None, timeout_s=self.timeout_s,
                     run_id=self.run_id)

    def __call__(self, info: RankInfo, device_index: int) -> Measured:
        """The body of one rank: measure its device under DDP."""
        wl = self.cfg.step.workload(load_workload(self.workload))
        measured = measure_ddp_rank(wl, self.cfg, info.rank, info.world_size, device_index)
        measured.devices = [
            dataclasses.replace(d, node=info.hostname, node_rank=info.node_rank,
                                local_rank=info.local_rank) for d in measured.devices]
        return measured

    def succeeded(self, value: Any) -> bool:
        return bool(value.status == STATUS_OK)


def _measured(outcome: RankOutcome) -> Measured:
    m: Measured = outcome.value if outcome.value is not None else Measured(
        status=STATUS_ERROR, message=outcome.message, rank=outcome.rank,
        traceback=outcome.traceback or None,
    )
    if outcome.first_failure:
        m.notes.insert(0, f"rank {outcome.rank} failed first")
        m.first_failure = True
    return m


def rank_entry(job: DdpJob, info: RankInfo, store: Any = None) -> list[Measured] | None:
    """The body of one DDP rank; on rank 0, every rank's :class:`Measured` in rank order."""
    outcomes = run_in_group(job.group(), job, info, store)
    return None if outcomes is None else [_measured(o) for o in outcomes]


def spawn_ddp(job: DdpJob, world: int) -> list[Measured]:
    """Start ``world`` ranks, wait for them (bounded), return every rank's outcome."""
    return [_measured(o) for o in spawn_ranks(job.group(), job, world)]


def measure_ddp_rank(
    wl: Workload,
    cfg: CudaRunConfig,
    rank: int,
    world: int,
    local_device: int,
    ops: DeviceOps | None = None,
    nvml: NvmlBackend | None = None,
    cuda_uuids: Sequence[str] | None = None,
    visible: Sequence[int] | None = None,
) -> Measured:
    """Measure this rank's device under ``DistributedDataParallel`` (process group set up).

    The caller (:mod:`dpprof.backends.ranks`) has called ``torch.cuda.set_device(local_device)``
    and ``init_process_group``. ``visible``: the CUDA indices to watch for stray contexts of
    this process (default: every visible GPU). DDP's options are ``cfg.step.ddp``. Never
    raises.
    """
    ops = ops or host().ops([local_device])
    out = Measured(rank=rank)
    pid = os.getpid()
    # the process that started this rank (dpprof, or torchrun's agent) is not the job's:
    # memory it holds on the rank's GPU (dpprof's context from work it did before) is left
    # out of the rank's NVML figure
    watch = watch_for(ops, cfg, nvml, cuda_uuids, [pid], others=[os.getppid()])
    per = math.ceil(cfg.step.batch / world)

    def setup() -> LoopArgs:
        batches = StepBatches(
            lambda k: scenario_batch(wl, cfg.step.seed, k, cfg.step.batch, world, rank),
            cfg.warmup_steps + cfg.steps)
        model, loss_fn = model_on_device(wl, ops.device(0), cfg.step.seed)
        model.train()
        ids = [local_device] if ops.kind == "cuda" else None
        wrapped = cfg.step.ddp.wrap(model, ids)
        opt = make_optimizer(wl, model, loss_fn)
        out.rows = per
        return LoopArgs(wrapped, loss_fn, opt, batches, False, wl.step)

    run = measure_loop(ops, cfg, [0], watch, out, setup)
    if out.status == STATUS_OOM:
        out.oom_device = rank
    dev = run.device_result(0, per, True) if run else DeviceResult(index=0)
    dev = dataclasses.replace(dev, index=rank, rank=rank,
                              cuda_index=local_device if ops.kind == "cuda" else None,
                              node=socket.gethostname())
    out.devices = [watch.fill(dev, local_device)]
    strays = {
        cuda: used
        for cuda, used in watch.contexts_of(pid).items()
        if cuda != local_device and (visible is None or cuda in visible)
    }
    for cuda, used in sorted(strays.items()):
        out.stray_contexts.append(
            {"rank": rank, "pid": pid, "cuda_index": cuda, "used_bytes": used}
        )
        out.notes.append(
            f"rank {rank} (pid {pid}) holds a CUDA context on cuda:{cuda}"
            + (f" ({fmt_bytes(used)})" if used else "")
            + f", not only on its own cuda:{local_device}: call torch.cuda.set_device("
            "local_rank) before anything touches CUDA"
        )
    out.notes.extend(watch.notes([local_device] if out.step_times_s else []))
    return out


def ddp_scenario(outcomes: Sequence[Measured], cfg: CudaRunConfig, world: int) -> ScenarioResult:
    """The ``ddp`` result from every rank's :class:`Measured` (rank order)."""
    merged = Measured()
    failed = [o for o in outcomes if o.status != STATUS_OK]
    first = next(
        (o for o in failed if o.first_failure),
        next((o for o in failed if o.status == STATUS_OOM), failed[0] if failed else None),
    )
    devices: list[DeviceResult] = []
    strays: list[dict[str, Any]] = []
    notes: list[str] = []
    for o in sorted(outcomes, key=lambda o: o.rank or 0):
        devices.extend(o.devices)
        strays.extend(o.stray_contexts)
        for note in o.notes:
            if note not in notes:
                notes.append(note)
    ok = [o for o in outcomes if o.step_times_s]
    if ok and not failed:
        # a DDP step ends when the slowest rank's does: median over steps of the max over ranks
        steps = min(len(o.step_times_s) for o in ok)
        merged.step_times_s = [max(o.step_times_s[k] for o in ok) for k in range(steps)]
        events = [o for o in ok if o.event_times_s]
        if events:
            n_ev = min(len(o.event_times_s) for o in events)
            merged.event_times_s = [max(o.event_times_s[k] for o in events) for k in range(n_ev)]
        losses = [o.loss for o in ok if o.loss is not None]
        merged.loss = statistics.fmean(losses) if losses else None
    if first is not None:
        merged.status = first.status
        merged.message = f"rank {first.rank}: {first.message}"
        merged.oom_device = first.oom_device
        merged.oom_bytes = first.oom_bytes
        merged.oom_phase = first.oom_phase
        merged.traceback = first.traceback
        others = [o for o in failed if o is not first]
        if others:
            merged.notes.append(
                "then: " + "; ".join(f"rank {o.rank}: {o.message[:160]}" for o in others)
            )
    result = finish_result(  # DistributedSampler's pad rows repeat
        ScenarioResult(name=DDP, batch=cfg.step.batch, devices=tuple(devices),
                       stray_contexts=tuple(strays), notes=tuple(notes)),
        merged, cfg, cfg.step.batch)
    batch = cfg.step.batch
    return dataclasses.replace(
        result,
        traceback=first.traceback if first is not None and first.traceback
        else result.traceback,
        notes=result.notes + ((
            f"each rank gets ceil({batch} / {world}) = {math.ceil(batch / world)} rows "
            "(DistributedSampler pads)",) if batch % world else ()))
