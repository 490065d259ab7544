"""A ``dpprof watch`` run as a result: the samples file's records turned into a
:class:`~dpprof.result.RunResult` (per-GPU peaks and timelines, the out-of-memory errors with
the memory around them), whether the run finished or was cut short."""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dpprof.answers.answer import settled
from dpprof.answers.post_mortem import post_mortem, watch_ending
from dpprof.result import (
    STATUS_ERROR,
    STATUS_OK,
    STATUS_OOM,
    DeviceResult,
    RunResult,
    ScenarioResult,
    TimelinePoint,
    WatchDevice,
    WatchOom,
    WatchResult,
    new_result,
)
from dpprof.watch.samples import read_records

__all__ = ["BACKEND", "REPORT_POINTS", "build_run", "load_run", "scenario_name"]

BACKEND = "nvml-watch"
REPORT_POINTS = 4000  # timeline points per GPU in a report (the samples file keeps all)
OOM_WINDOW_S = 1.0  # "peak before the OOM": the readings in this window before the message


def load_run(path: str | Path, extra_notes: Iterable[str] = ()) -> RunResult:
    """A report-ready :class:`RunResult` from a samples file, complete or cut short."""
    records, notes = read_records(path)
    return build_run(records, samples_path=str(path), notes=[*extra_notes, *notes])


