"""``dpprof check``: dpprof measured against itself on the user's own GPU.

On one GPU (``--device``, default cuda:0) it runs a small workload for real and emulated on
the same GPU model, and gathers the figures a bug report needs:

- the devices: each CUDA device matched to its NVML device by UUID (a MIG device to its own
  handle), or why not;
- per-process NVML: whether NVML lists this process with its memory (in a container without
  the host's PID namespace it lists host PIDs, and never ours);
- the CUDA context (NVML's per-process used minus the allocator's reserve) and one cuBLAS
  workspace (the allocator's growth when a matmul runs on a new stream), beside what the
  emulator assumes for this compute capability;
- per scenario: ``max_memory_allocated`` / ``max_memory_reserved`` / NVML peak used against
  the emulated allocated / reserved / reserved + context;
- the NVML sampler's cost: one tick's duration, and the training step's time with the
  sampler off and on (alternating, median of rounds).

:func:`run_check` returns it all as a JSON-ready dict; :func:`check_lines` renders it.
Without a GPU :func:`run_check` raises :class:`~dpprof.errors.UsageError` (exit 2).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dpprof.backends.cuda_host import DeviceOps, host
from dpprof.backends.cuda_measure import step_closure
from dpprof.emulator import calibration
from dpprof.emulator.context import device_context
from dpprof.errors import UsageError
from dpprof.nvml import libnvml
from dpprof.nvml.devices import resolve_visible_devices
from dpprof.nvml.queries import NvmlBackend
from dpprof.nvml.sampler import NvmlSampler
from dpprof.pipeline import CompareConfig, run_compare
from dpprof.result import RunResult
from dpprof.scenarios.registry import SCENARIOS
from dpprof.scenarios.step import StepConfig
from dpprof.scenarios.workloads import load_workload
from dpprof.units import fmt_bytes

__all__ = ["check_lines", "compare_rows", "run_check", "sampler_cost"]

Progress = Callable[[str], None]


def _err(emulated: int | None, measured: int | None) -> float | None:
    if not emulated or not measured:
        return None
    return (emulated - measured) / measured


def compare_rows(real: RunResult, emu: RunResult) -> list[dict[str, Any]]:
    """One row per scenario and used device present in both runs: measured against
    emulated allocated, reserved, and NVML used against reserved + context."""
    rows: list[dict[str, Any]] = []
    for s in real.scenarios:
        e = emu.scenario(s.name)
        if e is None:
            continue
        for d in s.devices:
            ed = e.device(d.index)
            if ed is None or not d.used:
                continue
            total = (ed.peak_reserved_bytes or 0) + (ed.context_bytes or 0)
            allocated = ed.gpu_allocated_bytes
            rows.append({
                "scenario": s.name, "device": d.index, "status": [s.status, e.status],
                "messages": [s.message, e.message],
                "measured_allocated_bytes": d.peak_allocated_bytes if d.allocator_stats else None,
                "emulated_allocated_bytes": allocated,
                "emulated_workspace_bytes": ed.workspace_bytes,
                "allocated_error": _err(allocated, d.peak_allocated_bytes
                                        if d.allocator_stats else None),
                "measured_reserved_bytes": d.peak_reserved_bytes,
                "emulated_reserved_bytes": ed.peak_reserved_bytes,
                "reserved_error": _err(ed.peak_reserved_bytes, d.peak_reserved_bytes),
                "nvml_peak_used_bytes": d.nvml_peak_used_bytes,
                "nvml_reason": d.nvml_reason,
                "emulated_context_bytes": ed.context_bytes,
                "emulated_total_bytes": total or None,
                "total_error": _err(total, d.nvml_peak_used_bytes),
            })
    return rows


def sampler_cost(
    ops: DeviceOps,
    nvml: NvmlBackend,
    nvml_devices: Sequence[int],
    interval_s: float,
    step: Callable[[], None],
    steps: int = 20,
    rounds: int = 3,
) -> dict[str, Any]:
    """What the NVML sampler costs the steps it times: ``step`` (one training step on the
    device) run ``steps`` times with the sampler off and on, alternating for ``rounds``; the
    median per-step seconds of each, and one sampler tick's seconds (every device's memory,
    utilisation and process list, as the backend samples them)."""
    pids = [os.getpid()]

    def timed() -> float:
        ops.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        ops.synchronize()
        return (time.perf_counter() - t0) / steps

    timed()  # warm-up: kernels loaded, allocator segments made
    off: list[float] = []
    on: list[float] = []
    for _ in range(rounds):
        off.append(timed())
        with NvmlSampler(nvml, list(nvml_devices), interval_s, pids=pids):
            on.append(timed())
    probe = NvmlSampler(nvml, list(nvml_devices), interval_s, pids=pids)
    t0 = time.perf_counter()
    ticks = 10
    for _ in range(ticks):
        probe.sample_once()
    tick_s = (time.perf_counter() - t0) / ticks
    off_s, on_s = statistics.median(off), statistics.median(on)
    return {
        "interval_s": interval_s, "devices_sampled": len(nvml_devices), "steps": steps,
        "rounds": rounds, "tick_s": tick_s, "step_off_s": off_s, "step_on_s": on_s,
        "slowdown": (on_s / off_s - 1) if off_s > 0 else None,
    }


def _devices(nvml: NvmlBackend, uuids: list[str] | None, visible: int) -> list[dict[str, Any]]:
    if not nvml.available:
        why = f"NVML not available: {nvml.status().reason}"
        return [{"cuda_index": i, "matched": False, "reason": why} for i in range(visible)]
    if uuids is None:
        return [{"cuda_index": i, "matched": False,
                 "reason": "the CUDA runtime reports no device UUIDs"} for i in range(visible)]
    return [
        {"cuda_index": d.cuda_index, "matched": d.nvml_index is not None, "uuid": d.uuid,
         "nvml_index": d.nvml_index, "mig": d.mig, "sample_index": d.sample_index,
         "name": d.name, "reason": d.reason}
        for d in resolve_visible_devices(nvml, None, uuids).devices
    ]


def _per_process(nvml: NvmlBackend, index: int | None) -> dict[str, Any]:
    """Whether NVML lists this process on the device it works on, with its memory."""
    if index is None:
        return {"works": False, "reason": "the device is not matched to NVML"}
    procs = nvml.processes(index)
    if procs is None:
        return {"works": False, "reason": nvml.reason("processes", index)}
    me = os.getpid()
    mine = [p for p in procs if p.pid == me]
    if mine:
        used = mine[0].used_bytes
        return {"works": used is not None, "used_bytes": used,
                "reason": None if used is not None else "NVML lists this process without "
                "its memory (the driver cannot tell)"}
    if procs:
        return {"works": False, "pids_listed": sorted(p.pid for p in procs)[:8],
                "reason": f"NVML lists {len(procs)} process(es) but not this one (pid {me}): "
                "PIDs of another PID namespace (a container without --pid=host)"}
    return {"works": False, "reason": "NVML lists no process on the device"}


def run_check(
    device: int = 0,
    workload: str = "mlp",
    batch: int = 64,
    steps: int = 3,
    scenarios: tuple[str, ...] = SCENARIOS,
    nvml_interval_s: float = 0.02,
    nvml: NvmlBackend | None = None,
    progress: Progress | None = None,
    sampler_steps: int = 20,
) -> dict[str, Any]:
    """Everything ``dpprof check`` reports, as a JSON-ready dict (see the module docstring)."""
    machine = host()
    visible = machine.visible_gpus()
    if visible < 1:
        raise UsageError("no CUDA GPU visible: dpprof check measures a real GPU; on this "
                         "machine use dpprof compare (emulated)")
    if not 0 <= device < visible:
        raise UsageError(f"--device {device}: this process sees {visible} CUDA GPU(s), "
                         f"0..{visible - 1}")
    say = progress or (lambda text: None)
    nvml = nvml or libnvml.default_nvml()
    report = _the_gpu(machine, nvml, device, visible)
    report.update(workload=workload, batch=batch)
    say("running the scenarios on the GPU")
    _scenarios_both_ways(report, say, scenarios, steps, nvml_interval_s)
    say("measuring the context, a cuBLAS workspace and the sampler's cost")
    _libraries_and_sampler(report, machine, nvml, nvml_interval_s, sampler_steps)
    return report


def _the_gpu(machine: Any, nvml: NvmlBackend, device: int, visible: int) -> dict[str, Any]:
    """The report's head: the device, its GPU model and capacity, every device matched."""
    found = _devices(nvml, machine.uuids(), visible)
    mine = found[device] if device < len(found) else {}
    props = machine.properties(device)
    info = nvml.device_info(mine["nvml_index"]) if mine.get("nvml_index") is not None else None
    cc = props[2] if props else (nvml.compute_capability(info.index) if info else None)
    name = props[0] if props else (mine.get("name") or (info.name if info else None))
    capacity = props[1] if props else (info.total_bytes if info else None)
    return {
        "device": device, "gpu": name, "capacity_bytes": capacity,
        "compute_capability": list(cc) if cc else None, "torch": torch.__version__,
        "cuda": torch.version.cuda, "driver": nvml.driver_version(),
        "nvml": {"available": nvml.available, "reason": nvml.status().reason},
        "devices": found,
    }


