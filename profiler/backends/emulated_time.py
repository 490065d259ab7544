"""The emulated step's time, predicted: the op log of the measured step
(:mod:`dpprof.emulator.op_log`) played on the target GPU (:mod:`dpprof.emulator.step_time`),
written into the scenario's result."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from dpprof.emulator.catalog import DEFAULT_GPU, lookup_gpu
from dpprof.emulator.op_log import OpLog
from dpprof.emulator.step_time import H200_FIT, StepPrediction, predict_step, rates_for
from dpprof.result import DeviceResult, ScenarioResult
from dpprof.scenarios.step import StepConfig
from dpprof.scenarios.workloads import Workload

__all__ = ["fill_predicted_time", "single_step_log", "write_prediction"]


def fill_predicted_time(result: ScenarioResult, log: OpLog, gpu: str, interconnect: str,
                        ranks_alike: bool, start: int = 0) -> ScenarioResult:
    """Predict the step of ``log`` (its records from ``start`` on) on ``gpu`` (a catalog
    name; "": the default): ``result`` with it (its step, samples per second, each
    device's split). With ``ranks_alike`` (DDP: one rank emulated for all), every device
    gets the rank's split."""
    spec = lookup_gpu(gpu) if gpu else DEFAULT_GPU
    shown = [d.index for d in result.devices if d.used]
    pred = predict_step(log.records[start:], rates_for(spec, interconnect), H200_FIT, shown)
    # the rows the scenario's GPUs computed (single: one share)
    rows = sum(d.batch_rows for d in result.devices if d.used) or result.batch
    return write_prediction(result, pred, rows, lambda d: 0 if ranks_alike else d.index)


def write_prediction(result: ScenarioResult, pred: StepPrediction, rows: int,
                     source: Callable[[DeviceResult], int]) -> ScenarioResult:
    """``result`` with ``pred``: its step, ``rows`` a step over it (samples per second),
    each used device's split, read from the device ``source`` names (its emulated index)."""
    devices = []
    for d in result.devices:
        p = pred.devices.get(source(d)) if d.used else None
        devices.append(d if p is None else dataclasses.replace(d, predicted_busy_s={
            "compute": p.compute_s, "communication": p.communication_s,
            "overlap": p.overlap_s, "waiting": p.waiting_s}))
    return dataclasses.replace(
        result, predicted_step_time_s=pred.step_time_s, predicted_host_s=pred.host_s,
        predicted_samples_per_s=(rows / pred.step_time_s if pred.step_time_s > 0
                                 else result.predicted_samples_per_s),
        devices=tuple(devices))


def single_step_log(wl: Workload, batch: int, amp: str | None = None) -> OpLog:
    """The op log of ``single``'s measured step of ``wl`` at ``batch`` (under autocast to
    ``amp``), emulated over meta tensors: what the model is fitted to and checked on."""
    from dpprof.backends.emulated import EmulationConfig, run_scenario  # it imports this

    trace: dict[str, Any] = {}
    cfg = EmulationConfig(gpus=1, gpu_memory_bytes=1 << 50,
                          step=StepConfig(batch=batch, amp=amp))
    result = run_scenario("single", wl, cfg, trace=trace)
    if result.status != "ok":
        raise RuntimeError(f"single did not run: {result.message}")
    log = trace["rt"].op_log
    assert isinstance(log, OpLog)
    return log
