"""What the virtual devices record: the event log (one allocation or free per event, in
int columns), each device's counters, the phases of a step and the snapshots read back
from the log (:mod:`dpprof.emulator.storage_ledger` writes them)."""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, overload

import numpy as np

# no event indices (a device that has had no event)
NO_EVENTS = np.zeros(0, dtype=np.int64)

ALLOC = "alloc"
FREE = "free"
# the caching allocator's own steps between events, as the replays' rows name them
EMPTY_CACHE = ("empty_cache", -1, 0)
RELEASE_POOL = "release_pool"
OWN_STEPS = (EMPTY_CACHE[0], RELEASE_POOL)  # the kinds of those rows


class KernelStep(NamedTuple):
    """One buffer a kernel allocates (:data:`ALLOC`, ``nbytes`` requested) or frees
    (:data:`FREE`) inside itself, by name."""

    kind: str
    name: str
    nbytes: int = 0


class KernelPlan(NamedTuple):
    """The buffers an op's kernel on the target GPU allocates and frees itself, around its
    output: ``before`` runs before the output is allocated, ``after`` after it. Every buffer
    allocated is freed by the end of ``after``."""

    before: tuple[KernelStep, ...]
    after: tuple[KernelStep, ...]


@dataclass
class DeviceCounters:
    live_requested: int = 0
    live_allocated: int = 0
    peak_requested: int = 0
    peak_allocated: int = 0
    peak_event: int = -1  # index into the event log where peak_allocated was reached
    peak_phase: str = ""


class Event(NamedTuple):
    """One allocation (+) or free (-) on a device (``HOST`` for host storages). A tuple:
    cheap to make, and of ints only, so the garbage collector stops scanning it."""

    device: int
    serial: int
    requested: int  # signed
    allocated: int  # signed, rounded


class EventLog(Sequence[Event]):
    """The runtime's events, one int column per field (appending makes no Python object
    per event); reads give :class:`Event` tuples.

    ``streams``: the stream of each allocation made while a stream other than its device's
    default was current (event index -> the stream's id), the few a program's side streams
    make (FSDP2's all-gathers and reduce-scatters); every other event is the default
    stream's (0). The caching allocator pools blocks per stream.

    ``marks``: what the caching allocator does between two events, each at the log's length
    when it happened, as the replays of the log play it (:data:`EMPTY_CACHE`:
    ``torch.cuda.empty_cache()``, every device's cached segments released;
    ``(RELEASE_POOL, pool id)``: the last graph using a private pool gone, its cached
    segments released at the next release of the cache)."""

    __slots__ = ("allocated", "device", "marks", "requested", "serial", "streams")

    def __init__(self) -> None:
        self.device = array("q")
        self.serial = array("q")
        self.requested = array("q")
        self.allocated = array("q")
        self.streams: dict[int, int] = {}
        self.marks: list[tuple[int, tuple[str, int, int]]] = []

    def add(self, device: int, serial: int, requested: int, allocated: int) -> None:
        try:
            self.device.append(device)
            self.serial.append(serial)
            self.requested.append(requested)
            self.allocated.append(allocated)
        except BaseException:
            self.drop_partial()
            raise

    def drop_partial(self) -> None:
        """An event whose columns were not all appended (a stop signal raises between any
        two bytecodes of the script's time) taken out again, by every path that appends
        (here and the ledger's inline ones): the columns stay aligned for readers and for
        the events after it (the frees of the interrupted script's tensors)."""
        n = len(self.allocated)
        for column in (self.device, self.serial, self.requested):
            del column[n:]

    def append(self, ev: Event) -> None:
        self.add(*ev)

    def __len__(self) -> int:
        return len(self.device)

    @overload
    def __getitem__(self, i: int) -> Event: ...

    @overload
    def __getitem__(self, i: slice) -> list[Event]: ...

    def __getitem__(self, i: int | slice) -> Event | list[Event]:
        if isinstance(i, slice):
            return list(map(Event, self.device[i], self.serial[i], self.requested[i],
                            self.allocated[i]))
        return Event(self.device[i], self.serial[i], self.requested[i], self.allocated[i])

    def __iter__(self) -> Iterator[Event]:
        return map(Event, self.device, self.serial, self.requested, self.allocated)

    def column(self, name: str) -> np.ndarray:
        """One field as an int64 array (a copy: the log may grow while it is in use);
        ``"stream"``: each event's stream (0: the default stream's)."""
        if name == "stream":
            n = len(self.device)
            out = np.zeros(n, dtype=np.int64)
            for i, stream in list(self.streams.items()):
                if i < n:
                    out[i] = stream
            return out
        return np.array(getattr(self, name), dtype=np.int64)

    def stream_of(self, i: int) -> int:
        """The stream of event ``i`` (0: the default stream)."""
        return self.streams.get(i, 0)

    def indices_by_device(self) -> dict[int, np.ndarray]:
        """Each device's event indices, in order."""
        dev = self.column("device")
        order = np.argsort(dev, kind="stable")
        devices, starts = np.unique(dev[order], return_index=True)
        if not len(devices):
            return {}
        ends = [*starts[1:].tolist(), len(order)]
        return {int(d): order[a:b] for d, a, b in zip(devices.tolist(), starts.tolist(), ends,
                                                      strict=True)}


@dataclass
class PhaseMark:
    event_index: int  # events before this index happened before the phase began
    name: str


@dataclass
class Snapshot:
    """Bytes per category live on one device at one event index."""

    allocated_bytes: int
    requested_bytes: int
    by_category: dict[str, int] = field(default_factory=dict)


