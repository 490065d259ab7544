"""The ``cuda`` backend's ``ddp`` ranks: the per-rank body over :mod:`dpprof.backends.ranks`.

The processes (spawn or torchrun), the process group, the timeouts, the failure reporting
through the c10d store and the NCCL abort watcher are :mod:`dpprof.backends.ranks`, shared with the
``cpu`` backend (:mod:`dpprof.backends.gloo`). Here:

- :class:`DdpJob`: what every rank needs (workload spec, :class:`CudaRunConfig` with the
  step's options, DDP's and the dtype among them, ``backend`` ``"nccl"`` | ``"gloo"``,
  ``device`` ``"cuda"`` | ``"cpu"``, collective timeout, run id);
  it is the picklable body: called in a rank, it measures that rank's device
  (:func:`dpprof.backends.cuda.measure_ddp_rank`, CUDA events, NVML, OOM as a result);
- :func:`rank_entry` ``(job, info, store=None)``: one rank through
  :func:`dpprof.backends.ranks.run_in_group`; on rank 0 every rank's :class:`Measured` (None
  elsewhere), a rank that raised or never reported as an error :class:`Measured`;
- :func:`spawn_ddp` ``(job, world)``: dpprof starts the ranks itself
  (:func:`dpprof.backends.ranks.spawn_ranks`), every rank's :class:`Measured`;
- :class:`RankInfo`, :func:`torchrun_info`: from :mod:`dpprof.backends.ranks`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from dpprof.backends.cuda import CudaRunConfig, Measured, measure_ddp_rank
from dpprof.backends.ranks import (
    DEFAULT_TIMEOUT_S,
    Group,
    RankInfo,
    RankOutcome,
    run_in_group,
    spawn_ranks,
    torchrun_info,
)
from dpprof.result import STATUS_ERROR, STATUS_OK

__all__ = ["DdpJob", "RankInfo", "rank_entry", "spawn_ddp", "torchrun_info"]


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
        from dpprof.scenarios.workloads import load_workload

        wl = self.cfg.step.workload(load_workload(self.workload))
        measured = measure_ddp_rank(wl, self.cfg, info.rank, info.world_size, device_index)
        for d in measured.devices:
            d.node = info.hostname
            d.node_rank = info.node_rank
            d.local_rank = info.local_rank
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
