"""The counting ledger of the virtual devices: every tensor storage placed on a virtual
device, counted there until it dies.

* storages are tracked by weak reference, so a free is seen when the last tensor (or view)
  of a storage dies; both the requested bytes and the bytes as the CUDA caching allocator
  rounds them (multiples of 512 B) are counted;
* each storage is filed under a category (see ``dpprof.result.CATEGORIES``), the current
  one at allocation (:class:`~dpprof.emulator.dispatch_state.DispatchState`), or later by
  :meth:`StorageLedger.label` (e.g. a gradient that became a parameter's ``.grad``). The
  breakdown at a peak uses each storage's final label;
* every allocation and free is one event of the log (:mod:`dpprof.emulator.events`), and
  the ledger's followers (:class:`EventFollower`: the mirrors of DataParallel's replicas,
  the variant ledgers) see each event counted on a device, in their order.

The dispatch mode (:class:`dpprof.emulator.virtual_devices.VirtualDevices`) decides where
an op's storages go; this ledger only counts them there.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from dpprof.emulator.allocator_config import block_bytes
from dpprof.emulator.dispatch_state import HOST, DispatchState, VirtualDeviceError
from dpprof.emulator.events import (
    ALLOC,
    DeviceCounters,
    EventLog,
    EventQueries,
    KernelStep,
    PhaseMark,
)
from dpprof.emulator.identity import storage_key
from dpprof.errors import called_where_nothing_raises

_SEQ = (list, tuple)


class EventFollower(Protocol):
    """A part that follows the ledger's events on the devices (not the host)."""

    def following(self) -> bool:
        """Whether it follows events now (else the ledger counts without asking it)."""
        ...

    def follow(self, device: int, serial: int, requested: int, allocated: int) -> None:
        """Its turn after each event counted on a device."""
        ...


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


