"""The step time the model predicts beside the one the cuda backend measured: each measured
scenario emulated as it ran (the same workload, batch, GPUs and options, over meta tensors)
with its op log played on the GPU measured (:mod:`dpprof.backends.emulated_time`), written
into the measured result (``predicted_step_time_s``, samples per second, each GPU's busy
split), so the reports show predicted against measured and the error of the model on that
machine can be read off."""

from __future__ import annotations

import dataclasses

from dpprof.backends.cuda_host import host
from dpprof.backends.emulated import run_scenario
from dpprof.backends.emulated_config import EmulationConfig
from dpprof.emulator.catalog import GpuSpec, lookup_gpu
from dpprof.result import STATUS_OK, RunResult, ScenarioResult
from dpprof.scenarios.workloads import Workload

__all__ = ["measured_gpu", "predict_beside_measured"]

# The emulated memory of each GPU while predicting: the scenario ran on the real GPU, so its
# step is played whatever the emulated allocator would say of it (a scenario the emulator
# judged out of memory would have no step to predict).
_UNBOUNDED_BYTES = 1 << 50


def measured_gpu(gpu: str, devices: list[int]) -> GpuSpec | None:
    """The catalog GPU to predict for: ``--gpu`` where given, else the first measured
    device's own model (its CUDA name); None where the catalog does not know it."""
    if gpu:
        return lookup_gpu(gpu)
    props = host().properties(devices[0]) if devices else None
    if props is None:
        return None
    try:
        return lookup_gpu(props[0])
    except KeyError:
        return None


def predict_beside_measured(run: RunResult, wl: Workload, ecfg: EmulationConfig,
                            spec: GpuSpec | None) -> RunResult:
    """``run`` with each scenario that measured a step given the step ``spec`` is predicted
    to take for it (``ecfg``: the emulator's part of the comparison, for the GPUs measured);
    without ``spec``, a note says why none is predicted."""
    if not any(_measured_a_step(s) for s in run.scenarios):
        return run
    if spec is None:
        return dataclasses.replace(run, notes=(
            *run.notes, "no predicted step time beside the measured one: the GPU measured "
            "is not in dpprof's catalog (give --gpu with the closest model)"))
    cfg = dataclasses.replace(ecfg, gpu=spec.key, gpu_memory_bytes=_UNBOUNDED_BYTES,
                              compute=False, peaks_only=False, predict_time=True)
    scenarios = []
    for s in run.scenarios:
        if _measured_a_step(s):
            emulated = run_scenario(s.name, wl, cfg)
            if emulated.status == STATUS_OK and emulated.predicted_step_time_s is not None:
                s = _with_prediction(emulated, s)
        scenarios.append(s)
    return dataclasses.replace(run, scenarios=tuple(scenarios))


def _measured_a_step(s: ScenarioResult) -> bool:
    return s.status == STATUS_OK and bool(s.step_time_s)


def _with_prediction(emulated: ScenarioResult, s: ScenarioResult) -> ScenarioResult:
    """The measured ``s`` with ``emulated``'s prediction: the step, and each used GPU's
    split by its place among the used GPUs (the measured ones carry their CUDA indices, a
    DDP rank its own row)."""
    theirs = [d for d in emulated.devices if d.used]
    devices = s.devices
    if sum(d.used for d in s.devices) == len(theirs):
        split = iter(theirs)
        devices = tuple(dataclasses.replace(d, predicted_busy_s=dict(next(split).predicted_busy_s))
                        if d.used else d for d in s.devices)
    return dataclasses.replace(
        s, predicted_step_time_s=emulated.predicted_step_time_s,
        predicted_host_s=emulated.predicted_host_s,
        predicted_samples_per_s=emulated.predicted_samples_per_s, devices=devices)
