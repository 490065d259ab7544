"""A background thread that samples GPU memory through NVML: the timeline behind each report.

:class:`NvmlSampler` asks an :class:`~dpprof.nvml.queries.NvmlBackend` every ``interval_s`` seconds
(default 0.02 s) for each device's used memory (``nvmlDeviceGetMemoryInfo``), and optionally
its utilisation and the used memory of given processes, and keeps the readings as
:class:`Sample` tuples ``(t_s, device, used_bytes, util_percent)``. ``t_s`` is seconds since
the sampler was created, on its clock. Phase markers (:meth:`NvmlSampler.mark`) put the
runner's phases (warm-up, step 3, ...) on the same time axis.

NVML's "used" is what the driver has handed out on that GPU: every process's CUDA context,
the caching allocator's reserved segments, NCCL buffers, and other users of the GPU. It is
therefore at least ``torch.cuda.memory_reserved`` of our process, and sampling can miss a
short peak between two readings: :meth:`NvmlSampler.peak_used_bytes` is a lower bound of the
true peak.

The clock and the sleep are injectable, so tests drive the sampler deterministically; by
default they are ``time.monotonic`` and an interruptible wait. The thread never raises: an
NVML error on one device stops that device's sampling and records why
(:attr:`NvmlSampler.errors`); a failing sink is dropped and its error kept in
:attr:`NvmlSampler.sink_error`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, NamedTuple

from dpprof.nvml.queries import NvmlBackend

__all__ = [
    "DeviceStopped",
    "Event",
    "JsonlSink",
    "Marker",
    "NvmlSampler",
    "ProcessSample",
    "Sample",
    "event_to_dict",
]


class Sample(NamedTuple):
    """One reading of one device: seconds since start, NVML index, used bytes, GPU util %."""

    t_s: float
    device: int
    used_bytes: int
    util_percent: int | None


class ProcessSample(NamedTuple):
    """The used memory of one process on one device (None: the driver cannot tell)."""

    t_s: float
    device: int
    pid: int
    used_bytes: int | None


class Marker(NamedTuple):
    """The start of a phase, on the sampler's time axis."""

    t_s: float
    name: str


class DeviceStopped(NamedTuple):
    """Sampling of a device ended because a query failed."""

    t_s: float
    device: int
    reason: str


Event = Sample | ProcessSample | Marker | DeviceStopped
Sink = Callable[[Event], None]

_KIND = {
    Sample: "sample",
    ProcessSample: "process",
    Marker: "mark",
    DeviceStopped: "stopped",
}


def event_to_dict(event: Event) -> dict[str, Any]:
    """A sampler event as a JSON-ready dict with a ``kind`` field (sample, process, mark, ...)."""
    return {"kind": _KIND[type(event)], **event._asdict()}