class StorageLedger(EventQueries):
    """Live bytes per virtual device, storage by storage, and the log of their events."""

    def __init__(self, num_devices: int, state: DispatchState) -> None:
        self.num_devices = num_devices
        self.state = state
        self.counters = [DeviceCounters() for _ in range(num_devices)]
        self.events = EventLog()
        self.phases: list[PhaseMark] = []
        self.followers: tuple[EventFollower, ...] = ()
        # called with (device, serial, bytes) before a device's new storage is counted: it
        # raises where the GPU would run out of memory (dpprof run's scripts), else None
        self.capacity_guard: Callable[[int, int, int], None] | None = None
        self.host_requested = 0
        self._labels: dict[int, str] = {}  # serial -> category (the latest label wins)
        self._storages: dict[int, _Storage] = {}  # storage_key(storage) -> record
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._serial = 0
        self._lock = threading.RLock()
        self._by_device: tuple[int, dict[str, np.ndarray], dict[int, np.ndarray]] = (-1, {}, {})
        self._on_free_calls: dict[int, list[Callable[[], None]]] = {}  # serial -> callbacks
        # blocks of serials that take another storage's label (a mirror's): their first
        # serials (ascending), (length, the labelled storage's serial)
        self._shared_firsts: list[int] = []
        self._shared_blocks: list[tuple[int, int]] = []
        self._captures: dict[int, tuple[int, int]] = {}  # device -> (stream, private pool key)
        # storages a real run keeps alive past the point where a later step frees them (a
        # warm-up's transient: DDP's first buckets, held until NCCL's watchdog reaps their
        # all-reduce): serial -> (the event index where the steady state frees it, its kind)
        self.transients: dict[int, tuple[int, str]] = {}

    def check_index(self, index: int) -> None:
        if index != HOST and not 0 <= index < self.num_devices:
            raise VirtualDeviceError(
                f"virtual device {index} does not exist (have {self.num_devices})"
            )

    # ---- streams ----------------------------------------------------------------------

    def set_stream(self, device: int, stream: int) -> None:
        """Make ``stream`` (an id; 0: the default stream) current on ``device``: the
        storages allocated there from now on are that stream's (``EventLog.streams``)."""
        current = self.state.streams
        if stream:
            current[device] = stream
        else:
            current.pop(device, None)
        self._retag(device)

    def stream_on(self, device: int) -> int:
        """The id of the stream current on ``device`` (0: its default stream)."""
        return self.state.streams.get(device, 0)

    def tag_on(self, device: int) -> int:
        """The allocator key of what is allocated on ``device`` now: the current stream's id,
        or a capturing graph's private pool (0: the default stream)."""
        return self.state.stream_tags.get(device, 0)

    def begin_capture(self, device: int, stream: int, pool_key: int) -> None:
        """A CUDA graph captures ``stream`` on ``device``: what is allocated on that stream
        until :meth:`end_capture` is the graph's private pool's (``pool_key``, made by
        :func:`dpprof.emulator.allocator.private_pool_key`)."""
        self._captures[device] = (stream, pool_key)
        self._retag(device)

    def end_capture(self, device: int) -> None:
        self._captures.pop(device, None)
        self._retag(device)

    def capturing(self, device: int) -> bool:
        """Whether the stream current on ``device`` is capturing a CUDA graph."""
        capture = self._captures.get(device)
        return capture is not None and capture[0] == self.state.streams.get(device, 0)

    def _retag(self, device: int) -> None:
        """The key of ``device``'s allocations from now on: the capture's private pool while
        its stream is current, else the current stream (none: the default stream)."""
        stream = self.state.streams.get(device, 0)
        capture = self._captures.get(device)
        tag = capture[1] if capture is not None and capture[0] == stream else stream
        tags = self.state.stream_tags
        if tag:
            tags[device] = tag
        else:
            tags.pop(device, None)

    # ---- queries ----------------------------------------------------------------------

    def device_of(self, t: torch.Tensor) -> int:
        """The virtual device of ``t``'s storage (HOST for storages made outside the mode)."""
        rec = self._storages.get(storage_key(t.untyped_storage()))
        return HOST if rec is None else rec.device

    def label(self, tensors: Any, category: str) -> None:
        """File the storages of ``tensors`` (a tensor or an iterable) under ``category``."""
        if isinstance(tensors, torch.Tensor):
            tensors = (tensors,)
        for t in tensors:
            if t is None:
                continue
            # a DTensor (FSDP2's sharded parameters, their gradients and optimizer state)
            # holds its bytes in its local shard; its own storage is an empty wrapper's
            local = getattr(t, "_local_tensor", None)
            if isinstance(local, torch.Tensor):
                t = local
            rec = self._storages.get(storage_key(t.untyped_storage()))
            if rec is not None:
                self._labels[rec.serial] = category

    def category_of(self, tensor: torch.Tensor) -> str | None:
        """The category ``tensor``'s storage is filed under (None: not a counted storage)."""
        rec = self._storages.get(id(tensor.untyped_storage()))
        return None if rec is None else self._labels.get(rec.serial, "other")

    def live_storages(self, index: int) -> list[tuple[int, str]]:
        """(serial, category) of every storage live on device ``index``, oldest first."""
        return sorted((rec.serial, self._labels.get(rec.serial, "other"))
                      for rec in self._storages.values() if rec.device == index)

    def rehome(self, serials: Collection[int], index: int,
               check_movable: Callable[[int], None]) -> None:
        """Storages (by serial) move to device ``index`` in the accounting: freed where
        they were, allocated there, and their later events there. ``check_movable``
        raises for a storage that cannot move."""
        self.check_index(index)
        for rec in list(self._storages.values()):
            if rec.serial in serials and rec.device != index:
                check_movable(rec.serial)
                self._account(rec, -1)
                rec.device = index
                self._account(rec, +1)

    def serial_of(self, t: torch.Tensor) -> int | None:
        """The serial of ``t``'s storage, if it is tracked."""
        rec = self._storages.get(storage_key(t.untyped_storage()))
        return None if rec is None else rec.serial

    def bytes_of(self, t: torch.Tensor) -> tuple[int, int]:
        """(requested, allocated) bytes of ``t``'s storage as counted (0, 0 untracked)."""
        rec = self._storages.get(storage_key(t.untyped_storage()))
        return (0, 0) if rec is None else (rec.requested, rec.rounded)

    def live_bytes(self, index: int) -> int:
        return self.counters[index].live_allocated

    def reset_peaks(self) -> None:
        """Peaks restart from what is resident now."""
        with self._lock:
            for c in self.counters:
                c.peak_allocated = c.live_allocated
                c.peak_requested = c.live_requested
                c.peak_event = len(self.events)
                c.peak_phase = self.state.phase

    def columns(self) -> tuple[dict[str, np.ndarray], dict[int, np.ndarray]]:
        """The log's columns as arrays and each device's event indices."""
        return self._columns()

    # ---- where an op's inputs live, where its outputs go ------------------------------

    def inputs_where(self, args: Any, kwargs: dict[str, Any] | None
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
                key = storage_key(b.untyped_storage())
                rec = storages.get(key)
                if rec is None:
                    outside.append(key)
                elif rec.device == HOST:
                    saw_host = True
                else:
                    devices.add(rec.device)
        return devices, saw_host, outside

    def track_outputs(self, out: Any, target: int, outside: Collection[int]) -> None:
        """Track ``out``'s new storages on ``target`` (a storage made outside the mode is
        not tracked: ``param.data`` of a module built before it); count a storage the op
        resized."""
        storages = self._storages
        for t in ((out,) if isinstance(out, torch.Tensor) else out if isinstance(out, _SEQ)
                  else ()):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = storage_key(st)
            rec = storages.get(key)
            if rec is None:
                if key not in outside:
                    self.track(st, target)
            elif rec.requested != st.nbytes():
                self._resized(st, rec)

    # ---- tracking ---------------------------------------------------------------------

    def _follows_events(self) -> bool:
        # a loop, not any(): every storage asks, and a generator costs a frame each time
        for follower in self.followers:  # noqa: SIM110
            if follower.following():
                return True
        return False

    def track(self, st: Any, device: int) -> None:
        """Count the new storage ``st`` on ``device`` until it dies (unless the
        :attr:`capacity_guard` refuses it: then it raises, and nothing is counted)."""
        requested = int(st.nbytes())
        self._serial += 1
        serial = self._serial
        if self.capacity_guard is not None and device != HOST:
            self.capacity_guard(device, serial, requested)
        rounded = block_bytes(requested)
        key = storage_key(st)
        self._storages[key] = _Storage(serial, device, requested, rounded)
        self._labels[serial] = self.state.category
        ref = _StorageRef(st, self._on_dead)
        ref.key = key
        self._refs[key] = ref
        if device == HOST or self._follows_events():
            self.emit(device, serial, requested, rounded)
            return
        # the common case (a device, no part following): emit and _count, inline (every
        # storage of a step passes here)
        with self._lock:
            log = self.events
            try:
                log.device.append(device)
                log.serial.append(serial)
                log.requested.append(requested)
                log.allocated.append(rounded)
            except BaseException:  # a stop signal between the appends
                log.drop_partial()
                # not counted, so its free is not either
                self._storages.pop(key, None)
                self._refs.pop(key, None)
                raise
            tags = self.state.stream_tags
            if tags and device in tags:
                log.streams[len(log.device) - 1] = tags[device]
            c = self.counters[device]
            c.live_requested += requested
            live = c.live_allocated = c.live_allocated + rounded
            if live > c.peak_allocated:
                c.peak_allocated = live
                c.peak_event = len(log.device)
                c.peak_phase = self.state.phase
            if c.live_requested > c.peak_requested:
                c.peak_requested = c.live_requested

    def _account(self, rec: _Storage, sign: int) -> None:
        self.emit(rec.device, rec.serial, sign * rec.requested, sign * rec.rounded)

    def emit(self, device: int, serial: int, requested: int, allocated: int) -> None:
        """Append one event (signed bytes) and count it, then let the followers follow it
        (the same event on each device mirroring this storage's, a variant ledger's)."""
        with self._lock:
            self.events.add(device, serial, requested, allocated)
            tags = self.state.stream_tags
            if requested > 0 and tags and device in tags:
                self.events.streams[len(self.events) - 1] = tags[device]
            if device == HOST:
                self.host_requested += requested
                return
            self._count(device, requested, allocated)
            for follower in self.followers:
                if follower.following():
                    follower.follow(device, serial, requested, allocated)

    def _count(self, device: int, requested: int, allocated: int) -> None:
        c = self.counters[device]
        c.live_requested += requested
        c.live_allocated += allocated
        if c.live_allocated > c.peak_allocated:
            c.peak_allocated = c.live_allocated
            c.peak_event = len(self.events)
            c.peak_phase = self.state.phase
        if c.live_requested > c.peak_requested:
            c.peak_requested = c.live_requested

    def note_transient(self, t: torch.Tensor, kind: str, at_event: int | None = None) -> None:
        """``t``'s storage lives on as a transient of kind ``kind``: a later step (the
        steady state) frees it here, now (or after the first ``at_event`` events, where the
        caller learns of it later); this one keeps it until it dies."""
        serial = self.serial_of(t)
        if serial is not None:
            where = len(self.events) if at_event is None else at_event
            self.transients.setdefault(serial, (where, kind))

    def on_free(self, t: torch.Tensor, callback: Callable[[], None]) -> None:
        """Call ``callback`` right after ``t``'s storage dies (its free counted)."""
        serial = self.serial_of(t)
        if serial is None:
            raise ValueError("on_free needs a tracked storage")
        self._on_free_calls.setdefault(serial, []).append(callback)

    @called_where_nothing_raises
    def _on_dead(self, ref: _StorageRef) -> None:
        """A tracked storage died (the weak reference's callback)."""
        self._on_free(ref.key)

    def _on_free(self, key: int) -> None:
        rec = self._storages.pop(key, None)
        self._refs.pop(key, None)
        if rec is None:
            return
        device = rec.device
        if device == HOST or self._follows_events():
            self.emit(device, rec.serial, -rec.requested, -rec.rounded)
        else:  # emit and _count, inline, as in track (a free never raises a peak)
            with self._lock:
                log = self.events
                try:
                    log.device.append(device)
                    log.serial.append(rec.serial)
                    log.requested.append(-rec.requested)
                    log.allocated.append(-rec.rounded)
                except BaseException:  # a stop signal between the appends
                    log.drop_partial()
                    raise
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
        rec = self._storages.get(storage_key(st))
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

    def play(self, steps: Sequence[KernelStep], device: int,
             live: dict[str, tuple[int, int]]) -> None:
        """Emit a kernel's own allocations and frees on ``device``, filed under the
        current category."""
        for step in steps:
            if step.kind == ALLOC:
                serial = self.new_serial()
                self._labels[serial] = self.state.category
                live[step.name] = (serial, step.nbytes)
                self.emit(device, serial, step.nbytes, block_bytes(step.nbytes))
            else:
                serial, nbytes = live.pop(step.name)
                self.emit(device, serial, -nbytes, -block_bytes(nbytes))

    # ---- a few records -----------------------------------------------------------------

    def new_empty(self, shape: Any, dtype: torch.dtype, device: int) -> torch.Tensor:
        """A new contiguous meta tensor on ``device``, counted as any allocation (current
        category), made without dispatching: what ``torch.empty`` under the mode does,
        for the comm paths that make one per device."""
        with torch._C._DisableTorchDispatch():
            t = torch.empty(shape, dtype=dtype, device="meta")
        self.track(t.untyped_storage(), device)
        return t

    @property
    def last_serial(self) -> int:
        """The serial of the storage made last (storages made later have higher ones)."""
        return self._serial

    def new_serial(self) -> int:
        self._serial += 1
        return self._serial

    def new_serials_labelled_as(self, n: int, serial: int) -> int:
        """``n`` new serials, the first returned, whose storages are filed under storage
        ``serial``'s category, whatever it becomes (a mirror's storages)."""
        first = self._serial + 1
        self._serial += n
        self._shared_firsts.append(first)  # serials first..first + n - 1 label as serial
        self._shared_blocks.append((n, serial))
        return first

    def set_label(self, serial: int, category: str) -> None:
        self._labels[serial] = category

    def label_of(self, serial: int) -> str:
        """The category of storage ``serial`` (a mirror's: the mirrored storage's)."""
        label = self._labels.get(serial)
        if label is None and self._shared_firsts:
            k = bisect.bisect_right(self._shared_firsts, serial) - 1
            if k >= 0:
                n, labelled = self._shared_blocks[k]
                if serial < self._shared_firsts[k] + n:
                    label = self._labels.get(labelled)
        return label or "other"
