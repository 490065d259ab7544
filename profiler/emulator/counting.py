"""The counting core of the virtual devices: GPUs that exist only as byte counters.

A :class:`CountingDevices` is a ``TorchDispatchMode``. Under it, every tensor storage that an
aten op creates is placed on a *virtual device* and counted there until it dies:

* an op's new storages live on the device of its tensor inputs (0-dim host tensors are
  ignored, as CUDA ignores CPU scalars); inputs on two devices are an error, as on GPUs;
  ops with no tensor inputs (factories) take the current device (:meth:`device`, like
  ``torch.cuda.device``);
* storages are tracked by weak reference, so a free is seen when the last tensor (or view)
  of a storage dies; both the requested bytes and the bytes as the CUDA caching allocator
  rounds them (multiples of 512 B) are counted;
* each storage is filed under a category (see ``dpprof.result.CATEGORIES``), from the
  current :meth:`category` at allocation, or later by :meth:`label` (e.g. a gradient that
  became a parameter's ``.grad``). The breakdown at a peak uses each storage's final label.

Layers override its hooks (``_follows_events``, ``_follow``, ``_run``, ``_check_movable``):
mirroring (:mod:`~dpprof.emulator.mirroring`), the op memo (:mod:`~dpprof.emulator.op_memo`),
the ledgers (:mod:`~dpprof.emulator.ledgers`); :mod:`dpprof.emulator.vdevice` assembles them.

The tensors themselves are meta tensors (memory only, any size, no arithmetic) or CPU
tensors (real numbers, for checks). The device index :data:`HOST` stands for the host.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dpprof.emulator.allocator import block_bytes
from dpprof.emulator.events import (
    ALLOC,
    DeviceCounters,
    EventLog,
    EventQueries,
    KernelPlan,
    KernelStep,
    PhaseMark,
)
from dpprof.emulator.identity import op_key, storage_key
from dpprof.emulator.index_dtypes import RULES as CUDA_INDEX_RULES
from dpprof.emulator.index_dtypes import as_on_cuda
from dpprof.emulator.op_log import OpLog

HOST = -1

aten = torch.ops.aten

# Ops that legitimately read one device and write another (a copy between GPUs).
_CROSS_DEVICE_OK = {
    aten.copy_.default,
    aten._to_copy.default,
    aten.copy.default,
}
# the same by identity (an op's hash is a Python call; the op log asks for every op)
_CROSS_DEVICE_OK_IDS = frozenset(id(op) for op in _CROSS_DEVICE_OK)
_NO_SOURCES: frozenset[int] = frozenset()


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
class _State:
    category: str = "activations"
    device: int = HOST
    forced: int | None = None  # place every new storage here (copies between devices)
    allow_cross: bool = False
    phase: str = ""
    # torch's own code that names the device of an emulated tensor (``device=x.device``,
    # which is meta underneath) means this virtual device (None: the rules of dispatch)
    meta_device: int | None = None


class CountingDevices(EventQueries, TorchDispatchMode):
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
        self._storages: dict[int, _Storage] = {}  # storage_key(storage) -> record
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._serial = 0
        self._state = _State()
        self._lock = threading.RLock()
        self._measuring_since = 0
        self.host_requested = 0
        self._meta = self.base.type == "meta"
        self._last_device: int | None = None  # of the last op with device tensor inputs
        self._by_device: tuple[int, dict[str, np.ndarray], dict[int, np.ndarray]] = (-1, {}, {})
        self._on_free_calls: dict[int, list[Callable[[], None]]] = {}  # serial -> callbacks
        # device -> the stream current on it, where that is not its default stream (the
        # virtual CUDA's torch.cuda.stream sets it): its allocations are tagged with it
        self._streams: dict[int, int] = {}
        # ops whose kernel on the target GPU allocates buffers of its own that the meta
        # kernel does not (dpprof.emulator.kernels): op -> its plan for the op's arguments
        self.kernel_plans: dict[Any, Callable[[Any, dict[str, Any]], KernelPlan | None]] = {}
        # where each device first ran a cuBLAS op, by the thread's role (BLAS_FORWARD, the
        # forward's thread; BLAS_BACKWARD, autograd's; BLAS_LT, cuBLASLt's first addmm):
        # the event index after that op's outputs, where the handle's workspace is
        # allocated (lazily, at the handle's first use); dpprof.emulator.reserved places
        # the workspaces there in the caching allocator's sequence
        self.blas_first: dict[tuple[int, str], int] = {}
        # storages a real run keeps alive past the point where a later step frees them (a
        # warm-up's transient: DDP's first buckets, held until NCCL's watchdog reaps their
        # all-reduce): serial -> (the event index where the steady state frees it, its kind)
        self.transients: dict[int, tuple[int, str]] = {}
        # the measured step's ops, for the step-time model (None: not asked for)
        self.op_log: OpLog | None = None

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

    def meta_on(self, index: int) -> contextlib.AbstractContextManager[None]:
        """A ``device=meta`` argument (C++ code of torch that allocates "on the device of
        the parameters", DDP's reducer: the emulated tensors are meta underneath) places
        the storage on ``index``; factories without a device stay where they would."""
        self._check_index(index)
        return self._set(meta_device=index)

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

    def set_stream(self, device: int, stream: int) -> None:
        """Make ``stream`` (an id; 0: the default stream) current on ``device``: the
        storages allocated there from now on are that stream's (``EventLog.streams``)."""
        if stream:
            self._streams[device] = stream
        else:
            self._streams.pop(device, None)

    def stream_on(self, device: int) -> int:
        """The id of the stream current on ``device`` (0: its default stream)."""
        return self._streams.get(device, 0)

    def _set_category(self, name: str) -> None:
        """Switch the category without a context (autograd hooks switch it back)."""
        self._state.category = name

    @property
    def current_phase(self) -> str:
        """The phase of the step now running (:meth:`phase`)."""
        return self._state.phase

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

    def rehome(self, serials: Collection[int], index: int) -> None:
        """Storages (by serial, none of them mirrored) move to device ``index`` in the
        accounting: freed where they were, allocated there, and their later events
        there. (The step after ``dp-loss-primary``'s, run as
        ``DataParallel(output_device=index)``: the loop's leftovers live there.)"""
        self._check_index(index)
        for rec in list(self._storages.values()):
            if rec.serial in serials and rec.device != index:
                self._check_movable(rec.serial)
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
        """Start a measurement: peaks restart from what is resident now."""
        with self._lock:
            self._measuring_since = len(self.events)
            for c in self.counters:
                c.peak_allocated = c.live_allocated
                c.peak_requested = c.live_requested
                c.peak_event = len(self.events)
                c.peak_phase = self._state.phase

    # ---- tracking ---------------------------------------------------------------------

    def _track(self, st: Any, device: int) -> None:
        requested = int(st.nbytes())
        self._serial += 1
        serial = self._serial
        rounded = block_bytes(requested)
        key = storage_key(st)
        self._storages[key] = _Storage(serial, device, requested, rounded)
        self._labels[serial] = self._state.category
        ref = _StorageRef(st, self._on_dead)
        ref.key = key
        self._refs[key] = ref
        if device == HOST or self._follows_events():
            self.emit(device, serial, requested, rounded)
            return
        # the common case (a device, no layer following): emit and _count, inline (every
        # storage of a step passes here)
        with self._lock:
            log = self.events
            log.device.append(device)
            log.serial.append(serial)
            log.requested.append(requested)
            log.allocated.append(rounded)
            if self._streams and device in self._streams:
                log.streams[len(log.device) - 1] = self._streams[device]
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
        """Append one event (signed bytes) and count it, then let the layers follow it
        (:meth:`_follow`: the same event on each device mirroring this storage's, a
        ledger's)."""
        with self._lock:
            self.events.add(device, serial, requested, allocated)
            if requested > 0 and self._streams and device in self._streams:
                self.events.streams[len(self.events) - 1] = self._streams[device]
            if device == HOST:
                self.host_requested += requested
                return
            self._count(device, requested, allocated)
            self._follow(device, serial, requested, allocated)

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
        """The category of storage ``serial``."""
        return self._labels.get(serial) or "other"

    # ---- hooks for the layers ----------------------------------------------------------

    def _follows_events(self) -> bool:
        """Whether a layer follows the events now (else the core counts inline)."""
        return False

    def _follow(self, device: int, serial: int, requested: int, allocated: int) -> None:
        """A layer's turn after each event counted on a device (not the host)."""

    def _check_movable(self, serial: int) -> None:
        """Raise where storage ``serial`` cannot move to another device (:meth:`rehome`)."""

    def _run(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """``func(*args, **kwargs)`` over meta tensors."""
        return func(*args, **kwargs)

    # ---- dispatch ---------------------------------------------------------------------

    def placement(self, device: torch.device) -> tuple[torch.device, int | None]:
        """Where an op's ``device=`` puts its result: the real device the bytes live on and
        the virtual device (None: the rules of :meth:`__torch_dispatch__`). Here every
        ``device=`` means meta over meta tensors and is left alone over CPU tensors;
        :class:`dpprof.emulator.cuda_devices.CudaDevices` maps ``cuda:k``."""
        return (self.base if self._meta else device), None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if types and (sub := subclass_in(types)) is not None:
            return NotImplemented if sub == SUBCLASS else func(*args, **(kwargs or {}))
        return self.count_dispatch(func, types, args, kwargs)

    def count_dispatch(self, func: Any, types: Any, args: Any = (),
                       kwargs: Any = None) -> Any:
        """The op run and counted; a subclass among its inputs already handed back (a
        dispatch mode layered on this one checks that once, before its own rules)."""
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
        if self._meta and op_key(func) in _INDEX_RULE_KEYS:  # the meta kernels take other dtypes
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
        log = self.op_log
        if log is not None and log.on:
            # a copy between devices: a copy op, or any op placed on another device (the
            # emulated .to(device) clones onto its target)
            state = self._state
            moves = state.forced is not None or id(func) in _CROSS_DEVICE_OK_IDS
            sources = ({*devices, HOST} if saw_host else devices) if moves else _NO_SOURCES
            log.record(func, args, kwargs, out, target, sources, state.phase,
                       self.mirrors_of(target))
        return self._place(func, args, kwargs, out, target, outside)

    def mirrors_of(self, device: int) -> tuple[int, ...]:
        """The devices that mirror ``device`` now (none here; see
        :class:`dpprof.emulator.mirroring.MirroredDevices`)."""
        return ()

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
                key = storage_key(b.untyped_storage())
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
            key = storage_key(st)
            rec = storages.get(key)
            if rec is None:
                if key not in outside:
                    self._track(st, target)
            elif rec.requested != st.nbytes():
                self._resized(st, rec)
        if plan is not None:
            self._play(plan.after, target, live)
        if func in BLAS_OPS and target != HOST:
            self._note_blas(func, target)
        return out

    def _note_blas(self, func: Any, device: int) -> None:
        """A cuBLAS op ran on ``device``: the first one of its thread's role places that
        handle's workspace (``getCurrentCUDABlasHandle`` allocates it at first use)."""
        role = BLAS_BACKWARD if torch._C._current_graph_task_id() != -1 else BLAS_FORWARD
        at = len(self.events)
        lt = func in LT_OPS
        for d in self._blas_devices(device):
            self.blas_first.setdefault((d, role), at)
            if lt:
                self.blas_first.setdefault((d, BLAS_LT), at)

    def _blas_devices(self, device: int) -> tuple[int, ...]:
        """The devices a cuBLAS op run on ``device`` stands for: ``device`` (the mirroring
        layer adds the devices mirroring it)."""
        return (device,)

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


# The ops CUDA runs through cuBLAS (aten/src/ATen/native/cuda/Blas.cpp): the first of each
# on a thread gets that thread's handle and its workspace; addmm (a Linear's bias) also runs
# cuBLASLt with a workspace of its own.
BLAS_OPS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten.addbmm.default, aten.mv.default, aten.addmv.default, aten.dot.default,
    aten.vdot.default, aten._addmm_activation.default,
})
LT_OPS = frozenset({aten.addmm.default, aten._addmm_activation.default})
BLAS_FORWARD = "forward"
BLAS_BACKWARD = "backward"
BLAS_LT = "lt"

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



_INDEX_RULE_KEYS = frozenset(map(op_key, CUDA_INDEX_RULES))
_SEQ = (list, tuple)