def _downsample(points: list[tuple[float, int]], limit: int) -> list[tuple[float, int]]:
    """At most ``limit`` points that keep each bucket's lowest and highest reading (so the
    peak survives), in time order."""
    if len(points) <= limit:
        return points
    buckets = max(limit // 2, 1)
    size = len(points) / buckets
    out: list[tuple[float, int]] = []
    for b in range(buckets):
        chunk = points[int(b * size) : int((b + 1) * size)]
        if not chunk:
            continue
        lo = min(range(len(chunk)), key=lambda i: chunk[i][1])
        hi = max(range(len(chunk)), key=lambda i: chunk[i][1])
        out.extend(chunk[i] for i in sorted({lo, hi}))
    return out


def scenario_name(command: Sequence[str], limit: int = 60) -> str:
    """The command as a shell would show it, shortened to ``limit`` characters."""
    text = shlex.join(command)
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclasses.dataclass
class _Records:
    """What a samples file's records say, sorted by kind."""

    devices: list[WatchDevice]
    series: dict[int, list[tuple[float, int]]]  # NVML index -> (t_s, used bytes)
    command_bytes: dict[tuple[int, float], int]  # (NVML index, t_s) -> the command's bytes
    ooms: list[WatchOom]
    signals: list[dict[str, Any]]
    spawn_t: float | None = None
    pid: int | None = None
    end: dict[str, Any] | None = None
    last_t: float = 0.0


def _read(records: list[dict[str, Any]], notes: list[str]) -> _Records:
    """The records after the header, by kind; a malformed one is skipped with a note."""
    devices = [WatchDevice(**_known(WatchDevice, d)) for d in records[0].get("devices", [])]
    by_nvml = {d.nvml_index: i for i, d in enumerate(devices)}
    out = _Records(devices, {d.nvml_index: [] for d in devices}, {}, [], [])
    for rec in records[1:]:
        kind = rec.get("kind")
        t = rec.get("t_s")
        if isinstance(t, int | float):
            out.last_t = max(out.last_t, float(t))
        try:
            if kind == "sample" and rec["device"] in out.series:
                out.series[rec["device"]].append((float(rec["t_s"]), int(rec["used_bytes"])))
            elif kind == "process" and rec.get("used_bytes") is not None:
                key = (int(rec["device"]), float(rec["t_s"]))
                out.command_bytes[key] = out.command_bytes.get(key, 0) + int(rec["used_bytes"])
            elif kind == "stopped" and rec["device"] in by_nvml:
                i = by_nvml[rec["device"]]
                devices[i] = dataclasses.replace(devices[i], stopped_reason=str(rec.get("reason")))
            elif kind == "spawn":
                out.spawn_t, out.pid = float(rec["t_s"]), int(rec["pid"])
            elif kind == "oom":
                out.ooms.append(WatchOom(**_known(WatchOom, rec)))
            elif kind == "signal":
                out.signals.append({k: v for k, v in rec.items() if k != "kind"})
            elif kind == "exit":
                out.end = rec
        except (KeyError, TypeError, ValueError):
            notes.append(f"a malformed {kind!r} record was skipped")
    return out


def _device_peaks(r: _Records) -> None:
    """Each GPU's peak, its reading before the command started, and the command's own peak."""
    for i, d in enumerate(r.devices):
        points = r.series[d.nvml_index]
        mine = [b for (dev, _), b in r.command_bytes.items() if dev == d.nvml_index]
        d = dataclasses.replace(d, samples=len(points),
                                command_peak_bytes=max(mine) if mine else None)
        if points:
            t_peak, peak = max(points, key=lambda p: (p[1], -p[0]))
            before = [p for p in points if r.spawn_t is None or p[0] <= r.spawn_t]
            d = dataclasses.replace(d, peak_used_bytes=peak, peak_t_s=t_peak,
                                    baseline_used_bytes=(before[-1] if before else points[0])[1])
        r.devices[i] = d


def _memory_around_ooms(r: _Records) -> None:
    """Every GPU's last reading before each out-of-memory error and its peak in the
    :data:`OOM_WINDOW_S` before it."""
    cuda_of = {d.nvml_index: d.cuda_index for d in r.devices}
    for i, oom in enumerate(r.ooms):
        if oom.t_s is None:
            continue
        at, before = dict(oom.used_at_oom_bytes), dict(oom.peak_before_oom_bytes)
        for nvml_index, points in r.series.items():
            label = f"cuda:{cuda_of[nvml_index]}"
            prior = [p for p in points if p[0] <= oom.t_s]
            if prior:
                at[label] = prior[-1][1]
                window = [p[1] for p in prior if p[0] >= oom.t_s - OOM_WINDOW_S]
                before[label] = max(window or [prior[-1][1]])
        r.ooms[i] = dataclasses.replace(oom, used_at_oom_bytes=at, peak_before_oom_bytes=before)


def _scenario(name: str, watch: WatchResult, r: _Records) -> ScenarioResult:
    """The watched command as the one scenario of the result: every GPU's NVML timeline."""
    rc = watch.returncode
    status = STATUS_OOM if r.ooms else STATUS_OK if rc == 0 else STATUS_ERROR
    results = [
        DeviceResult(
            index=d.cuda_index, peak_allocated_bytes=d.peak_used_bytes or 0,
            capacity_bytes=d.total_bytes or 0, nvml_peak_used_bytes=d.peak_used_bytes,
            used=d.peak_used_bytes is not None,
            timeline=tuple(TimelinePoint(t=t, allocated_bytes=b)
                           for t, b in _downsample(r.series[d.nvml_index], REPORT_POINTS)),
        )
        for d in r.devices
    ]
    first_oom = r.ooms[0] if r.ooms else None
    return ScenarioResult(
        name=name, status=status, message=watch_ending(watch),
        devices=tuple(results), oom_device=first_oom.cuda_index if first_oom else None,
        oom_bytes=first_oom.requested_bytes if first_oom else None,
    )


ASSUMPTIONS = (
    "Memory is NVML's used memory of each whole GPU (every process, CUDA contexts "
    "included; nvmlDeviceGetMemoryInfo), read every {interval:g} s: a peak between two "
    "readings is missed, so each peak is a lower bound. In the tables it stands where other "
    "backends put the allocator's peak.",
    "The command's own memory is the sum over its processes (the child and its "
    "descendants) of nvmlDeviceGetComputeRunningProcesses' used memory; in a "
    "container without the host's PID namespace NVML reports other PIDs, and this "
    "stays empty.",
    "'GPU N' in PyTorch's out-of-memory message is a CUDA index of the command; it "
    "is mapped to a GPU through the CUDA_VISIBLE_DEVICES the command started with.",
)


def build_run(
    records: list[dict[str, Any]], *, samples_path: str = "", notes: Iterable[str] = ()
) -> RunResult:
    """Turn the records of a samples file into a :class:`RunResult` (pure)."""
    header = records[0]
    notes = list(notes)
    r = _read(records, notes)
    _device_peaks(r)
    _memory_around_ooms(r)
    devices = r.devices
    notes += [f"cuda:{d.cuda_index}: NVML sampling stopped early: {d.stopped_reason}"
              for d in devices if d.stopped_reason]
    command = [str(c) for c in header.get("command", [])]
    end = r.end
    watch = WatchResult(
        command=tuple(command), pid=r.pid, returncode=end.get("returncode") if end else None,
        exit_status=end.get("exit_status") if end else None,
        signal=end.get("signal") if end else None, complete=end is not None,
        started=str(header.get("started", "")), duration_s=round(r.last_t, 6),
        interval_s=float(header.get("interval_s", 0.0)), samples_path=samples_path,
        devices=tuple(devices), ooms=tuple(r.ooms), signals=tuple(r.signals),
    )
    name = scenario_name(command)
    scenario = _scenario(name, watch, r)
    # the one answer builder's (dpprof.answers.answer), stored for the JSON
    said, next_steps = post_mortem(watch)
    watch = dataclasses.replace(watch, post_mortem=tuple(said), next_steps=tuple(next_steps))
    totals = [d.total_bytes for d in devices if d.total_bytes]
    run = new_result(  # the watcher's version, time and host, from its samples file
        BACKEND, shlex.join(command), batch=0,
        gpus=max((d.cuda_index for d in devices), default=-1) + 1,
        gpu_memory_bytes=max(totals, default=0), scenarios=(scenario,),
        dpprof_version=str(header.get("dpprof_version", "")),
        created=watch.started,
        config={
            "command": command, "interval_s": watch.interval_s,
            "kill_after_s": header.get("kill_after_s"),
            "gpus": [d.cuda_index for d in devices],
        },
        environment={
            "hostname": header.get("hostname"), "driver_version": header.get("driver_version"),
            "cuda_visible_devices": header.get("cuda_visible_devices"),
            "gpus": [f"cuda:{d.cuda_index}: {d.name} {d.uuid}" for d in devices],
        },
        assumptions=(ASSUMPTIONS[0].format(interval=watch.interval_s), *ASSUMPTIONS[1:]),
        notes=tuple(dict.fromkeys([*header.get("notes", []), *notes])),
        watch=watch,
    )
    # the comparison and the one answer: the watch's verdict and post-mortem
    return settled(run)


def _known(tp: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(tp)}
    return {k: v for k, v in data.items() if k in names}