class JsonlSink:
    """Appends each event to ``path`` as one JSON line and flushes at once (``dpprof watch``).

    Thread-safe; opens the file on the first event (creating parent folders), so a run that
    records nothing leaves no file. Use as a context manager or call :meth:`close`.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = None
        self._lock = threading.Lock()
        self.lines = 0

    def __call__(self, event: Event) -> None:
        line = json.dumps(event_to_dict(event), separators=(",", ":"))
        with self._lock:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self.path.open("a", encoding="utf-8")
            self._file.write(line + "\n")
            self._file.flush()
            self.lines += 1

    def close(self) -> None:
        """Close the file (a later event reopens it in append mode)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> JsonlSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NvmlSampler:
    """Samples used memory per device on a background thread.

    ``devices``: NVML indices (map CUDA indices with :mod:`dpprof.nvml.devices`). ``utilization``:
    also read ``nvmlDeviceGetUtilizationRates`` (a device that does not support it gets
    ``util_percent=None`` from then on). ``pids``: PIDs (or a callable returning them, asked
    at every tick) whose per-process used memory to record from
    ``nvmlDeviceGetComputeRunningProcesses``; None records none. ``sink``: called with every
    event (sample, process sample, marker, device stop) as it happens. ``keep_samples=False``
    keeps only the running peaks in memory (for long ``watch`` runs that stream to a sink).
    """

    def __init__(
        self,
        nvml: NvmlBackend,
        devices: Sequence[int],
        interval_s: float = 0.02,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Any] | None = None,
        utilization: bool = True,
        pids: Iterable[int] | Callable[[], Iterable[int]] | None = None,
        sink: Sink | None = None,
        keep_samples: bool = True,
        name: str = "dpprof-nvml-sampler",
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.nvml = nvml
        self.devices = list(devices)
        self.interval_s = float(interval_s)
        self._clock = clock
        self._stop_event = threading.Event()
        self._sleep = sleep if sleep is not None else self._stop_event.wait
        self._want_util = utilization
        self._pids = pids if callable(pids) or pids is None else frozenset(pids)
        self._sink = sink
        self._keep = keep_samples
        self._name = name
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.t0 = clock()

        self._samples: list[Sample] = []
        self._process_samples: list[ProcessSample] = []
        self._markers: list[Marker] = []
        self._marker_pos: list[int] = []  # len(self._samples) when each marker was set
        self._peak: dict[int, int] = {}
        self._process_peak: dict[tuple[int, int], int] = {}
        self._count: dict[int, int] = dict.fromkeys(self.devices, 0)
        self._active: list[int] = list(self.devices)
        self._util_off: set[int] = set() if utilization else set(self.devices)
        self._process_off: set[int] = set()
        self._listed: dict[int, set[int]] = {}  # device -> every PID NVML listed on it
        self.errors: dict[int, str] = {}
        """Device -> why its sampling stopped."""
        self.notes: dict[int, list[str]] = {}
        """Device -> lesser problems (no utilisation, no per-process memory); -1: not tied to
        a device."""
        self.sink_error: str | None = None
        self.thread_error: str | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> NvmlSampler:
        """Start the thread (daemon; at most once)."""
        if self._thread is not None:
            raise RuntimeError("this sampler was already started")
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        """Ask the thread to finish (it takes one last reading) and wait for it."""
        self._stop_event.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def running(self) -> bool:
        """Whether the thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> NvmlSampler:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            next_t = self._clock()
            while not self._stop_event.is_set():
                self.sample_once()
                if not self._active:
                    return
                next_t += self.interval_s
                delay = next_t - self._clock()
                if delay < 0:  # fell behind (slow NVML): do not try to catch up
                    next_t = self._clock()
                    delay = 0.0
                self._sleep(delay)
            if self._active:
                self.sample_once()  # the state at the end of the workload
        except BaseException as exc:  # never let the thread die with a traceback
            self.thread_error = f"{type(exc).__name__}: {exc}"

    # -- sampling --------------------------------------------------------------------------

    def now(self) -> float:
        """Seconds since the sampler was created, on its clock."""
        return self._clock() - self.t0

    def sample_once(self) -> list[Event]:
        """Read every active device once (the thread's tick; callable directly in tests)."""
        events: list[Event] = []
        pids = self._current_pids()
        for device in list(self._active):
            try:
                events.extend(self._sample_device(device, pids))
            except Exception as exc:  # a backend that raises after all
                events.append(self._stop_device(device, f"{type(exc).__name__}: {exc}"))
        for event in events:
            self._emit(event)
        return events

    def _current_pids(self) -> frozenset[int] | None:
        if self._pids is None:
            return None
        if isinstance(self._pids, frozenset):
            return self._pids
        try:
            return frozenset(int(p) for p in self._pids())
        except Exception as exc:
            if -1 not in self.notes:
                self._note(-1, f"the pids callable failed: {type(exc).__name__}: {exc}")
            return frozenset()

    def _sample_device(self, device: int, pids: frozenset[int] | None) -> list[Event]:
        mem = self.nvml.memory(device)
        t = self.now()
        if mem is None:
            reason = self.nvml.reason("memory", device) or "memory query returned nothing"
            return [self._stop_device(device, reason)]
        util: int | None = None
        if device not in self._util_off:
            rates = self.nvml.utilization(device)
            if rates is None:
                self._util_off.add(device)
                why = self.nvml.reason("utilization", device) or "not available"
                self._note(device, f"utilization: {why}")
            else:
                util = rates.gpu
        events: list[Event] = [Sample(t, device, mem.used, util)]
        if pids is not None and device not in self._process_off:
            procs = self.nvml.processes(device)
            if procs is None:
                self._process_off.add(device)
                why = self.nvml.reason("processes", device) or "not available"
                self._note(device, f"per-process memory: {why}")
            else:
                with self._lock:
                    self._listed.setdefault(device, set()).update(p.pid for p in procs)
                events.extend(
                    ProcessSample(t, device, p.pid, p.used_bytes) for p in procs if p.pid in pids
                )
        with self._lock:
            for event in events:
                if isinstance(event, Sample):
                    self._count[device] = self._count.get(device, 0) + 1
                    if event.used_bytes > self._peak.get(device, -1):
                        self._peak[device] = event.used_bytes
                    if self._keep:
                        self._samples.append(event)
                elif isinstance(event, ProcessSample):
                    key = (device, event.pid)
                    used = event.used_bytes
                    if used is not None and used > self._process_peak.get(key, -1):
                        self._process_peak[key] = used
                    if self._keep:
                        self._process_samples.append(event)
        return events

    def _stop_device(self, device: int, reason: str) -> DeviceStopped:
        with self._lock:
            if device in self._active:
                self._active.remove(device)
            self.errors[device] = reason
        return DeviceStopped(self.now(), device, reason)

    def _note(self, device: int, text: str) -> None:
        with self._lock:
            self.notes.setdefault(device, []).append(text)

    def _emit(self, event: Event) -> None:
        sink = self._sink
        if sink is None:
            return
        try:
            sink(event)
        except Exception as exc:
            self._sink = None
            self.sink_error = f"{type(exc).__name__}: {exc}"

    def mark(self, name: str) -> Marker:
        """Record the start of phase ``name`` now (thread-safe; goes to the sink too)."""
        marker = Marker(self.now(), str(name))
        with self._lock:
            self._markers.append(marker)
            self._marker_pos.append(len(self._samples))
        self._emit(marker)
        return marker

    # -- results ---------------------------------------------------------------------------

    @property
    def samples(self) -> list[Sample]:
        """A copy of every sample so far, in time order."""
        with self._lock:
            return list(self._samples)

    @property
    def process_samples(self) -> list[ProcessSample]:
        """A copy of every per-process sample so far."""
        with self._lock:
            return list(self._process_samples)

    @property
    def markers(self) -> list[Marker]:
        """A copy of the phase markers so far."""
        with self._lock:
            return list(self._markers)

    @property
    def active_devices(self) -> list[int]:
        """Devices still being sampled."""
        with self._lock:
            return list(self._active)

    def sample_count(self, device: int) -> int:
        """How many readings of ``device`` were taken."""
        with self._lock:
            return self._count.get(device, 0)

    def peak_used_bytes(self, device: int) -> int | None:
        """Highest used memory seen on ``device`` (a lower bound of the true peak); None if
        it was never read."""
        with self._lock:
            return self._peak.get(device)

    def peak_process_bytes(self, device: int, pid: int) -> int | None:
        """Highest used memory of process ``pid`` on ``device``; None if never known."""
        with self._lock:
            return self._process_peak.get((device, pid))

    def listed_processes(self, device: int) -> int:
        """How many distinct PIDs NVML listed on ``device`` (any process, wanted or not)."""
        with self._lock:
            return len(self._listed.get(device, ()))

    def listed_pid(self, device: int, pid: int) -> bool:
        """Whether NVML ever listed ``pid`` on ``device``."""
        with self._lock:
            return pid in self._listed.get(device, ())

    def timeline(self, device: int) -> list[tuple[float, int]]:
        """``(t_s, used_bytes)`` of one device, in time order."""
        return [(s.t_s, s.used_bytes) for s in self.samples if s.device == device]

    def peaks_by_phase(self) -> dict[str, dict[int, int]]:
        """Phase name -> device -> peak used bytes within that phase.

        A phase runs from its marker to the next one (by the order in which readings and
        markers happened, so a reading taken at the same clock time just before a marker
        still counts for the phase before); readings before the first marker go under
        ``""``. A phase marked twice merges its intervals. Needs ``keep_samples``.
        """
        with self._lock:
            samples = list(self._samples)
            bounds = list(zip(self._marker_pos, self._markers, strict=True))
        result: dict[str, dict[int, int]] = {}
        k = -1
        for position, sample in enumerate(samples):
            while k + 1 < len(bounds) and bounds[k + 1][0] <= position:
                k += 1
            phase = bounds[k][1].name if k >= 0 else ""
            peaks = result.setdefault(phase, {})
            if sample.used_bytes > peaks.get(sample.device, -1):
                peaks[sample.device] = sample.used_bytes
        return result
