"""The ``cpu`` backend's ddp scenario: real gloo ranks, one per simulated GPU.

The DataParallel scenarios and ``single`` of the ``cpu`` backend are the emulator over CPU
tensors (:mod:`dpprof.backends.emulated` with ``compute=True``); ``ddp`` is measured for real
through :func:`dpprof.backends.gloo.launch`, each rank's memory from ``torch.profiler``.
"""

from __future__ import annotations

from dpprof.backends.emulated import EmulationConfig
from dpprof.backends.gloo import DistributedRunError, RankSpec, launch
from dpprof.result import STATUS_ERROR, STATUS_OK, DeviceResult, ScenarioResult
from dpprof.scenarios.names import DDP
from dpprof.scenarios.shards import shard_sizes


def run_ddp_gloo(workload: str, cfg: EmulationConfig, ddp_timeout_s: float) -> ScenarioResult:
    """Run the ddp scenario as ``cfg.gpus`` gloo processes with the step the emulated
    scenarios beside it get (``cfg.step`` as it is: batch, seed, warm-up, dtype, autocast,
    DDP's options); a failure is a result.

    ``workload`` is the spec each rank loads.
    """
    gpus = cfg.gpus
    batch = cfg.step.batch
    rows = shard_sizes(batch, gpus)[0]
    spec = RankSpec(
        workload=workload, step=cfg.step,
        # --ddp-timeout bounds every wait of the gloo ranks too (collectives, the store, the
        # wait for the others after a failure); the whole run stays bounded by the join
        pg_timeout_s=ddp_timeout_s, grace_s=min(10.0, ddp_timeout_s),
        join_timeout_s=max(600.0, 3 * ddp_timeout_s + 60),
    )
    try:
        ranks = launch(spec, gpus)
    except DistributedRunError as e:
        notes = [f"then: {e.others()[:2000]}"] if e.others() else []
        if cfg.debug:
            notes.append(e.details())
        return ScenarioResult(name=DDP, batch=batch, status=STATUS_ERROR, message=str(e),
                              traceback=e.culprit_traceback(), notes=tuple(notes))
    devices = tuple(DeviceResult(
        index=r.rank, rank=r.rank, node=r.hostname, used=True, batch_rows=rows,
        peak_allocated_bytes=r.peak_allocated_bytes or 0,
        peak_requested_bytes=r.peak_requested_bytes or 0,
        capacity_bytes=cfg.gpu_memory_bytes,
        breakdown_bytes={"other": r.peak_allocated_bytes or 0},
        peak_phase="step",
    ) for r in ranks)
    times = sorted(r.step_time_s for r in ranks if r.step_time_s is not None)
    step_time_s = times[len(times) // 2] if times else None
    losses = [r.loss for r in ranks if r.loss is not None]
    return ScenarioResult(
        name=DDP, batch=batch, status=STATUS_OK, devices=devices,
        step_time_s=step_time_s,
        step_time_spread_s=times[-1] - times[0] if times else None,
        # pad rows repeat
        throughput_samples_per_s=batch / step_time_s if step_time_s is not None else None,
        loss=sum(losses) / len(losses) if losses else None,
        notes=(f"each rank gets ceil({batch} / {gpus}) = {rows} rows",) if batch % gpus else (),
    )
