"""The virtual-device runtime: GPUs that exist only as byte counters.

A :class:`VirtualDevices` is a ``TorchDispatchMode``. Under it, every tensor storage that an
aten op creates is placed on a *virtual device* and counted there until it dies:

* an op's new storages live on the device of its tensor inputs (0-dim host tensors are
  ignored, as CUDA ignores CPU scalars); inputs on two devices are an error, as on GPUs;
  ops with no tensor inputs (factories) take the current device (:meth:`device`, like
  ``torch.cuda.device``);
* crossing devices is explicit: :meth:`to` is an autograd function whose forward copies to
  the target device and whose backward copies the gradient back;
* storages are tracked by weak reference, so a free is seen when the last tensor (or view)
  of a storage dies; both the requested bytes and the bytes as the CUDA caching allocator
  rounds them (multiples of 512 B) are counted;
* each storage is filed under a category (see ``dpprof.result.CATEGORIES``), from the
  current :meth:`category` at allocation, or later by :meth:`label` (e.g. a gradient that
  became a parameter's ``.grad``). The breakdown at a peak uses each storage's final label.

The tensors themselves are meta tensors (memory only, any size, no arithmetic) or CPU
tensors (real numbers, for checks). The device index :data:`HOST` stands for the host.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import threading
import weakref
from array import array
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, NamedTuple, overload

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dpprof.emulator.allocator import block_bytes
from dpprof.emulator.index_dtypes import RULES as CUDA_INDEX_RULES
from dpprof.emulator.index_dtypes import as_on_cuda

HOST = -1

aten = torch.ops.aten

# Ops that legitimately read one device and write another (a copy between GPUs).
_CROSS_DEVICE_OK = {
    aten.copy_.default,
    aten._to_copy.default,
    aten.copy.default,
}


ALLOC = "alloc"
FREE = "free"


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


class VirtualDeviceError(RuntimeError):
    """The program did something a real GPU would refuse (tensors on two devices)."""


@dataclass(slots=True)
class _Storage:
    serial: int
    device: int
    requested: int
    rounded: int


class _StorageRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a tracked storage that knows its key (one callback for all)."""

    __slots__ = ("key",)
    key: int


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
    per event); reads give :class:`Event` tuples."""

    __slots__ = ("allocated", "device", "requested", "serial")

    def __init__(self) -> None:
        self.device = array("q")
        self.serial = array("q")
        self.requested = array("q")
        self.allocated = array("q")

    def add(self, device: int, serial: int, requested: int, allocated: int) -> None:
        self.device.append(device)
        self.serial.append(serial)
        self.requested.append(requested)
        self.allocated.append(allocated)

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
        """One field as an int64 array (a copy: the log may grow while it is in use)."""
        return np.array(getattr(self, name), dtype=np.int64)

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
class _State:
    category: str = "activations"
    device: int = HOST
    forced: int | None = None  # place every new storage here (copies between devices)
    allow_cross: bool = False
    phase: str = ""


@dataclass
class Snapshot:
    """Bytes per category live on one device at one event index."""

    allocated_bytes: int
    requested_bytes: int
    by_category: dict[str, int] = field(default_factory=dict)


class VariantLedger:
    """One device's allocations as a variant of the program would make them, where the
    variant differs only in when some storages die: every event of the device counts,
    except a storage's once it is :meth:`detach`-ed (its bytes stay until
    :meth:`release`) or :meth:`release`-d. DDP's ``gradient_as_bucket_view`` is such a
    variant of plain DDP (:class:`dpprof.emulator.ddp.BucketViewFollower`): a
    gradient dies into its bucket's view at its hook, the old buckets live on in the
    gradients at the rebuild.

    ``unsure`` says why the variant could not be followed (a storage shared with
    something the ledger cannot see); the variant must then be emulated on its own.
    """

    def __init__(self) -> None:
        self.live_allocated = self.live_requested = 0
        self.peak_allocated = self.peak_requested = 0
        self.unsure: str | None = None
        # serial -> the bytes a storage that no longer follows its events still holds
        self._detached: dict[int, tuple[int, int]] = {}

    def on_event(self, serial: int, requested: int, allocated: int) -> None:
        if serial not in self._detached:
            self._add(requested, allocated)

    def _add(self, requested: int, allocated: int) -> None:
        self.live_requested += requested
        self.live_allocated += allocated
        self.peak_allocated = max(self.peak_allocated, self.live_allocated)
        self.peak_requested = max(self.peak_requested, self.live_requested)

    def reset_peaks(self) -> None:
        self.peak_allocated, self.peak_requested = self.live_allocated, self.live_requested

    def detach(self, serial: int, requested: int, allocated: int) -> None:
        """The storage (of these bytes) no longer follows its own events; its bytes stay."""
        self._detached.setdefault(serial, (requested, allocated))

    def release(self, serial: int, requested: int = 0, allocated: int = 0) -> None:
        """The storage dies now in the variant: the bytes it held when detached, else
        these (its own, live); its later events do not count."""
        r, a = self._detached.get(serial, (requested, allocated))
        self._detached[serial] = (0, 0)
        self._add(-r, -a)


class VirtualDevices(TorchDispatchMode):
    """Count live bytes per virtual device for everything run under it.

    ``base`` is the real device the tensors live on: ``"meta"`` (memory only) or ``"cpu"``.
    """

    def __init__(self, num_devices: int, base: str = "meta") -> None:
        super().__init__()
        if num_devices < 1:
            raise ValueError("num_devices must be at least 1")
        self.num_devices = num_devices
        self.base = torch.device(base)
        self.counters = [DeviceCounters() for _ in range(num_devices)]
        self.events = EventLog()
        self.phases: list[PhaseMark] = []
        self._labels: dict[int, str] = {}  # serial -> category (the latest label wins)
        self._storages: dict[int, _Storage] = {}  # id(storage object) -> record
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._serial = 0
        self._state = _State()
        self._lock = threading.RLock()
        self._measuring_since = 0
        self.host_requested = 0
        self._meta = self.base.type == "meta"
        self._last_device: int | None = None  # of the last op with device tensor inputs
        # Meta kernels are mostly Python (torch._refs): the same op on the same shapes is
        # run once and its outputs' metadata replayed (fresh storages only, see _run). The
        # memo is a pure function of metadata, so every runtime shares it (a comparison's
        # scenarios and fixes run the same ops on the same shapes).
        self._op_cache = _OP_CACHE
        self.cache_hits = 0
        self._by_device: tuple[int, dict[str, np.ndarray], dict[int, np.ndarray]] = (-1, {}, {})
        # DataParallel replicas on equal shards: one runs, the devices of the others
        # mirror its device event for event (:meth:`set_mirrors`), over meta tensors only.
        self.dedupe_replicas = False
        self.dedupe_failure: str | None = None  # why mirroring could not stand for a replica
        self.mirrored_replicas = 0  # replica forwards stood for by a mirror, not run
        self._mirrors: dict[int, tuple[int, ...]] = {}  # device -> the devices mirroring it
        self._own: frozenset[int] = frozenset()  # mirrors with events of their own too
        self._unmirrored: frozenset[int] = frozenset()  # mirrors new storages skip for now
        self._on_free_calls: dict[int, list[Callable[[], None]]] = {}  # serial -> callbacks
        # serial -> (its mirrors' serials, their devices), for its later events
        self._mirror_serials: dict[int, tuple[array[int], array[int]]] = {}
        # the blocks of mirrors' serials: their first serials (ascending), (length, the
        # mirrored storage's serial)
        self._mirror_firsts: list[int] = []
        self._mirror_blocks: list[tuple[int, int]] = []
        self._device_columns: dict[tuple[int, ...], array[int]] = {}  # kept: ids are keys
        self._distinct_counters: dict[int, list[DeviceCounters]] = {}
        self._fills: dict[tuple[int, int], array[int]] = {}
        # ops whose kernel on the target GPU allocates buffers of its own that the meta
        # kernel does not (dpprof.emulator.kernels): op -> its plan for the op's arguments
        self.kernel_plans: dict[Any, Callable[[Any, dict[str, Any]], KernelPlan | None]] = {}
        self.ledgers: dict[int, VariantLedger] = {}  # device -> a variant of its allocations

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps __torch_dispatch__ in dynamo's disable (about 8 us per op)
        # unless a mode opts out; nothing here is ever compiled.
        return False

    # ---- contexts ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _set(self, **changes: Any) -> Iterator[None]:
        old = {k: getattr(self._state, k) for k in changes}
        for k, v in changes.items():
            setattr(self._state, k, v)
        try:
            yield
        finally:
            for k, v in old.items():
                setattr(self._state, k, v)

    def device(self, index: int) -> contextlib.AbstractContextManager[None]:
        """Factory ops (no tensor inputs) place their storage on ``index``."""
        self._check_index(index)
        return self._set(device=index)

    def category(self, name: str) -> contextlib.AbstractContextManager[None]:
        """New storages are filed under ``name`` until the context ends."""
        return self._set(category=name)

    def placing_on(self, index: int) -> contextlib.AbstractContextManager[None]:
        """Every new storage goes to ``index``, whatever the inputs (a copy's target)."""
        self._check_index(index)
        return self._set(forced=index, allow_cross=True)

    def cross_device(self) -> contextlib.AbstractContextManager[None]:
        """Allow ops that read several devices (a reduction written by a collective)."""
        return self._set(allow_cross=True)

    @contextlib.contextmanager
    def phase(
        self, name: str, category: str | None = None, device: int | None = None
    ) -> Iterator[None]:
        """Mark a phase of the step (shown on timelines); optionally its default category
        and current device."""
        self.phases.append(PhaseMark(len(self.events), name))
        changes: dict[str, Any] = {"phase": name}
        if category is not None:
            changes["category"] = category
        if device is not None:
            self._check_index(device)
            changes["device"] = device
        with self._set(**changes):
            yield

    def _set_category(self, name: str) -> None:
        """Switch the category without a context (autograd hooks switch it back)."""
        self._state.category = name

    @property
    def current_device(self) -> int:
        return self._state.device

    @property
    def current_category(self) -> str:
        return self._state.category

    def _check_index(self, index: int) -> None:
        if index != HOST and not 0 <= index < self.num_devices:
            raise VirtualDeviceError(
                f"virtual device {index} does not exist (have {self.num_devices})"
            )

    # ---- queries ----------------------------------------------------------------------

    def device_of(self, t: torch.Tensor) -> int:
        """The virtual device of ``t``'s storage (HOST for storages made outside the mode)."""
        rec = self._storages.get(id(t.untyped_storage()))
        return HOST if rec is None else rec.device

    def label(self, tensors: Any, category: str) -> None:
        """File the storages of ``tensors`` (a tensor or an iterable) under ``category``."""
        if isinstance(tensors, torch.Tensor):
            tensors = (tensors,)
        for t in tensors:
            if t is None:
                continue
            rec = self._storages.get(id(t.untyped_storage()))
            if rec is not None:
                self._labels[rec.serial] = category

    def live_storages(self, index: int) -> list[tuple[int, str]]:
        """(serial, category) of every storage live on device ``index``, oldest first."""
        return sorted((rec.serial, self._labels.get(rec.serial, "other"))
                      for rec in self._storages.values() if rec.device == index)

    def rehome(self, serials: Collection[int], index: int) -> None:
        """Storages (by serial, none of them mirrored) move to device ``index`` in the
        accounting: freed where they were, allocated there, and their later events
        there. (The step after ``dp-loss-primary``'s, run as
        ``DataParallel(output_device=index)``: the loop's leftovers live there.)"""
        self._check_index(index)
        self.set_mirrors({})  # no shared counters while bytes move
        for rec in list(self._storages.values()):
            if rec.serial in serials and rec.device != index:
                if rec.serial in self._mirror_serials:
                    raise ValueError(f"storage {rec.serial} is mirrored: it cannot move")
                self._account(rec, -1)
                rec.device = index
                self._account(rec, +1)

    def serial_of(self, t: torch.Tensor) -> int | None:
        """The serial of ``t``'s storage, if it is tracked."""
        rec = self._storages.get(id(t.untyped_storage()))
        return None if rec is None else rec.serial

    def bytes_of(self, t: torch.Tensor) -> tuple[int, int]:
        """(requested, allocated) bytes of ``t``'s storage as counted (0, 0 untracked)."""
        rec = self._storages.get(id(t.untyped_storage()))
        return (0, 0) if rec is None else (rec.requested, rec.rounded)

    def live_bytes(self, index: int) -> int:
        return self.counters[index].live_allocated

    def reset_peaks(self) -> None:
        """Start a measurement: peaks restart from what is resident now."""
        with self._lock:
            self._measuring_since = len(self.events)
            for c in self.counters:
                c.peak_allocated = c.live_allocated
                c.peak_requested = c.live_requested
                c.peak_event = len(self.events)
                c.peak_phase = self._state.phase
            for ledger in self.ledgers.values():
                ledger.reset_peaks()

    def event_indices(self, index: int) -> list[int]:
        """Indices into :attr:`events` of device ``index``'s events."""
        return self._device_index_array(index).tolist()  # type: ignore[no-any-return]

    def _device_index_array(self, index: int) -> np.ndarray:
        """:meth:`event_indices` as an array."""
        return self._columns()[1].get(index, _NO_INDICES)

    def _columns(self) -> tuple[dict[str, np.ndarray], dict[int, np.ndarray]]:
        """The log's columns as arrays and each device's event indices (computed once per
        length of the log, for all devices in one pass)."""
        n = len(self.events)
        if self._by_device[0] != n:
            log = self.events
            cols = {k: log.column(k) for k in ("serial", "requested", "allocated")}
            self._by_device = (n, cols, log.indices_by_device())
        return self._by_device[1], self._by_device[2]

    def mirror_shift(self, index: int, of: int) -> int | None:
        """How many events after each of device ``of``'s events device ``index`` has the
        same event, when every event of ``index`` is one of ``of``'s so placed (a mirror
        of it, :meth:`set_mirrors`); None otherwise. Such a device's figures are
        ``of``'s, its timeline ``of``'s shifted by that many events."""
        cols, by_device = self._columns()
        mine, theirs = by_device.get(index, _NO_INDICES), by_device.get(of, _NO_INDICES)
        if len(mine) != len(theirs) or not len(mine):
            return None
        shift = int(mine[0] - theirs[0])
        if shift <= 0 or not np.array_equal(mine - theirs, np.full(len(mine), shift)):
            return None
        for name in ("requested", "allocated"):
            if not np.array_equal(cols[name][mine], cols[name][theirs]):
                return None
        return shift

    def mirrored_device(self, index: int) -> int | None:
        """The device ``index`` mirrors now (:meth:`set_mirrors`), if any."""
        for d, ms in self._mirrors.items():
            if index in ms:
                return d
        return None

    def snapshot(self, index: int, event_index: int) -> Snapshot:
        """Bytes per (final) category live on device ``index`` before ``event_index``."""
        cols, by_device = self._columns()
        idx = by_device.get(index, _NO_INDICES)
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
        idx = by_device.get(index, _NO_INDICES)
        idx = idx[int(np.searchsorted(idx, start)):]
        at = np.concatenate(([start], idx + 1))
        live = np.concatenate(([base], np.cumsum(cols["allocated"][idx]) + base))
        return at, live

    # ---- tracking ---------------------------------------------------------------------

    def _track(self, st: Any, device: int) -> None:
        requested = int(st.nbytes())
        self._serial += 1
        serial = self._serial
        rounded = block_bytes(requested)
        key = id(st)
        self._storages[key] = _Storage(serial, device, requested, rounded)
        self._labels[serial] = self._state.category
        ref = _StorageRef(st, self._on_dead)
        ref.key = key
        self._refs[key] = ref
        if device == HOST or self._mirror_serials or self._mirrors or self.ledgers:
            self.emit(device, serial, requested, rounded)
            return
        # the common case (a device, no mirror, no ledger): emit and _count, inline (every
        # storage of a step passes here)
        with self._lock:
            log = self.events
            log.device.append(device)
            log.serial.append(serial)
            log.requested.append(requested)
            log.allocated.append(rounded)
            c = self.counters[device]
            c.live_requested += requested
            live = c.live_allocated = c.live_allocated + rounded
            if live > c.peak_allocated:
                c.peak_allocated = live
                c.peak_event = len(log.device)
                c.peak_phase = self._state.phase
            if c.live_requested > c.peak_requested:
                c.peak_requested = c.live_requested

    def _account(self, rec: _Storage, sign: int) -> None:
        self.emit(rec.device, rec.serial, sign * rec.requested, sign * rec.rounded)

    def emit(self, device: int, serial: int, requested: int, allocated: int) -> None:
        """Append one event (signed bytes) and count it, then the same event on each
        device mirroring this storage's (:meth:`set_mirrors`)."""
        with self._lock:
            self.events.add(device, serial, requested, allocated)
            if device == HOST:
                self.host_requested += requested
                return
            self._count(device, requested, allocated)
            if self._mirror_serials or self._mirrors:
                self._emit_mirrors(device, serial, requested, allocated)
            if self.ledgers:
                ledger = self.ledgers.get(device)
                if ledger is not None:
                    ledger.on_event(serial, requested, allocated)

    def _count(self, device: int, requested: int, allocated: int) -> None:
        c = self.counters[device]
        c.live_requested += requested
        c.live_allocated += allocated
        if c.live_allocated > c.peak_allocated:
            c.peak_allocated = c.live_allocated
            c.peak_event = len(self.events)
            c.peak_phase = self._state.phase
        if c.live_requested > c.peak_requested:
            c.peak_requested = c.live_requested

    def _emit_mirrors(self, device: int, serial: int, requested: int, allocated: int) -> None:
        entry = self._mirror_serials.get(serial)
        if entry is None:
            devices = self._mirrors.get(device)
            if not devices or requested < 0 or allocated < 0:
                return  # not mirrored, or made before its device was
            if self._unmirrored:
                devices = tuple(d for d in devices if d not in self._unmirrored)
                if not devices:
                    return
                self._device_columns.setdefault(devices, array("q", devices))
            n = len(devices)
            first = self._serial + 1
            self._serial += n
            entry = (array("q", range(first, first + n)), self._device_columns[devices])
            self._mirror_serials[serial] = entry
            self._mirror_firsts.append(first)  # serials first..first + n - 1 mirror serial
            self._mirror_blocks.append((n, serial))
        serials, device_column = entry
        n = len(serials)
        log = self.events
        log.device.extend(device_column)
        log.serial.extend(serials)
        fills = self._fills
        col = fills.get((requested, n))
        log.requested.extend(col if col is not None else self._filled(requested, n))
        col = fills.get((allocated, n))
        log.allocated.extend(col if col is not None else self._filled(allocated, n))
        # Each mirror's peak event is the index after this whole run of mirror events: a
        # snapshot there sees the same events of its device as one right after its own
        # event, so the devices of a class stay equal and share their counters.
        at = len(log.device)
        counters = self._distinct_counters.get(id(device_column))
        if counters is None:
            counters = self._class_counters(device_column)
        for c in counters:
            c.live_requested += requested
            c.live_allocated += allocated
            if c.live_allocated > c.peak_allocated:
                c.peak_allocated = c.live_allocated
                c.peak_event = at
                c.peak_phase = self._state.phase
            if c.live_requested > c.peak_requested:
                c.peak_requested = c.live_requested

    def _filled(self, value: int, n: int) -> array[int]:
        """``value`` ``n`` times, as a column to append (the same sizes recur)."""
        key = (value, n)
        col = self._fills.get(key)
        if col is None:
            if len(self._fills) > 4096:
                self._fills.clear()
            col = self._fills[key] = array("q", (value,)) * n
        return col

    def _class_counters(self, devices: array[int]) -> list[DeviceCounters]:
        """The distinct counters of ``devices`` (a class of mirrors shares one)."""
        seen: dict[int, DeviceCounters] = {}
        for d in devices:
            c = self.counters[d]
            seen.setdefault(id(c), c)
        found = self._distinct_counters[id(devices)] = list(seen.values())
        return found

    def set_mirrors(self, mirrors: dict[int, Sequence[int]], own: Collection[int] = ()) -> None:
        """From now on every storage made on a device ``d`` in ``mirrors`` stands for one
        on each device of ``mirrors[d]`` too: each of its events (allocation, free,
        resize) is followed by the same event on those devices, in order, under serials
        of their own filed under its category. DataParallel's replicas on equal shards
        run the same program on their devices, so one runs and the others mirror it;
        each device's own sequence of events is then the one it would have. Replaces the
        previous mapping; storages made under it keep their mirrors.

        ``own``: mirrors that also have events of their own (DataParallel's output device:
        the gathered outputs, the loss); they never share counters with their class."""
        for d in (*mirrors, *chain.from_iterable(mirrors.values())):
            self._check_index(d)
        self._mirrors = {d: tuple(ms) for d, ms in mirrors.items() if ms}
        self._own = frozenset(own)
        for ms in self._mirrors.values():
            self._device_columns.setdefault(ms, array("q", ms))
        # Devices that mirror the same device share one counters object from now on (their
        # events are the same): those that already share one, or that hold nothing (no
        # storage mirrored under an older mapping can reach some of them only) and have
        # equal counters. All others get their own.
        holders: dict[int, list[int]] = {}
        for i, c in enumerate(self.counters):
            holders.setdefault(id(c), []).append(i)
        classes = {tuple(sorted(m for m in ms if m not in self._own))
                   for ms in self._mirrors.values()}
        for devices in holders.values():
            if len(devices) > 1 and tuple(devices) not in classes:
                for i in devices[1:]:
                    self.counters[i] = dataclasses.replace(self.counters[i])
        for ms in self._mirrors.values():
            shared = [m for m in ms if m not in self._own]
            if not shared:
                continue
            first = self.counters[shared[0]]
            if all(self.counters[m] == first and not self.counters[m].live_requested
                   and not self.counters[m].live_allocated for m in shared):
                for m in shared[1:]:
                    self.counters[m] = first
        self._distinct_counters.clear()

    @contextlib.contextmanager
    def not_mirrored_on(self, devices: Collection[int]) -> Iterator[None]:
        """Storages made in the block have no mirror on ``devices`` (a mirror whose own
        program differs there: the output device's share of the gradient is a view)."""
        old = self._unmirrored
        self._unmirrored = old | frozenset(devices)
        try:
            yield
        finally:
            self._unmirrored = old

    def on_free(self, t: torch.Tensor, callback: Callable[[], None]) -> None:
        """Call ``callback`` right after ``t``'s storage dies (its free counted)."""
        serial = self.serial_of(t)
        if serial is None:
            raise ValueError("on_free needs a tracked storage")
        self._on_free_calls.setdefault(serial, []).append(callback)

    def multiplicity(self, device: int) -> int:
        """How many devices ``device``'s storages stand for now (itself and its mirrors)."""
        return 1 + len(self._mirrors.get(device, ()))

    def _on_dead(self, ref: _StorageRef) -> None:
        """A tracked storage died (the weak reference's callback)."""
        self._on_free(ref.key)

    def _on_free(self, key: int) -> None:
        rec = self._storages.pop(key, None)
        self._refs.pop(key, None)
        if rec is None:
            return
        device = rec.device
        if device == HOST or self._mirror_serials or self._mirrors or self.ledgers:
            self.emit(device, rec.serial, -rec.requested, -rec.rounded)
        else:  # emit and _count, inline, as in _track (a free never raises a peak)
            with self._lock:
                log = self.events
                log.device.append(device)
                log.serial.append(rec.serial)
                log.requested.append(-rec.requested)
                log.allocated.append(-rec.rounded)
                c = self.counters[device]
                c.live_requested -= rec.requested
                c.live_allocated -= rec.rounded
        if self._on_free_calls:
            for callback in self._on_free_calls.pop(rec.serial, ()):
                callback()

    def storage_resized(self, t: torch.Tensor) -> None:
        """``t``'s storage was resized outside the dispatcher (``UntypedStorage.resize_``,
        as FSDP2 frees and re-allocates its unsharded parameters): count the change now."""
        st = t.untyped_storage()
        rec = self._storages.get(id(st))
        if rec is not None and rec.requested != st.nbytes():
            self._resized(st, rec)

    def _resized(self, st: Any, rec: _Storage) -> None:
        """A storage that grew or shrank in place (``resize_``, ``out=`` variants)."""
        if rec.device != HOST:
            self._account(rec, -1)
        rec.requested = int(st.nbytes())
        rec.rounded = block_bytes(rec.requested)
        if rec.device != HOST:
            self._account(rec, +1)

    # ---- a few records -----------------------------------------------------------------

    def new_empty(self, shape: Any, dtype: torch.dtype, device: int) -> torch.Tensor:
        """A new contiguous meta tensor on ``device``, counted as any allocation (current
        category), made without dispatching: what ``torch.empty`` under the mode does,
        for the comm paths that make one per device."""
        with torch._C._DisableTorchDispatch():
            t = torch.empty(shape, dtype=dtype, device="meta")
        self._track(t.untyped_storage(), device)
        return t

    @property
    def last_serial(self) -> int:
        """The serial of the storage made last (storages made later have higher ones)."""
        return self._serial

    def new_serial(self) -> int:
        self._serial += 1
        return self._serial

    def set_label(self, serial: int, category: str) -> None:
        self._labels[serial] = category

    def label_of(self, serial: int) -> str:
        """The category of storage ``serial`` (a mirror's: the mirrored storage's)."""
        label = self._labels.get(serial)
        if label is None and self._mirror_firsts:
            k = bisect.bisect_right(self._mirror_firsts, serial) - 1
            if k >= 0:
                n, mirrored = self._mirror_blocks[k]
                if serial < self._mirror_firsts[k] + n:
                    label = self._labels.get(mirrored)
        return label or "other"

    # ---- dispatch ---------------------------------------------------------------------

    def _run(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """``func(*args, **kwargs)`` over meta tensors, memoised for functional ops."""
        found = _FUNCTIONAL.get(id(func))
        functional = found[1] if found is not None and found[0] is func else _functional(func)
        if not functional:
            if id(func) in _FILLS_ONLY_IDS and _is_meta(args[0]):
                return args[0]  # a random fill of a meta tensor writes nothing, returns self
            if _writes_in_place_only(func) and all(
                    _is_meta(t) for t in _tensor_args(args, kwargs)):
                return None  # e.g. an optimizer's foreach updates: nothing to write or count
            return func(*args, **kwargs)
        key = _key_of_call(func, args, kwargs)
        if key is _NO:
            return func(*args, **kwargs)
        tmpl = self._op_cache.get(key)
        if tmpl is None:
            out = func(*args, **kwargs)
            tmpl = _template(out)
            if tmpl is not _NO:
                # ops like _unsafe_view return an input's storage without saying so
                ins = {id(a.untyped_storage()) for a in _tensor_args(args, kwargs)}
                if any(id(o.untyped_storage()) in ins for o in _tensor_outputs(out)):
                    tmpl = _NO
            self._op_cache[key] = tmpl
            return out
        if tmpl is _NO:
            return func(*args, **kwargs)
        self.cache_hits += 1
        return _rebuild(tmpl)

    def placement(self, device: torch.device) -> tuple[torch.device, int | None]:
        """Where an op's ``device=`` puts its result: the real device the bytes live on and
        the virtual device (None: the rules of :meth:`__torch_dispatch__`). Here every
        ``device=`` means meta over meta tensors and is left alone over CPU tensors;
        :mod:`dpprof.emulator.virtual_cuda` maps ``cuda:k``."""
        return (self.base if self._meta else device), None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if types and (sub := subclass_in(types)) is not None:
            return NotImplemented if sub == SUBCLASS else func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        placed = None  # the virtual device a device= argument names
        if kwargs.get("device") is not None:
            # Factories and conversions: the bytes live on the base (or where placement
            # says); the place is virtual.
            real, placed = self.placement(kwargs["device"])
            if real != kwargs["device"]:
                kwargs = {**kwargs, "device": real}
        # storages made outside the mode (a view of one is no new one)
        devices, saw_host, outside = self._inputs_where(args, kwargs)
        if len(devices) > 1 and not self._state.allow_cross and func not in _CROSS_DEVICE_OK:
            a, b = sorted(devices)[:2]
            raise VirtualDeviceError(
                "Expected all tensors to be on the same device, but found at least two "
                f"devices, cuda:{a} and cuda:{b}! (while running {func})"
            )
        if self._meta and id(func) in _INDEX_RULE_IDS:  # the meta kernels take other dtypes
            args = as_on_cuda(func, args)
        try:
            out = self._run(func, args, kwargs) if self._meta else func(*args, **kwargs)
        except Exception as e:  # the innermost op is the one that failed: name it
            if getattr(e, "dpprof_op", None) is None:
                with contextlib.suppress(AttributeError, TypeError):
                    e.dpprof_op = getattr(getattr(func, "_schema", None), "name", str(func))  # type: ignore[attr-defined]
            raise
        if self._state.forced is not None:
            target = self._state.forced
        elif placed is not None:
            target = placed
        elif devices:
            target = min(devices)  # CPU scalars next to GPU tensors: the GPU wins
            self._last_device = target
        elif saw_host:
            target = HOST
        elif self._last_device is not None and torch._C._current_graph_task_id() != -1:
            # a factory inside a backward node (``at::zeros`` in a backward formula): CUDA's
            # engine runs each node under its device's guard; here, the device of the
            # node's tensors, the last ones an op read
            target = self._last_device
        else:
            target = self._state.device  # a factory: the current device
        return self._place(func, args, kwargs, out, target, outside)

    def dispatch_beside_real_host(self, func: Any, args: Any,
                                  kwargs: dict[str, Any] | None) -> Any:
        """:meth:`__torch_dispatch__` over CPU tensors beside a real host (``dpprof run
        --compute``), where most ops are the script's host work: a storage of the host is
        not tracked (an untracked storage is the host's, as :meth:`device_of` says), so a
        host op costs a look-up per input and nothing more. Virtual devices are counted
        event for event as by the general path; only the host's own events are left out
        (they are counted on no device)."""
        placed = None
        if kwargs:
            dev = kwargs.get("device")
            if dev is not None:
                real, placed = self.placement(dev)
                if real != dev:
                    kwargs = {**kwargs, "device": real}
        else:
            kwargs = {}
        # the host's storages among the inputs (a view of one is no new one)
        devices, saw_host, outside = self._inputs_where(args, kwargs)
        state = self._state
        if len(devices) > 1 and not state.allow_cross and func not in _CROSS_DEVICE_OK:
            a, b = sorted(devices)[:2]
            raise VirtualDeviceError(
                "Expected all tensors to be on the same device, but found at least two "
                f"devices, cuda:{a} and cuda:{b}! (while running {func})"
            )
        try:
            out = func(*args, **kwargs)
        except Exception as e:  # the innermost op is the one that failed: name it
            if getattr(e, "dpprof_op", None) is None:
                with contextlib.suppress(AttributeError, TypeError):
                    e.dpprof_op = getattr(getattr(func, "_schema", None), "name", str(func))  # type: ignore[attr-defined]
            raise
        if state.forced is not None:
            target = state.forced
        elif placed is not None:
            target = placed
        elif devices:
            target = min(devices)  # CPU scalars next to GPU tensors: the GPU wins
            self._last_device = target
        elif outside or saw_host:
            return out  # the host's inputs only: the host's output
        elif self._last_device is not None and torch._C._current_graph_task_id() != -1:
            target = self._last_device  # a factory inside a backward node, as above
        else:
            target = state.device
        if target == HOST:
            return out
        return self._place(func, args, kwargs, out, target, outside)

    def _inputs_where(self, args: Any, kwargs: dict[str, Any] | None
                      ) -> tuple[set[int], bool, list[int]]:
        """Where an op's tensor inputs live: the virtual devices, whether one is a tracked
        host storage, and the ids of the storages not tracked (made outside the mode)."""
        storages = self._storages
        devices: set[int] = set()
        outside: list[int] = []
        saw_host = False
        tensor = torch.Tensor
        for a in (*args, *kwargs.values()) if kwargs else args:
            for b in ((a,) if isinstance(a, tensor) else a if isinstance(a, _SEQ) else ()):
                if not isinstance(b, tensor):
                    continue
                key = id(b.untyped_storage())
                rec = storages.get(key)
                if rec is None:
                    outside.append(key)
                elif rec.device == HOST:
                    saw_host = True
                else:
                    devices.add(rec.device)
        return devices, saw_host, outside

    def _place(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any, target: int,
               outside: Collection[int]) -> Any:
        """Track ``out``'s new storages on ``target`` (a storage made outside the mode is
        not tracked: ``param.data`` of a module built before it), between the buffers the
        op's kernel on the target GPU allocates and frees itself."""
        plan = None
        if self.kernel_plans and target != HOST:
            plan_of = self.kernel_plans.get(func)
            plan = plan_of(args, kwargs) if plan_of is not None else None
        live: dict[str, tuple[int, int]] = {}
        if plan is not None:
            self._play(plan.before, target, live)
        storages = self._storages
        for t in ((out,) if isinstance(out, torch.Tensor) else out if isinstance(out, _SEQ)
                  else ()):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = id(st)
            rec = storages.get(key)
            if rec is None:
                if key not in outside:
                    self._track(st, target)
            elif rec.requested != st.nbytes():
                self._resized(st, rec)
        if plan is not None:
            self._play(plan.after, target, live)
        return out

    def _play(self, steps: Sequence[KernelStep], device: int,
              live: dict[str, tuple[int, int]]) -> None:
        """Emit a kernel's own allocations and frees on ``device``, filed under the
        current category."""
        for step in steps:
            if step.kind == ALLOC:
                serial = self.new_serial()
                self._labels[serial] = self._state.category
                live[step.name] = (serial, step.nbytes)
                self.emit(device, serial, step.nbytes, block_bytes(step.nbytes))
            else:
                serial, nbytes = live.pop(step.name)
                self.emit(device, serial, -nbytes, -block_bytes(nbytes))


_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
SUBCLASS = "subclass"
FAKE = "fake"


def subclass_in(types: Any) -> str | None:
    """Whether an op's inputs include a tensor subclass with a ``__torch_dispatch__`` of its
    own: :data:`FAKE` for a FakeTensor (DTensor's sharding propagation computes shapes on
    them: not memory, run untracked), :data:`SUBCLASS` for another (a DTensor: FSDP2's
    sharded parameters), where the mode returns ``NotImplemented``: the subclass runs the
    op on its inner tensors, which come back to the mode and are counted (as
    FakeTensorMode does); counting the wrapper would count its global size, and its inner
    tensors never."""
    for t in types:
        if t is not torch.Tensor and getattr(t, "__torch_dispatch__", _PLAIN_DISPATCH) \
                is not _PLAIN_DISPATCH:
            from torch._subclasses.fake_tensor import FakeTensor

            return FAKE if issubclass(t, FakeTensor) else SUBCLASS
    return None


_NO = object()  # "not cacheable"
_NO_INDICES = np.zeros(0, dtype=np.int64)


class _OpMemo(dict[Any, Any]):
    """(op, metadata of its meta-tensor arguments) -> template of its outputs, bounded: a
    long search (maxbatch) meets new shapes at every batch size, so it starts afresh when
    full rather than growing without end."""

    MAX_ENTRIES = 1 << 16

    def __setitem__(self, key: Any, value: Any) -> None:
        if len(self) >= self.MAX_ENTRIES:
            self.clear()
        super().__setitem__(key, value)


_OP_CACHE = _OpMemo()
_SIMPLE = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
           torch.memory_format)
# Per-op facts from the schema, asked once per op and looked up by id (an OpOverload's
# __hash__ is Python: a call per look-up on every op); the op is kept beside its answer.
_FUNCTIONAL: dict[int, tuple[Any, bool]] = {}


def _functional(func: Any) -> bool:
    """No argument written, no output aliasing an input (per the op's schema)."""
    found = _FUNCTIONAL.get(id(func))
    known = found[1] if found is not None and found[0] is func else None
    if known is None:
        try:
            schema = func._schema
            known = not any(a.alias_info is not None for a in schema.returns) and not any(
                a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
            known = known and not schema.is_mutable and "rand" not in func.__name__
        except AttributeError:
            known = False
        _FUNCTIONAL[id(func)] = (func, known)
    return known


_IN_PLACE_ONLY: dict[int, tuple[Any, bool]] = {}


def _writes_in_place_only(func: Any) -> bool:
    """An in-place op that returns nothing (``_foreach_mul_``, ``_fused_adamw_``, ...):
    over meta tensors (only: the optimizers' step counts are real host tensors) it
    allocates nothing and writes nothing, and its meta kernel (Python
    refs, per tensor: the optimizers' foreach updates were half of a step's emulation)
    can be skipped. ``out=`` variants are not in-place (they may resize their outputs)."""
    found = _IN_PLACE_ONLY.get(id(func))
    known = found[1] if found is not None and found[0] is func else None
    if known is None:
        try:
            schema = func._schema
            known = (schema.is_mutable and not schema.returns
                     and func._overloadpacket.__name__.endswith("_"))
        except AttributeError:
            known = False
        _IN_PLACE_ONLY[id(func)] = (func, known)
    return known


# In-place random fills: over meta tensors they allocate nothing and return ``self`` (their
# meta kernels are Python refs whose first call imports torch._dynamo, about a second).
_FILLS_ONLY = {
    aten.normal_.default, aten.uniform_.default, aten.random_.default,
    getattr(aten.random_, "from"), aten.random_.to, aten.exponential_.default,
    aten.log_normal_.default, aten.cauchy_.default, aten.geometric_.default,
    aten.bernoulli_.float, aten.bernoulli_.Tensor,
}
_FILLS_ONLY_IDS = frozenset(map(id, _FILLS_ONLY))  # the ops live as long as this module
_INDEX_RULE_IDS = frozenset(map(id, CUDA_INDEX_RULES))
# Tensor.is_meta as torch answers it (an emulation may patch the property), making no device
_is_meta: Callable[[torch.Tensor], bool] = torch._C.TensorBase.__dict__["is_meta"].__get__
_SIMPLE_TYPES = frozenset(_SIMPLE)
_SEQ = (list, tuple)


def _key_of(x: Any) -> Any:
    """A hashable summary of an argument: tensors by metadata, simple values by type and
    value, sequences element-wise; _NO for anything else."""
    cls = type(x)
    if cls in _SIMPLE_TYPES:
        return (cls, x)
    if isinstance(x, torch.Tensor):
        # Only a meta tensor is its metadata: a real tensor's results depend on its values,
        # so a call that reads one is never memoised (it would hand one tensor's values to
        # another of the same shape).
        if not _is_meta(x):
            return _NO
        return (x.shape, x.stride(), x.dtype, x.storage_offset(), x.layout)
    if cls in _SEQ or isinstance(x, _SEQ):
        parts = []
        for v in x:
            p = _key_of(v)
            if p is _NO:
                return _NO
            parts.append(p)
        return (cls, tuple(parts))
    return _NO


def _key_of_call(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    parts: list[Any] = [func]
    for a in args:
        p = _key_of(a)
        if p is _NO:
            return _NO
        parts.append(p)
    if kwargs:
        for name in sorted(kwargs):
            p = _key_of(kwargs[name])
            if p is _NO:
                return _NO
            parts.append((name, p))
    return tuple(parts)


def _template(out: Any) -> Any:
    """Outputs as (shape, stride, dtype) to rebuild, or _NO when they cannot be rebuilt
    from metadata alone (a view, an offset, a storage larger than its strides need)."""
    if isinstance(out, torch.Tensor):
        if out.storage_offset() != 0 or out.layout != torch.strided or out.device.type != "meta":
            return _NO
        need = (1 + sum((n - 1) * st for n, st in zip(out.shape, out.stride(), strict=True))
                if out.numel() else 0) * out.element_size()
        if out.untyped_storage().nbytes() != need:
            return _NO
        return ("t", tuple(out.shape), tuple(out.stride()), out.dtype)
    if isinstance(out, (list, tuple)):
        parts = [_template(o) for o in out]
        if any(p is _NO for p in parts):
            return _NO
        storages = [id(o.untyped_storage()) for o in out if isinstance(o, torch.Tensor)]
        if len(set(storages)) != len(storages):
            return _NO
        return ("seq", type(out), parts)
    if isinstance(out, _SIMPLE):
        return ("v", out)
    return _NO


def _rebuild(tmpl: Any) -> Any:
    kind = tmpl[0]
    if kind == "t":
        return torch.empty_strided(tmpl[1], tmpl[2], dtype=tmpl[3], device="meta")
    if kind == "seq":
        return tmpl[1](_rebuild(p) for p in tmpl[2])
    return tmpl[1]


def _tensor_args(args: Any, kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


def _tensor_outputs(out: Any) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for o in out:
            if isinstance(o, torch.Tensor):
                yield o


# ---- crossings ---------------------------------------------------------------------------


class _ToDevice(torch.autograd.Function):
    """``tensor.to(cuda:k)``: forward copies to ``k``, backward copies the gradient back."""

    @staticmethod
    def forward(ctx: Any, rt: VirtualDevices, t: torch.Tensor, index: int) -> torch.Tensor:
        ctx.rt = rt
        ctx.source = rt.device_of(t)
        return copy_to(rt, t, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor | None, None]:
        if not ctx.needs_input_grad[1]:
            return None, None, None
        return None, copy_to(ctx.rt, grad, ctx.source), None


def copy_to(rt: VirtualDevices, t: torch.Tensor, index: int) -> torch.Tensor:
    """A new tensor on ``index`` with ``t``'s contents (``_to_copy``, preserve format)."""
    with rt.placing_on(index):
        return t.clone(memory_format=torch.preserve_format)


def to_device(rt: VirtualDevices, t: torch.Tensor, index: int) -> torch.Tensor:
    """The emulated ``t.to(f"cuda:{index}")``: no copy when already there (as torch)."""
    if rt.device_of(t) == index:
        return t
    if t.requires_grad:
        return _ToDevice.apply(rt, t, index)
    return copy_to(rt, t, index)
