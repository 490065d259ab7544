"""The runtime under a :class:`dpprof.emulator.virtual_cuda.VirtualCuda`: ``device=cuda:k``
means virtual device k (:class:`CudaDevices`), the host stays real, and reading a meta
tensor's value gives a stated stand-in, counted per call site (:class:`StandIns`), and an
op whose output's shape depends on values takes the shape the values followed give it, else
the stand-ins' (:mod:`dpprof.emulator.value_shapes`); without values followed (no real
host) it stops with one line naming the fix (:class:`DataDependentShapeError`).

The ops with rules of their own are registered per op in :data:`RULES` (and, beside a real
host, :data:`REAL_HOST_RULES`), as ``FakeTensorMode`` registers its op implementations;
every other op is run and counted by the default rule (:meth:`CudaDevices.
dispatch_counted`)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from itertools import chain
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import _disable_current_modes

from dpprof.emulator import same_program
from dpprof.emulator.allocator_config import block_bytes
from dpprof.emulator.call_sites import caller_line, caller_site
from dpprof.emulator.dispatch_state import HOST
from dpprof.emulator.identity import storage_key
from dpprof.emulator.op_rules import OpRules
from dpprof.emulator.small_values import SmallValues
from dpprof.emulator.stand_in_values import (
    STAND_IN_BOOL,
    STAND_IN_FLOAT,
    STAND_IN_INT,
    StandIns,
)
from dpprof.emulator.user_meta import CANNOT_COPY_OUT, UserMeta, asked_by_program
from dpprof.emulator.value_shapes import by_mask_positions, by_values
from dpprof.emulator.virtual_devices import VirtualDevices
from dpprof.emulator.zero_pages import host_zeros

aten = torch.ops.aten

# Ops whose output shape depends on the values (meta tensors have none).
DATA_DEPENDENT = {
    aten.nonzero.default, aten.masked_select.default, aten.unique_consecutive.default,
    aten._unique2.default, aten.unique_dim.default, aten.repeat_interleave.Tensor,
    aten.nonzero_static.default, aten._unique.default, aten.bincount.default,
    # composites that reach the mode whole under torch.inference_mode (no autograd key to
    # decompose them at): x.nonzero(as_tuple=True), torch.where(mask), torch.argwhere
    aten.nonzero_numpy.default, aten.where.default, aten.argwhere.default,
}
# what torch's Meta kernel made from a fake kernel raises where the fake kernel asks for a
# data-dependent size (torch/_library/fake_impl.py)
DATA_DEPENDENT_FAKE = "output Tensor with data-dependent shape"
# Factories whose values follow from their numeric arguments alone: over meta a read of their
# values (``.item()``, ``.tolist()``) is answered with the real numbers, recomputed on the host.
NUMERIC_FACTORIES = frozenset({
    aten.linspace.default, aten.logspace.default, aten.arange.default, aten.arange.start,
    aten.arange.start_step,
})

_NOT_SPLIT = object()


FIRST_ADDRESS = 0x7F00_0000_0000  # where the stand-in addresses of meta storages begin


_SCALAR_KINDS = frozenset({"StringType", "IntType", "FloatType", "BoolType", "NoneType",
                           "NumberType", "ClassType"})


def _no_tensor_in(ty: Any) -> bool:
    """A schema type that cannot hold a tensor (strings, numbers, script objects, and
    optionals and lists of those; not generic types)."""
    kind = ty.kind()
    if kind in ("OptionalType", "ListType"):
        return all(_no_tensor_in(t) for t in ty.containedTypes())
    return kind in _SCALAR_KINDS


def _tensorless(func: Any) -> bool:
    """Whether ``func``'s schema takes and returns no tensor (``profiler::
    _record_function_enter_new``, which FSDP2 calls around each of its hooks)."""
    try:
        schema = func._schema
    except AttributeError:
        return False
    return all(_no_tensor_in(a.type) for a in (*schema.arguments, *schema.returns))


class DataDependentShapeError(RuntimeError):
    """An op whose output shape depends on tensor values, which meta tensors do not have."""


class CudaIndices(Protocol):
    """What the runtime asks of the emulated ``torch.cuda`` over it: which virtual device
    a ``cuda`` device names (``CUDA_VISIBLE_DEVICES`` and the current device applied)."""

    def index_of(self, device: Any) -> int: ...


class CudaDevices(VirtualDevices):
    """The runtime under a :class:`VirtualCuda`: ``device=cuda:k`` means virtual device k,
    the host stays real, reading a meta tensor's value gives a stand-in.

    No real GPU is involved: these are the virtual devices (their tensors meta or CPU,
    counted by the same dispatch, ledgers and mirrors) as ``torch.cuda`` names them, so
    the DataParallel re-enactment and the FSDP2 patches take it as the
    :class:`VirtualDevices` it is; the cuda backend measures real GPUs without it."""

    def __init__(self, num_devices: int, base: str = "meta", real_host: bool = True,
                 fix: str = "rerun with --compute (the same emulation over CPU tensors, "
                 "real numbers)") -> None:
        super().__init__(num_devices, base)
        self.cuda: CudaIndices | None = None  # the VirtualCuda playing torch.cuda
        # dpprof run: the script's host side is real (data loading); compare: the host
        # holds meta tensors too (the workload's batch, made on the host, is moved)
        self.real_host = real_host
        self.fix = fix
        self.stand_ins = StandIns()
        # storages made over meta by factories whose values follow from numbers alone
        # (linspace, arange, ...): their recipe, to answer a read with the real values
        self.numeric_recipes: dict[int, tuple[weakref.ref[Any], Any, Any, dict[str, Any]]] = {}
        self.saw_convolution = False  # cuDNN's library is loaded where convolutions run
        # a convolution ran with torch.backends.cudnn.benchmark on: on a GPU its shape's first
        # call times cuDNN's engines in a workspace this emulation does not size
        self.cudnn_benchmarked = False
        # dpprof run over meta tensors: the real values of small tensors that follow from
        # host data, so that reading one back needs no stand-in
        self.small_values = SmallValues() if real_host and self.base.type == "meta" else None
        # lines where a finiteness check's result was too large to follow (assume_checked):
        # a boolean read there answers as the check would
        self._unfollowed_checks: set[str] = set()
        # host copies made up for values read from virtual GPUs (zeros): id of the
        # storage -> a weak reference to it, so that nothing saves them as real values
        self._host_stand_ins: dict[int, weakref.ref[Any]] = {}
        # host storages in page-locked memory (``pin_memory()``, a non-blocking copy from
        # a GPU): id -> a weak reference to the storage
        self._pinned: dict[int, weakref.ref[Any]] = {}
        # stand-in addresses of meta storages (``data_ptr``): id -> (weak reference, address)
        self._addresses: dict[int, tuple[weakref.ref[Any], int]] = {}
        self._next_address = FIRST_ADDRESS
        # dpprof run --compute: CPU tensors everywhere, the host's not tracked
        self._beside_real_host = real_host and self.base.type == "cpu"
        # the program's own meta tensors (a model built on meta before to_empty): on no
        # device, as on a GPU machine
        self.user_meta = UserMeta()

    def host_stand_in(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A real host tensor of ``t``'s shape (zeros) for a value read from a virtual GPU,
        remembered as a stand-in (:meth:`is_emulated`)."""
        host = host_zeros(t.shape, dtype or t.dtype)
        self._remember_stand_in(host.untyped_storage())
        return host

    def remember_emulated_on_host(self, t: torch.Tensor) -> None:
        """``t``, a host tensor, holds values the emulation computed (``--compute``'s copy of
        a virtual GPU's tensor): :meth:`is_emulated`, as a stand-in is."""
        self._remember_stand_in(t.untyped_storage())

    def _remember_stand_in(self, st: Any) -> None:
        key = storage_key(st)
        self._host_stand_ins[key] = weakref.ref(
            st, lambda _ref: self._host_stand_ins.pop(key, None))

    def _is_stand_in(self, t: torch.Tensor) -> bool:
        st = t.untyped_storage()
        ref = self._host_stand_ins.get(storage_key(st))
        return ref is not None and ref() is st

    def _follow_stand_ins(self, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        """What the host computes from a stand-in (a grid of images, a scaled copy) holds
        no value of the program's either: its storages become stand-ins, so a file made of
        them (``torchvision.utils.save_image`` of a host copy) is not written."""
        def tensors(xs: Any) -> Iterator[torch.Tensor]:
            for x in xs:
                if isinstance(x, torch.Tensor):
                    yield x
                elif isinstance(x, (list, tuple)):
                    yield from (y for y in x if isinstance(y, torch.Tensor))

        if not any(self._is_stand_in(t) for t in tensors(chain(args, kwargs.values()))
                   if real_device(t).type == "cpu"):
            return
        outs = [out] if isinstance(out, torch.Tensor) else out
        if isinstance(outs, (list, tuple)):
            for o in tensors(outs):
                if real_device(o).type == "cpu":
                    self._remember_stand_in(o.untyped_storage())

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a host tensor) remembered as held in page-locked memory, as CUDA's host
        allocator would hold it (:meth:`is_pinned`)."""
        st = t.untyped_storage()
        key = storage_key(st)
        self._pinned[key] = weakref.ref(st, lambda _ref: self._pinned.pop(key, None))
        return t

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is page-locked host memory (:meth:`pin`)."""
        st = t.untyped_storage()
        ref = self._pinned.get(storage_key(st))
        return ref is not None and ref() is st

    def address_of(self, st: Any) -> int:
        """A stand-in address for a meta storage of a virtual GPU (``data_ptr()``): meta
        storages all answer 0, and code that tells shared storages apart by address
        (safetensors' and Hugging Face's tied-weight checks before a save) would take every
        parameter for one; here each live storage has its own, disjoint from the others',
        as the caching allocator's blocks are. 0 for an empty storage, as on a GPU."""
        nbytes = st.nbytes()
        if not nbytes:
            return 0
        key = storage_key(st)
        found = self._addresses.get(key)
        if found is not None and found[0]() is st:
            return found[1]
        address = self._next_address
        self._next_address += block_bytes(nbytes)
        self._addresses[key] = (weakref.ref(st, lambda _ref: self._addresses.pop(key, None)),
                                address)
        return address

    def is_emulated(self, t: torch.Tensor) -> bool:
        """Whether ``t`` holds no value of the program's own: a tensor of a virtual GPU
        (meta bytes, or CPU bytes the emulation computed) or a host stand-in for one."""
        if real_device(t).type == "meta":
            return True
        if self._is_stand_in(t):
            return True
        return self.storages.device_of(t) != HOST

    def placement(self, device: torch.device) -> tuple[torch.device, int | None]:
        if isinstance(device, str):
            device = torch.device(device)
        if device.type == "cuda":
            cuda = self.cuda
            index = cuda.index_of(device) if cuda is not None else (device.index or 0)
            return self.base, index
        if device.type == "cpu":
            # the host is real; over CPU tensors "cpu" is also every virtual tensor's device
            if not self.real_host:
                return self.base, None
            return torch.device("cpu"), (HOST if self.base.type == "meta" else None)
        if device.type == "meta" and self.cuda is not None:
            # x.device of an emulated tensor seen by torch's own code: the current GPU
            # where a caller said which (meta_on), else the rules of dispatch
            return self.base, self.state.meta_device
        return self.base, None

    def dispatch_one(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        user_meta = self.user_meta
        if user_meta.asking:
            return self._on_user_meta(func, args, kwargs or {})
        if user_meta:
            if (func is aten.copy_.default and user_meta.holds(args[1])
                    and not user_meta.holds(args[0])):  # out of a meta tensor: torch refuses
                raise NotImplementedError(CANNOT_COPY_OUT)
            if user_meta.reads(args, kwargs):
                return self._on_user_meta(func, args, kwargs or {})
        if self._beside_real_host:
            # --compute with a real host: no meta tensor anywhere, so no stand-in, no
            # data-dependent shape and no small value to follow; the fast path
            return REAL_HOST_RULES.rule_for(func)(self, func, types, args, kwargs)
        return RULES.rule_for(func)(self, func, types, args, kwargs)

    def asking_for(self, device: Any) -> contextlib.AbstractContextManager[None]:
        """The call's new tensors are the program's own meta tensors where ``device`` is
        the program asking for them (:func:`dpprof.emulator.user_meta.asked_by_program`),
        not torch's own Python code while this emulation dispatches (``device=a.device``,
        meta underneath); else nothing changes."""
        if not self.state.in_dispatch and asked_by_program(device):
            return self.user_meta.asked()
        return contextlib.nullcontext()

    def _on_user_meta(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """An op that makes or computes the program's own meta tensors: run on meta,
        counted on no device."""
        if kwargs.get("device") is not None:
            kwargs = {**kwargs, "device": torch.device("meta")}
        self.state.in_dispatch += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.state.in_dispatch -= 1
        self.user_meta.remember(out)
        return out

    def dispatch_counted(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        """The op run and counted, what it computes from host values followed: the rule of
        every op without one of its own (:data:`RULES`)."""
        try:
            out = self._dispatch(func, types, args, kwargs)
        except RuntimeError as e:
            # an op whose Meta kernel is a fake kernel asking for a data-dependent size
            # (torchvision's nms): the shape its host kernel gives, as for aten's own
            if DATA_DEPENDENT_FAKE not in str(e):
                raise
            shaped = by_values(self, func, types, args, kwargs or {}, stand_ins=True)
            if shaped is None:
                raise
            return shaped
        if self.small_values is not None:
            self.small_values.follow(func, args, kwargs or {}, out)
        if self._host_stand_ins:
            self._follow_stand_ins(args, kwargs or {}, out)
        return out

    def dispatch_beside_host(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        """The op run and counted beside a real host (``--compute``): the rule of every op
        without one of its own (:data:`REAL_HOST_RULES`)."""
        self.state.in_dispatch += 1
        try:
            out = self.dispatch_beside_real_host(func, args, kwargs)
        finally:
            self.state.in_dispatch -= 1
        if self._host_stand_ins:
            self._follow_stand_ins(args, kwargs or {}, out)
        return out

    def _copy_to_host(self, dst: torch.Tensor, src: torch.Tensor,
                      non_blocking: bool) -> torch.Tensor:
        """``host.copy_(gpu)`` (``load_state_dict`` of a checkpoint loaded onto a GPU into a
        model still on the host, ``out[i].copy_(loss)``): a value read from a virtual GPU,
        as ``.cpu()`` reads one: its real values where they are followed, else a stated
        stand-in (zeros); ``dst`` then holds no value of the program's own
        (:meth:`is_emulated`), so that nothing saves it as real."""
        values = self.real_values(src)
        if values is None:
            self.stand_in("host copy", src)
            self._remember_stand_in(dst.untyped_storage())
            values = torch.zeros(src.shape, dtype=src.dtype, device="cpu")
        with _disable_current_modes():
            dst.copy_(values, non_blocking=non_blocking)
        return dst

    def _dispatch(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        self.state.in_dispatch += 1
        try:
            return self.count_dispatch(func, types, args, kwargs)
        finally:
            self.state.in_dispatch -= 1

    def _foreach_by_device(self, func: Any, types: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """A ``_foreach_*`` op over tensors of several virtual devices, run per device as
        the optimizers run it on GPUs (``_group_tensors_by_device_and_dtype`` groups by
        the real device, which is the same for every emulated tensor)."""
        lists = [a for a in args if isinstance(a, (list, tuple)) and a
                 and isinstance(a[0], torch.Tensor)]
        if not lists:
            return _NOT_SPLIT
        n = len(lists[0])
        where = [self.storages.device_of(t) for t in lists[0]]
        if len(set(where)) < 2:
            return _NOT_SPLIT
        groups: dict[int, list[int]] = {}
        for i, d in enumerate(where):
            groups.setdefault(d, []).append(i)
        results: list[Any] = [None] * n
        single: Any = None
        for idx in groups.values():
            part = [type(a)(a[i] for i in idx) if isinstance(a, (list, tuple)) and len(a) == n
                    else a for a in args]
            out = self.__torch_dispatch__(func, types, tuple(part), kwargs)
            if isinstance(out, (list, tuple)) and len(out) == len(idx):
                for i, o in zip(idx, out, strict=True):
                    results[i] = o
            else:
                single = out
        return results if any(r is not None for r in results) else single

    def real_values(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t``'s real values on the host when its storage was made from numbers alone
        (timm's drop-path rates: ``linspace(0, rate, depth)`` read in ``__init__``)."""
        if self.small_values is not None:
            small = self.small_values.value_of(t)
            if small is not None:
                return small.clone()
        found = self.numeric_recipes.get(storage_key(t.untyped_storage()))
        if found is None or found[0]() is not t.untyped_storage():
            return None
        _, func, args, kwargs = found
        with _disable_current_modes():
            full = func(*args, **{**kwargs, "device": torch.device("cpu")})
            return full.as_strided(t.shape, t.stride(), t.storage_offset()).to(t.dtype)

    def stand_in(self, kind: str, t: torch.Tensor) -> None:
        """Count a value of ``t`` made up, once per device ``t``'s storage stands for."""
        self.stand_ins.add(kind, self.mirrors.multiplicity(self.storages.device_of(t)))

    def assume_checked(self, t: torch.Tensor, value: bool, check: str) -> None:
        """``t``, the result of a finiteness check (``torch.isfinite(loss)``) of values the
        emulation has not: every element ``value``, as for finite values (the stand-ins'
        rule), known from here on (``.all()`` of it, ``not`` of it), so that another read on
        the line (``loss == 0``) keeps its own answer."""
        small = self.small_values
        if small is None or self.real_values(t) is not None:
            return
        self.stand_in(f"bool ({check})", t)
        if t.untyped_storage().nbytes() <= small.max_index_bytes:
            # on the host (a script's default device would put it on a virtual GPU)
            small.keep(t, torch.full(t.shape, value, dtype=torch.bool, device="cpu"))
        if small.value_of(t) is None:
            self.unfollowed_check()

    def unfollowed_check(self) -> None:
        """A finiteness check on the caller's line whose result is not followed: a boolean
        read there answers as the check would (True, finite)."""
        self._unfollowed_checks.add(caller_site())

    def stand_in_scalar(self, t: torch.Tensor) -> bool | int | float:
        real = self.real_values(t)
        if real is not None:
            return real.item()
        if t.dtype == torch.bool:
            if "isfinite" in caller_line() and (self.small_values is None
                                                or caller_site() in self._unfollowed_checks):
                self.stand_in("bool (isfinite)", t)  # emulated values are finite
                return True
            self.stand_in("bool", t)
            return STAND_IN_BOOL
        if t.is_floating_point() or t.is_complex():
            self.stand_in("item", t)
            return STAND_IN_FLOAT
        self.stand_in("item", t)
        return STAND_IN_INT


# torch's own functions, taken at import, before any patch (the emulation replaces them)
ORIGINALS: dict[str, Any] = {
    "to": torch.Tensor.to,
    "tolist": torch.Tensor.tolist,
    "numpy": torch.Tensor.numpy,
    "device": torch._C.TensorBase.__dict__["device"],
    "tensor": torch.tensor,
    "as_tensor": torch.as_tensor,
}


def real_device(t: torch.Tensor) -> torch.device:
    """The device the tensor's bytes are on (``meta`` or ``cpu`` for emulated tensors)."""
    return ORIGINALS["device"].__get__(t)  # type: ignore[no-any-return]


# the bytes are on meta: Tensor.is_meta as torch answers it (the emulation patches the
# property); no torch.device is made (reading ``device`` makes one, ten times the cost)
on_meta: Callable[[torch.Tensor], bool] = torch._C.TensorBase.__dict__["is_meta"].__get__


# ---- the ops with rules of their own --------------------------------------------------

RULES: OpRules[CudaDevices] = OpRules(CudaDevices.dispatch_counted)
# beside a real host (--compute) only these; every other op: CudaDevices.dispatch_beside_host
REAL_HOST_RULES: OpRules[CudaDevices] = OpRules(CudaDevices.dispatch_beside_host)


def _is_foreach(func: Any) -> bool:
    return func.__name__.startswith("_foreach_")  # type: ignore[no-any-return]


@RULES.register(aten.convolution.default)
def _convolution(mode: CudaDevices, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
    _saw_convolution(mode)
    return mode.dispatch_counted(func, types, args, kwargs)


@REAL_HOST_RULES.register(aten.convolution.default)
def _convolution_beside_host(mode: CudaDevices, func: Any, types: Any, args: Any,
                             kwargs: Any) -> Any:
    _saw_convolution(mode)
    return mode.dispatch_beside_host(func, types, args, kwargs)


def _saw_convolution(mode: CudaDevices) -> None:
    mode.saw_convolution = True  # cuDNN's library is loaded where convolutions run
    mode.cudnn_benchmarked |= torch.backends.cudnn.benchmark


@RULES.register(_is_foreach)
def _foreach(mode: CudaDevices, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
    split = mode._foreach_by_device(func, types, args, kwargs or {})
    if split is not _NOT_SPLIT:
        return split
    return mode.dispatch_counted(func, types, args, kwargs)


@REAL_HOST_RULES.register(_is_foreach)
def _foreach_beside_host(mode: CudaDevices, func: Any, types: Any, args: Any,
                         kwargs: Any) -> Any:
    split = mode._foreach_by_device(func, types, args, kwargs or {})
    if split is not _NOT_SPLIT:
        return split
    return mode.dispatch_beside_host(func, types, args, kwargs)


# is_nonzero (``bool(t)``) and item (``.item()``) decompose above the Python key, except in
# code that runs below autograd (DTensor's dispatch) and under ``torch.inference_mode`` (no
# autograd key): they reach the mode whole there
@RULES.register(aten._local_scalar_dense.default, aten.is_nonzero.default,
                aten.item.default)
def _local_scalar(mode: CudaDevices, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
    if on_meta(args[0]):
        return mode.stand_in_scalar(args[0])
    return mode.dispatch_counted(func, types, args, kwargs)


# torch.allclose and torch.equal answer a bool in C++ (no Meta kernel reads one): played as
# CUDA runs them, the comparison's tensors allocated and the bool read from them (followed
# values, else a stand-in)
@RULES.register(aten.allclose.default, aten.equal.default)
def _compared(mode: CudaDevices, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
    a, b = args[0], args[1]
    if not (on_meta(a) or on_meta(b)):
        return mode.dispatch_counted(func, types, args, kwargs)
    if func is aten.equal.default:
        if a.shape != b.shape:  # cuda_equal: no kernel runs
            return False
        same = mode.dispatch_counted(aten.eq.Tensor, types, (a, b), {})
    else:
        same = mode.dispatch_counted(aten.isclose.default, types, args, kwargs or {})
    return bool(mode.stand_in_scalar(mode.dispatch_counted(aten.all.default, types, (same,), {})))


@RULES.register(*DATA_DEPENDENT)
def _data_dependent(mode: CudaDevices, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
    shaped = by_values(mode, func, types, args, kwargs or {}, stand_ins=True)
    if shaped is not None:
        return shaped
    if any(isinstance(a, torch.Tensor) and on_meta(a) for a in args):
        raise DataDependentShapeError(
            f"{func.__name__} makes a tensor whose shape depends on the values, and "
            f"the emulated tensors have none (meta tensors), at {caller_site()}; "
            f"{mode.fix}"
        )
    return mode.dispatch_counted(func, types, args, kwargs)


@RULES.register(aten.index.Tensor)
def _index_tensor(mode: CudaDevices, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
    if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and on_meta(i)
           for i in (args[1] if len(args) > 1 else ())):
        shaped = by_values(mode, func, types, args, kwargs or {})
        if shaped is None:
            shaped = by_mask_positions(mode, func, types, args, kwargs or {}, stand_ins=True)
        if shaped is not None:
            return shaped
        raise DataDependentShapeError(
            "indexing with a boolean mask makes a tensor whose shape depends on the "
            f"values, and the emulated tensors have none (meta tensors), at "
            f"{caller_site()}; {mode.fix}"
        )
    return mode.dispatch_counted(func, types, args, kwargs)


@RULES.register(*same_program.COLLECTIVES)
def _collective(mode: CudaDevices, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
    out = mode.dispatch_counted(func, types, args, kwargs)
    if mode.small_values is not None:
        mode.small_values.reduce_followed(*same_program.contributions(func, args, out))
    return out


@REAL_HOST_RULES.register(*same_program.COLLECTIVES)
def _collective_beside_host(mode: CudaDevices, func: Any, types: Any, args: Any,
                            kwargs: Any) -> Any:
    out = mode.dispatch_beside_host(func, types, args, kwargs)
    same_program.reduce_in_place(*same_program.contributions(func, args, out))
    return out


@RULES.register(*NUMERIC_FACTORIES)
def _numeric_factory(mode: CudaDevices, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
    if mode.base.type != "meta":
        return mode.dispatch_counted(func, types, args, kwargs)
    out = mode._dispatch(func, types, args, kwargs)
    if mode.small_values is not None and mode.small_values.keep_made(func, args, kwargs or {}, out):
        return out  # its values followed: ops on it carry them (an index into a mask)
    st = out.untyped_storage()
    mode.numeric_recipes[storage_key(st)] = (weakref.ref(st), func, args, dict(kwargs or {}))
    return out


@RULES.register(aten.copy_.default)
def _copy(mode: CudaDevices, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
    # copy_ into a real host tensor from a virtual GPU's: a value read
    if mode.real_host and len(args) > 1 and not on_meta(args[0]) and on_meta(args[1]):
        return mode._copy_to_host(args[0], args[1], bool(
            args[2] if len(args) > 2 else (kwargs or {}).get("non_blocking")))
    return mode.dispatch_counted(func, types, args, kwargs)


@RULES.register(_tensorless)
def _no_tensor(mode: CudaDevices, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
    # no tensor in, none out (record_function's): no storage to count, no device to read
    return func(*args, **(kwargs or {}))
