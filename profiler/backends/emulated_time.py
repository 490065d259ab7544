"""The emulated step's time, predicted: the op log of the measured step
(:mod:`dpprof.emulator.op_log`) played on the target GPU (:mod:`dpprof.emulator.step_time`),
written into the scenario's result."""

from __future__ import annotations

from dpprof.emulator.catalog import DEFAULT_GPU, lookup_gpu
from dpprof.emulator.op_log import OpLog
from dpprof.emulator.step_time import H200_FIT, StepPrediction, predict_step, rates_for
from dpprof.result import ScenarioResult

__all__ = ["fill_predicted_time"]


def fill_predicted_time(result: ScenarioResult, log: OpLog, gpu: str, interconnect: str,
                        ranks_alike: bool) -> StepPrediction:
    """Predict the step of ``log`` on ``gpu`` (a catalog name; "": the default) and write
    it into ``result`` (its step, samples per second, each device's split). With
    ``ranks_alike`` (DDP: one rank emulated for all), every device gets the rank's split."""
    spec = lookup_gpu(gpu) if gpu else DEFAULT_GPU
    shown = [d.index for d in result.devices if d.used]
    pred = predict_step(log.records, rates_for(spec, interconnect), H200_FIT, shown)
    result.predicted_step_time_s = pred.step_time_s
    result.predicted_host_s = pred.host_s
    if pred.step_time_s > 0:
        result.predicted_samples_per_s = result.batch / pred.step_time_s
    for d in result.devices:
        if not d.used:
            continue
        p = pred.devices.get(0 if ranks_alike else d.index)
        if p is None:
            continue
        d.predicted_busy_s = {"compute": p.compute_s, "communication": p.communication_s,
                              "waiting": p.waiting_s}
    return pred