def _compute_capability(report: dict[str, Any]) -> tuple[int, int]:
    cc = report.get("compute_capability")
    return (int(cc[0]), int(cc[1])) if cc else CompareConfig().compute_capability


def _scenarios_both_ways(report: dict[str, Any], say: Progress, scenarios: tuple[str, ...],
                         steps: int, nvml_interval_s: float) -> None:
    """The scenarios on the GPU, then emulated for the same GPU model: ``rows``."""
    common: dict[str, Any] = {
        "workload": report["workload"], "scenarios": scenarios, "fixes": False,
        "count_reserved": True,
        "step": StepConfig(batch=report["batch"], warmup=1, steps=steps),
        "nvml_interval_s": nvml_interval_s,
        "gpu_memory_bytes": report["capacity_bytes"] or CompareConfig().gpu_memory_bytes,
    }
    t0 = time.perf_counter()
    real = run_compare(CompareConfig(backend="cuda", devices=(report["device"],), **common))
    t1 = time.perf_counter()
    say("emulating the same scenarios")
    emu = run_compare(CompareConfig(backend="emulated", gpus=1,
                                    compute_capability=_compute_capability(report), **common))
    t2 = time.perf_counter()
    assert real is not None and emu is not None
    report["rows"] = compare_rows(real, emu)
    report["notes"] = sorted({n for s in real.scenarios for n in s.notes})
    report["seconds"] = {"cuda": round(t1 - t0, 2), "emulated": round(t2 - t1, 2)}


