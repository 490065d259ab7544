"""The virtual devices: GPUs that exist only as byte counters, played by one
``TorchDispatchMode``.

Under a :class:`VirtualDevices`, every tensor storage that an aten op creates is placed on
a *virtual device* and counted there until it dies:

* an op's new storages live on the device of its tensor inputs (0-dim host tensors are
  ignored, as CUDA ignores CPU scalars); inputs on two devices are an error, as on GPUs;
  ops with no tensor inputs (factories) take the current device (:meth:`VirtualDevices.
  device`, like ``torch.cuda.device``);
* the tensors themselves are meta tensors (memory only, any size, no arithmetic) or CPU
  tensors (real numbers, for checks). The device index :data:`HOST` stands for the host.

The mode decides where storages go; its parts, each an object it holds and calls, do the
rest: the ledger of storages counts them (:attr:`VirtualDevices.storages`,
:class:`~dpprof.emulator.storage_ledger.StorageLedger`), DataParallel's replicas are
mirrored (:attr:`~VirtualDevices.mirrors`, :class:`~dpprof.emulator.mirroring.
ReplicaMirrors`), meta ops run through the op memo (:attr:`~VirtualDevices.memo`,
:class:`~dpprof.emulator.op_memo.MetaOpRunner`) and the variant ledgers follow a device's
events (:attr:`~VirtualDevices.ledgers`, :class:`~dpprof.emulator.ledgers.VariantLedgers`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Collection, Iterator, Set
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dpprof.emulator.dispatch_state import HOST, DispatchState, VirtualDeviceError
from dpprof.emulator.events import KernelPlan, PhaseMark
from dpprof.emulator.identity import op_key
from dpprof.emulator.index_dtypes import RULES as CUDA_INDEX_RULES
from dpprof.emulator.index_dtypes import as_on_cuda
from dpprof.emulator.ledgers import VariantLedgers
from dpprof.emulator.mirroring import ReplicaMirrors
from dpprof.emulator.op_log import OpLog
from dpprof.emulator.op_memo import MetaOpRunner
from dpprof.emulator.storage_ledger import StorageLedger

__all__ = ["HOST", "VirtualDeviceError", "VirtualDevices", "subclass_in"]

aten = torch.ops.aten

# Ops that legitimately read one device and write another (a copy between GPUs), by their
# keys (dpprof.emulator.identity: an op's own hash is a Python call, and id() an audit
# event; the op log asks for every op)
_CROSS_DEVICE_KEYS = frozenset(map(op_key, (
    aten.copy_.default,
    aten._to_copy.default,
    aten.copy.default,
)))
_NO_SOURCES: frozenset[int] = frozenset()


def _two_devices(func: Any, devices: Collection[int]) -> VirtualDeviceError:
    """The error of an op (not a copy) given inputs on two devices, as on GPUs."""
    a, b = sorted(devices)[:2]
    return VirtualDeviceError(
        "Expected all tensors to be on the same device, but found at least two "
        f"devices, cuda:{a} and cuda:{b}! (while running {func})"
    )


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
        self.state = DispatchState()  # each thread's contexts, as its dispatch reads them
        self._meta = self.base.type == "meta"
        # the parts: the ledger of storages and those that follow its events, in order
        self.storages = StorageLedger(num_devices, self.state)
        self.mirrors = ReplicaMirrors(self.storages)
        self.ledgers = VariantLedgers()  # device -> a variant of its allocations
        self.storages.followers = (self.mirrors, self.ledgers)
        self.memo = MetaOpRunner()
        # one op at a time: the threads the program starts dispatch here too
        # (dpprof.emulator.script_threads), and an op's accounting is several steps
        self.one_op_at_a_time = threading.RLock()
        # ops whose kernel on the target GPU allocates buffers of its own that the meta
        # kernel does not (dpprof.emulator.kernels): op -> its plan for the op's arguments
        self.kernel_plans: dict[Any, Callable[[Any, dict[str, Any]], KernelPlan | None]] = {}
        # where each device first ran a cuBLAS op, by the thread's role (BLAS_FORWARD, the
        # program's thread; BLAS_WORKER, a thread started for the work, as DataParallel's
        # replicas'; BLAS_BACKWARD, autograd's; BLAS_LT, cuBLASLt's first addmm):
        # the event index after that op's outputs, where the handle's workspace is
        # allocated (lazily, at the handle's first use); dpprof.emulator.reserved places
        # the workspaces there in the caching allocator's sequence
        self.blas_first: dict[tuple[int, str], int] = {}
        # A handle's workspace is per (handle, stream): a thread's first op on a side stream
        # gets another. (device, role, stream) -> (that event index, the allocator key the
        # workspace takes there: the stream's, or a capturing CUDA graph's private pool's)
        self.blas_side: dict[tuple[int, str, int], tuple[int, int]] = {}
        # the measured step's ops, for the step-time model (None: not asked for)
        self.op_log: OpLog | None = None
        # the device lists of torch.cuda.nccl's calls (DataParallel's broadcast and reduce):
        # torch makes a communicator on each device of a list (ncclCommInitAll) at its
        # first call and keeps it, NCCL's memory outside the allocator
        self.nccl_cliques: set[tuple[int, ...]] = set()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps __torch_dispatch__ in dynamo's disable (about 8 us per op)
        # unless a mode opts out; nothing here is ever compiled.
        return False

    # ---- contexts ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _set(self, **changes: Any) -> Iterator[None]:
        old = {k: getattr(self.state, k) for k in changes}
        for k, v in changes.items():
            setattr(self.state, k, v)
        try:
            yield
        finally:
            for k, v in old.items():
                setattr(self.state, k, v)

    def worker_thread(self) -> contextlib.AbstractContextManager[None]:
        """Ops run as on a thread the work started (DataParallel's replica threads): its own
        cuBLAS handle, and workspace, from the device's pool."""
        return self._set(worker_thread=True)

    def device(self, index: int) -> contextlib.AbstractContextManager[None]:
        """Factory ops (no tensor inputs) place their storage on ``index``."""
        self.storages.check_index(index)
        return self._set(device=index)

    def category(self, name: str) -> contextlib.AbstractContextManager[None]:
        """New storages are filed under ``name`` until the context ends."""
        return self._set(category=name)

    def placing_on(self, index: int) -> contextlib.AbstractContextManager[None]:
        """Every new storage goes to ``index``, whatever the inputs (a copy's target)."""
        self.storages.check_index(index)
        return self._set(forced=index, allow_cross=True)

    def meta_on(self, index: int) -> contextlib.AbstractContextManager[None]:
        """A ``device=meta`` argument (C++ code of torch that allocates "on the device of
        the parameters", DDP's reducer: the emulated tensors are meta underneath) places
        the storage on ``index``; factories without a device stay where they would."""
        self.storages.check_index(index)
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
        self.storages.phases.append(PhaseMark(len(self.storages.events), name))
        changes: dict[str, Any] = {"phase": name}
        if category is not None:
            changes["category"] = category
        if device is not None:
            self.storages.check_index(device)
            changes["device"] = device
        with self._set(**changes):
            yield

    def set_category(self, name: str) -> None:
        """Switch the category without a context (autograd hooks switch it back)."""
        self.state.category = name

    @property
    def current_phase(self) -> str:
        """The phase of the step now running (:meth:`phase`)."""
        return self.state.phase

    @property
    def current_device(self) -> int:
        return self.state.device

    @property
    def current_category(self) -> str:
        return self.state.category

    # ---- across the parts -------------------------------------------------------------

    def reset_peaks(self) -> None:
        """Start a measurement: peaks restart from what is resident now (the devices' and
        the variant ledgers')."""
        self.storages.reset_peaks()
        self.ledgers.reset_peaks()

    def rehome(self, serials: Collection[int], index: int) -> None:
        """Storages (by serial, none of them mirrored) move to device ``index`` in the
        accounting: freed where they were, allocated there, and their later events
        there. (The step after ``dp-loss-primary``'s, run as
        ``DataParallel(output_device=index)``: the loop's leftovers live there.)"""
        self.storages.check_index(index)
        self.mirrors.set_mirrors({})  # no shared counters while bytes move
        self.storages.rehome(serials, index, self.mirrors.check_movable)

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
        with self.one_op_at_a_time:
            return self.dispatch_one(func, types, args, kwargs)

    def dispatch_one(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        """One op, no subclass among its inputs (a DTensor, a FakeTensor), while no other
        thread's runs: run and counted."""
        return self.count_dispatch(func, types, args, kwargs)

    def count_dispatch(self, func: Any, types: Any, args: Any = (),
                       kwargs: Any = None) -> Any:
        """The op run and counted; a subclass among its inputs already handed back (the
        CUDA runtime, :class:`~dpprof.emulator.cuda_devices.CudaDevices`, checks that once,
        before its per-op rules)."""
        kwargs = kwargs or {}
        placed = None  # the virtual device a device= argument names
        if kwargs.get("device") is not None:
            # Factories and conversions: the bytes live on the base (or where placement
            # says); the place is virtual.
            real, placed = self.placement(kwargs["device"])
            if real != kwargs["device"]:
                kwargs = {**kwargs, "device": real}
        # storages made outside the mode (a view of one is no new one)
        devices, saw_host, outside = self.storages.inputs_where(args, kwargs)
        key = op_key(func)
        if len(devices) > 1 and not self.state.allow_cross and key not in _CROSS_DEVICE_KEYS:
            raise _two_devices(func, devices)
        if self._meta and key in _INDEX_RULE_KEYS:  # the meta kernels take other dtypes
            args = as_on_cuda(func, args)
        try:
            out = self.memo.run(func, args, kwargs) if self._meta else func(*args, **kwargs)
        except Exception as e:  # the innermost op is the one that failed: name it
            if getattr(e, "dpprof_op", None) is None:
                with contextlib.suppress(AttributeError, TypeError):
                    e.dpprof_op = getattr(getattr(func, "_schema", None), "name", str(func))  # type: ignore[attr-defined]
            raise
        if self.state.forced is not None:
            target = self.state.forced
        elif placed is not None:
            target = placed
        elif devices:
            target = min(devices)  # CPU scalars next to GPU tensors: the GPU wins
            self.state.last_device = target
        elif saw_host:
            target = HOST
        elif (self.state.last_device is not None
              and torch._C._current_graph_task_id() != -1):
            # a factory inside a backward node (``at::zeros`` in a backward formula): CUDA's
            # engine runs each node under its device's guard; here, the device of the
            # node's tensors, the last ones an op read
            target = self.state.last_device
        else:
            target = self.state.device  # a factory: the current device
        self._log(func, args, kwargs, out, target, devices, saw_host, key)
        return self._place(func, args, kwargs, out, target, outside)

    def _log(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any, target: int,
             devices: Set[int], saw_host: bool, key: int | None = None) -> None:
        """The op into the measured steps' op log (their predicted time), where it is on
        (``key``: the op's :func:`op_key`, where the caller has it)."""
        log = self.op_log
        if log is None or not log.on:
            return
        # a copy between devices: a copy op, or any op placed on another device (the
        # emulated .to(device) clones onto its target)
        state = self.state
        moves = state.forced is not None or (
            key if key is not None else op_key(func)) in _CROSS_DEVICE_KEYS
        sources = ({*devices, HOST} if saw_host else devices) if moves else _NO_SOURCES
        log.record(func, args, kwargs, out, target, sources, state.phase,
                   self.mirrors.mirrors_of(target))

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
        devices, saw_host, outside = self.storages.inputs_where(args, kwargs)
        state = self.state
        if len(devices) > 1 and not state.allow_cross and op_key(func) not in _CROSS_DEVICE_KEYS:
            raise _two_devices(func, devices)
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
            self.state.last_device = target
        elif outside or saw_host:
            return out  # the host's inputs only: the host's output
        elif state.last_device is not None and torch._C._current_graph_task_id() != -1:
            target = state.last_device  # a factory inside a backward node, as above
        else:
            target = state.device
        if target == HOST:
            return out
        self._log(func, args, kwargs, out, target, devices, saw_host)
        return self._place(func, args, kwargs, out, target, outside)

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
            self.storages.play(plan.before, target, live)
        self.storages.track_outputs(out, target, outside)
        if plan is not None:
            self.storages.play(plan.after, target, live)
        if func in BLAS_OPS and target != HOST:
            self._note_blas(func, target)
        return out

    def _note_blas(self, func: Any, device: int) -> None:
        """A cuBLAS op ran on ``device``: the first one of its thread's role places that
        handle's workspace (``getCurrentCUDABlasHandle`` allocates it at first use)."""
        role = (BLAS_BACKWARD if torch._C._current_graph_task_id() != -1
                else BLAS_WORKER if self.state.worker_thread else BLAS_FORWARD)
        at = len(self.storages.events)
        lt = func in LT_OPS
        stream = self.storages.stream_on(device)
        for d in self.mirrors.blas_devices(device):
            for r in ((role, BLAS_LT) if lt else (role,)):
                if not stream:
                    self.blas_first.setdefault((d, r), at)
                elif (d, r, stream) not in self.blas_side:
                    self.blas_side[(d, r, stream)] = (at, self.storages.tag_on(d))


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
# a thread the program or DataParallel's parallel_apply starts: a handle of its own, taken
# from the device's pool (one a thread alive at a time: a thread that ends gives it back, so
# the next replica thread on the device reuses it and its workspace)
BLAS_WORKER = "worker"
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