@dataclass
class SteadyPeak:
    """A device's peak once a warm-up's transients are gone (the storages a real run keeps
    alive past the point where a later step frees them), and those alive at its peak."""

    allocated_bytes: int
    # kind -> bytes of transients alive at the device's (worst-case) peak
    transient_bytes: dict[str, int] = field(default_factory=dict)


class EventQueries:
    """Reading a runtime's log back: each device's events, snapshots, timelines (a base
    of :class:`dpprof.emulator.storage_ledger.StorageLedger`, whose attributes these are)."""

    events: EventLog
    counters: list[DeviceCounters]
    transients: dict[int, tuple[int, str]]
    _by_device: tuple[int, dict[str, np.ndarray], dict[int, np.ndarray]]

    def label_of(self, serial: int) -> str:
        """The category of storage ``serial``."""
        raise NotImplementedError

    def event_indices(self, index: int) -> list[int]:
        """Indices into :attr:`events` of device ``index``'s events."""
        return self._device_index_array(index).tolist()  # type: ignore[no-any-return]

    def _device_index_array(self, index: int) -> np.ndarray:
        """:meth:`event_indices` as an array."""
        return self._columns()[1].get(index, NO_EVENTS)

    def _columns(self) -> tuple[dict[str, np.ndarray], dict[int, np.ndarray]]:
        """The log's columns as arrays and each device's event indices (computed once per
        length of the log, for all devices in one pass)."""
        n = len(self.events)
        if self._by_device[0] != n:
            log = self.events
            cols = {k: log.column(k) for k in ("serial", "requested", "allocated")}
            self._by_device = (n, cols, log.indices_by_device())
        return self._by_device[1], self._by_device[2]

    def snapshot(self, index: int, event_index: int) -> Snapshot:
        """Bytes per (final) category live on device ``index`` before ``event_index``."""
        cols, by_device = self._columns()
        idx = by_device.get(index, NO_EVENTS)
        idx = idx[: int(np.searchsorted(idx, event_index))]
        if not len(idx):
            return Snapshot(0, 0, {})
        serials = cols["serial"][idx]
        # a storage is live when its last event (so far) is an allocation
        last_rev = np.unique(serials[::-1], return_index=True)[1]
        last = idx[len(idx) - 1 - last_rev]
        allocs, reqs = cols["allocated"][last], cols["requested"][last]
        keep = (allocs > 0) | (reqs > 0)
        by_cat: dict[str, int] = {}
        label_of = self.label_of
        for serial, a in zip(cols["serial"][last[keep]].tolist(),
                             allocs[keep].tolist(), strict=True):
            cat = label_of(serial)
            by_cat[cat] = by_cat.get(cat, 0) + a
        return Snapshot(int(allocs[keep].sum()), int(reqs[keep].sum()), by_cat)

    def peak_snapshot(self, index: int) -> Snapshot:
        return self.snapshot(index, self.counters[index].peak_event)

    def timeline(self, index: int, start: int = 0) -> list[tuple[int, int]]:
        """(event index, live allocated bytes) after every event on device ``index``."""
        at, live = self.timeline_arrays(index, start)
        return list(zip(at.tolist(), live.tolist(), strict=True))

    def timeline_arrays(self, index: int, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`timeline` as two arrays: event indices, live allocated bytes."""
        base = self.snapshot(index, start).allocated_bytes if start else 0
        cols, by_device = self._columns()
        idx = by_device.get(index, NO_EVENTS)
        idx = idx[int(np.searchsorted(idx, start)):]
        at = np.concatenate(([start], idx + 1))
        live = np.concatenate(([base], np.cumsum(cols["allocated"][idx]) + base))
        return at, live

    def transient_spans(self, index: int) -> list[tuple[int, int, int, str]]:
        """Device ``index``'s transients as (steady free, real free, allocated bytes, kind):
        each alive in the real run but dead in the steady state
        at positions (events processed) ``steady free`` to ``real free`` - 1 (the position
        of its free; past the log's end where it is still alive)."""
        if not self.transients:
            return []
        cols, by_device = self._columns()
        idx = by_device.get(index, NO_EVENTS)
        if not len(idx):
            return []
        serials = cols["serial"][idx]
        out = []
        for serial, (steady, kind) in self.transients.items():
            rows = idx[serials == serial]
            if not len(rows):
                continue
            alloc = rows[cols["allocated"][rows] > 0]
            free = rows[cols["allocated"][rows] < 0]
            if not len(alloc):
                continue
            end = int(free[-1]) + 1 if len(free) else len(self.events) + 1
            if end > steady:
                out.append((steady, end, int(cols["allocated"][alloc[0]]), kind))
        return out

    def steady_peak(self, index: int, start: int = 0) -> SteadyPeak | None:
        """Device ``index``'s peak from event ``start`` on with every transient freed where
        the steady state frees it, and the transients alive at its real peak (None: no
        transient was alive in the window)."""
        spans = [s for s in self.transient_spans(index) if s[1] > start]
        if not spans:
            return None
        at, live = self.timeline_arrays(index, start)
        steady = live.copy()
        c = self.counters[index]
        at_peak: dict[str, int] = {}
        for first, end, allocated, kind in spans:
            # alive here, dead in the steady state: positions first .. end - 1
            steady -= np.where((at >= first) & (at < end), allocated, 0)
            if first <= c.peak_event < end:
                at_peak[kind] = at_peak.get(kind, 0) + allocated
        if not at_peak:
            return None  # the peak is the steady state's
        return SteadyPeak(int(steady.max()), at_peak)