def _libraries_and_sampler(report: dict[str, Any], machine: Any, nvml: NvmlBackend,
                           nvml_interval_s: float, sampler_steps: int) -> None:
    """The context and a cuBLAS workspace measured beside the emulator's figures, per-process
    NVML, and the sampler's cost on a training step."""
    found = report["devices"]
    mine = found[report["device"]] if report["device"] < len(found) else {}
    sample_index = mine.get("sample_index") if mine.get("matched") else None
    ops = machine.ops([report["device"]])
    ops.set_device(0)
    step = step_closure(load_workload(report["workload"]), ops, report["batch"])
    step()  # this process now holds a context on the device, and the model's memory
    probe = ops.probe(0)
    report["per_process_nvml"] = _per_process(nvml, sample_index)
    used = report["per_process_nvml"].get("used_bytes")
    model = device_context(_compute_capability(report), uses_cudnn=False)
    report["context"] = {
        "measured_bytes": (used - probe["reserved_bytes"])
        if used is not None and "reserved_bytes" in probe else None,
        "how": "NVML's used memory of this process minus torch.cuda.memory_reserved",
        "emulated_bytes": model.cuda_context_bytes,
    }
    report["cublas_workspace"] = {
        "measured_bytes": probe.get("cublas_workspace_bytes"),
        "how": "torch.cuda.memory_allocated's growth when a matmul first runs on a new stream",
        "emulated_bytes": model.cublas_workspace_bytes,
    }
    if sample_index is not None and nvml.available:
        report["sampler"] = sampler_cost(ops, nvml, sorted(
            {d["sample_index"] for d in found if d.get("sample_index") is not None}),
            nvml_interval_s, step, steps=sampler_steps)
    else:
        report["sampler"] = {"reason": mine.get("reason") or "NVML cannot read this device"}
    del step
    ops.release()


def _b(x: object) -> str:
    return fmt_bytes(x) if isinstance(x, int) else "-"


def _pct(x: object) -> str:
    return f"{x:+.1%}" if isinstance(x, float) else "-"


