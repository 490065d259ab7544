"""NVML's view of the devices a cuda-backend scenario runs on: :class:`NvmlWatch`, an
:class:`~dpprof.nvml.sampler.NvmlSampler` thread over every visible GPU, matched to CUDA
indices by UUID (:mod:`dpprof.nvml.devices`): the peak ``used``, the timeline with phase
markers, GPU utilisation, per-process usage, and the contexts a process holds on GPUs
that are not its own."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

from dpprof.nvml.devices import resolve_visible_devices
from dpprof.nvml.queries import NvmlBackend
from dpprof.nvml.sampler import NvmlSampler, Sample
from dpprof.result import DeviceResult, TimelinePoint
from dpprof.units import fmt_bytes

__all__ = ["TIMELINE_POINTS", "NvmlWatch"]

TIMELINE_POINTS = 400  # NVML points kept per device and scenario (maxima of equal slices)


class NvmlWatch:
    """An :class:`NvmlSampler` over every visible GPU, with CUDA index -> NVML index by UUID.

    ``cuda_uuids``: the UUID per CUDA index (default: what the CUDA runtime reports). When
    NVML or the UUIDs are unavailable, :attr:`reason` says why and nothing is sampled.
    ``others``: dpprof's own other processes (a DDP rank's parent: dpprof, which may hold a
    CUDA context on the rank's GPU from work it did before, e.g. a compare run earlier in
    the same process): their memory is not the measured process's, and a real job would
    not have it there, so each reading of the device's used memory is taken less what
    they held at that reading (NVML's per-process figures) and :meth:`notes` says how
    much; where NVML cannot tell per process (a container without the host's PIDs), the
    device's figure stands. A MIG
    device is sampled through its own NVML handle (the parent GPU's figures span every slice,
    and a user without root may not read them); ``nvml_index`` in the results stays the
    parent GPU's.
    """

    def __init__(
        self,
        nvml: NvmlBackend | None,
        interval_s: float,
        cuda_uuids: Sequence[str] | None,
        pids: Sequence[int] = (),
        env: dict[str, str] | None = None,
        others: Sequence[int] = (),
    ) -> None:
        self.nvml = nvml
        self.map: dict[int, int] = {}  # cuda index -> the NVML index sampled for it
        self.parents: dict[int, int] = {}  # cuda index -> the physical GPU's NVML index
        self.uuids: dict[int, str] = {}
        self.unsampled: dict[int, str] = {}  # cuda index -> why it is matched but not sampled
        self.reason: str | None = None
        self.sampler: NvmlSampler | None = None
        self.pids = list(pids)
        self.others = [p for p in others if p not in self.pids]
        self.left_out: dict[int, int] = {}  # cuda index -> the others' peak, left out
        if nvml is None:
            self.reason = "NVML not used on CPU devices"
            return
        status = nvml.status()
        if not status.available:
            self.reason = f"NVML not available: {status.reason}"
            return
        if cuda_uuids is None:
            self.reason = "the CUDA runtime reports no device UUIDs"
            return
        found = resolve_visible_devices(nvml, env, list(cuda_uuids))
        for dev in found.devices:
            if dev.nvml_index is None:
                continue
            self.parents[dev.cuda_index] = dev.nvml_index
            if dev.uuid:
                self.uuids[dev.cuda_index] = dev.uuid
            if dev.sample_index is None:
                self.unsampled[dev.cuda_index] = (
                    f"MIG device {dev.uuid}: NVML cannot address it on its own here, and the "
                    "parent GPU's figures would span every MIG slice")
            else:
                self.map[dev.cuda_index] = dev.sample_index
        if not self.map:
            self.reason = next(iter(self.unsampled.values()), None) or (
                "no CUDA device could be matched to an NVML device by UUID")
            return
        self.sampler = NvmlSampler(
            nvml, sorted(set(self.map.values())), interval_s,
            pids=(self.pids + self.others) or None,
        )

    def __enter__(self) -> NvmlWatch:
        if self.sampler is not None:
            self.sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.sampler is not None:
            self.sampler.stop()

    def mark(self, name: str) -> None:
        if self.sampler is not None:
            self.sampler.mark(name)

    def fill(self, dev: DeviceResult, cuda_index: int) -> DeviceResult:
        """``dev`` with NVML's view of ``cuda_index`` (or the reason it is missing)."""
        nvml_index = self.map.get(cuda_index)
        found: dict[str, Any] = {"uuid": self.uuids.get(cuda_index),
                                 "nvml_index": self.parents.get(cuda_index)}
        if self.sampler is None or nvml_index is None:
            return dataclasses.replace(
                dev, **found, nvml_reason=self.unsampled.get(cuda_index) or self.reason or (
                    f"cuda:{cuda_index} not matched to an NVML device"))
        s = self.sampler
        samples = [x for x in s.samples if x.device == nvml_index]
        peak = s.peak_used_bytes(nvml_index)
        if self.others and samples:
            samples = self._without_others(samples, nvml_index, cuda_index)
            peak = max(x.used_bytes for x in samples)
        found["nvml_peak_used_bytes"] = peak
        if peak is None:
            found["nvml_reason"] = s.errors.get(nvml_index, "no NVML sample was taken")
        elif dev.peak_reserved_bytes is not None:
            found["nvml_unexplained_bytes"] = peak - dev.peak_reserved_bytes
        if samples:
            found["nvml_baseline_used_bytes"] = samples[0].used_bytes
        utils = [x.util_percent for x in samples if x.util_percent is not None]
        if utils:
            found["gpu_utilization_mean_percent"] = float(statistics.fmean(utils))
            found["gpu_utilization_max_percent"] = int(max(utils))
        markers = s.markers
        points = []
        for x in samples:
            phase = ""
            for m in markers:
                if m.t_s <= x.t_s:
                    phase = m.name
                else:
                    break
            points.append(TimelinePoint(x.t_s, x.used_bytes, phase))
        found["timeline"] = tuple(_thin(points))
        processes = dict(dev.process_used_bytes)
        for pid in self.pids + self.others:
            used = s.peak_process_bytes(nvml_index, pid)
            if used is not None:
                processes[str(pid)] = used
        return dataclasses.replace(dev, **found, process_used_bytes=processes)

    def _without_others(self, samples: list[Sample], nvml_index: int,
                        cuda_index: int) -> list[Sample]:
        """Each reading less what :attr:`others` held at it (read in the same tick)."""
        s = self.sampler
        assert s is not None
        held: dict[float, int] = {}
        for p in s.process_samples:
            if p.device == nvml_index and p.pid in self.others and p.used_bytes:
                held[p.t_s] = held.get(p.t_s, 0) + p.used_bytes
        if held:
            self.left_out[cuda_index] = max(held.values())
        return [x._replace(used_bytes=x.used_bytes - held.get(x.t_s, 0)) for x in samples]

    def foreign_pids(self, cuda_indices: Sequence[int]) -> bool:
        """Whether NVML listed processes on these GPUs (where this process worked) but never
        this process's PIDs: it reports the PIDs of another PID namespace (a container run
        without the host's), so per-process usage and stray contexts cannot be seen."""
        if self.sampler is None or not self.pids:
            return False
        devices = {self.map[c] for c in cuda_indices if c in self.map}
        listed = {d for d in devices if self.sampler.listed_processes(d)}
        return bool(listed) and not any(
            self.sampler.listed_pid(d, pid) for d in listed for pid in self.pids)

    def notes(self, cuda_indices: Sequence[int]) -> list[str]:
        """What the sampler could not read, per CUDA device, for the scenario's notes."""
        if self.sampler is None:
            return []
        s = self.sampler
        back = {v: k for k, v in self.map.items()}
        found: list[str] = []
        for device, texts in sorted(s.notes.items()):
            where = f"cuda:{back[device]}" if device in back else "NVML"
            found.extend(f"NVML on {where}: {t}" for t in texts)
        if s.thread_error:
            found.append(f"the NVML sampler stopped: {s.thread_error}")
        for cuda in cuda_indices:
            if self.left_out.get(cuda):
                found.append(
                    f"NVML on cuda:{cuda}: dpprof's own process (pid "
                    f"{', '.join(map(str, self.others))}) held up to "
                    f"{fmt_bytes(self.left_out[cuda])} there (its CUDA context from earlier "
                    "work); left out of the used memory reported, as a job of your own "
                    "would not have it")
        if self.foreign_pids(cuda_indices):
            found.append(
                "NVML lists processes on the GPUs but never dpprof's own: it reports the PIDs "
                "of another PID namespace (a container without the host's, e.g. docker run "
                "without --pid=host), so per-process usage and CUDA contexts on the wrong GPU "
                "cannot be seen here")
        return found

    def contexts_of(self, pid: int) -> dict[int, int]:
        """CUDA index -> peak used bytes of every GPU where ``pid`` held memory.

        An entry of 0 bytes is not a context: with peer access (NVLink, P2P over PCIe) NVML
        lists every process that mapped a GPU's memory on that GPU with 0 bytes, so each DDP
        rank shows up on every peer's GPU. An entry whose usage the driver cannot tell
        (None) proves nothing either way and is left out too.
        """
        if self.sampler is None:
            return {}
        back = {v: k for k, v in self.map.items()}
        found: dict[int, int] = {}
        for p in self.sampler.process_samples:
            if p.pid == pid and p.device in back and p.used_bytes:
                cuda = back[p.device]
                found[cuda] = max(found.get(cuda, 0), p.used_bytes)
        return found


def _thin(points: list[TimelinePoint]) -> list[TimelinePoint]:
    if len(points) <= TIMELINE_POINTS:
        return points
    step = len(points) / TIMELINE_POINTS
    kept = []
    for k in range(TIMELINE_POINTS):
        chunk = points[int(k * step) : int((k + 1) * step) or None]
        if chunk:
            kept.append(max(chunk, key=lambda p: p.allocated_bytes))
    return kept