def check_lines(report: dict[str, Any]) -> list[str]:
    """``dpprof check``'s report as text lines (for a terminal or a bug report)."""
    cc = report.get("compute_capability")
    lines = [
        f"dpprof check on cuda:{report['device']}: {report.get('gpu') or 'unknown GPU'}"
        + (f", compute {cc[0]}.{cc[1]}" if cc else "")
        + (f", {_b(report.get('capacity_bytes'))}" if report.get("capacity_bytes") else ""),
        f"torch {report['torch']}, CUDA {report.get('cuda') or '-'}, driver "
        f"{report.get('driver') or '-'}; workload {report['workload']}, batch {report['batch']}",
        "",
        "CUDA and NVML devices",
    ]
    for d in report["devices"]:
        if d.get("matched"):
            kind = " (MIG: sampled through its own handle)" if d.get("mig") else ""
            lines.append(f"  cuda:{d['cuda_index']} = NVML {d['nvml_index']} {d['uuid']}{kind}")
        else:
            lines.append(f"  cuda:{d['cuda_index']}: not matched: {d.get('reason')}")
    pp = report.get("per_process_nvml", {})
    lines.append("per-process NVML: " + (
        f"works (this process: {_b(pp.get('used_bytes'))})" if pp.get("works")
        else f"no: {pp.get('reason')}"))
    ctx, ws = report.get("context", {}), report.get("cublas_workspace", {})
    lines.append(f"CUDA context: {_b(ctx.get('measured_bytes'))} measured, "
                 f"{_b(ctx.get('emulated_bytes'))} emulated ({ctx.get('how')})")
    lines.append(f"cuBLAS workspace: {_b(ws.get('measured_bytes'))} measured, "
                 f"{_b(ws.get('emulated_bytes'))} emulated ({ws.get('how')})")
    lines += ["", f"{'scenario':<16} {'allocated':>10} {'emulated':>10} {'error':>7} "
              f"{'reserved':>10} {'emulated':>10} {'error':>7} {'NVML used':>10} "
              f"{'emu total':>10} {'error':>7}  status"]
    for r in report.get("rows", []):
        status = "/".join(r["status"])
        lines.append(
            f"{r['scenario']:<16} {_b(r['measured_allocated_bytes']):>10} "
            f"{_b(r['emulated_allocated_bytes']):>10} {_pct(r['allocated_error']):>7} "
            f"{_b(r['measured_reserved_bytes']):>10} {_b(r['emulated_reserved_bytes']):>10} "
            f"{_pct(r['reserved_error']):>7} {_b(r['nvml_peak_used_bytes']):>10} "
            f"{_b(r['emulated_total_bytes']):>10} {_pct(r['total_error']):>7}  {status}")
    s = report.get("sampler", {})
    lines.append("")
    if "tick_s" in s:
        lines.append(
            f"NVML sampler every {s['interval_s'] * 1e3:.0f} ms over {s['devices_sampled']} "
            f"GPU(s): one tick {s['tick_s'] * 1e3:.2f} ms; step {s['step_off_s'] * 1e3:.2f} ms "
            f"off, {s['step_on_s'] * 1e3:.2f} ms on ({_pct(s['slowdown'])})")
    else:
        lines.append(f"NVML sampler cost: not measured ({s.get('reason')})")
    lines += [f"note: {n}" for n in report.get("notes", [])]
    return lines


def save_measured(report: dict[str, Any]) -> str:
    """Save the context and cuBLAS workspace ``report`` measured as the calibration of its
    GPU's compute capability (:mod:`dpprof.emulator.calibration`); what was done, in words."""
    context = (report.get("context") or {}).get("measured_bytes")
    workspace = (report.get("cublas_workspace") or {}).get("measured_bytes")
    cc = report.get("compute_capability")
    if not cc or not isinstance(context, int) or not isinstance(workspace, int) \
            or context < 0 or workspace <= 0:
        return ("no calibration saved: the context or the cuBLAS workspace was not measured "
                "(per-process NVML or the workspace probe unavailable here)")
    cal = calibration.measured_now(str(report.get("gpu") or "this GPU"),
                                   (int(cc[0]), int(cc[1])), context, workspace,
                                   str(report.get("torch") or torch.__version__))
    path = calibration.save(cal)
    return (f"saved the calibration of compute capability {cc[0]}.{cc[1]} to {path}: "
            "emulations for it now use the measured context and workspace, and say so")
