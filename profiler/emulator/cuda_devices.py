"""The runtime under a :class:`dpprof.emulator.virtual_cuda.VirtualCuda`: ``device=cuda:k``
means virtual device k (:class:`CudaDevices`), the host stays real, and reading a meta
tensor's value gives a stated stand-in, counted per call site (:class:`StandIns`); ops
whose output shape depends on values stop with one line naming the fix
(:class:`DataDependentShapeError`)."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from dpprof.emulator.allocator import block_bytes
from dpprof.emulator.counting import HOST, SUBCLASS, subclass_in
from dpprof.emulator.identity import op_key, storage_key
from dpprof.emulator.small_values import SmallValues
from dpprof.emulator.vdevice import VirtualDevices

if TYPE_CHECKING:
    from dpprof.emulator.virtual_cuda import VirtualCuda

aten = torch.ops.aten

STAND_IN_FLOAT = 1.0
STAND_IN_INT = 1
STAND_IN_BOOL = False
STAND_INS = (
    f"values read from emulated tensors are stand-ins: floats {STAND_IN_FLOAT}, integers "
    f"{STAND_IN_INT}, booleans {STAND_IN_BOOL} (True where the line asks torch.isfinite), "
    "host copies (.cpu(), .numpy(), .tolist()) zeros; GradScaler finds no inf"
)

# Ops whose output shape depends on the values (meta tensors have none).
DATA_DEPENDENT = {
    aten.nonzero.default, aten.masked_select.default, aten.unique_consecutive.default,
    aten._unique2.default, aten.unique_dim.default, aten.repeat_interleave.Tensor,
    aten.nonzero_static.default, aten._unique.default,
}
# Factories whose values follow from their numeric arguments alone: over meta a read of their
# values (``.item()``, ``.tolist()``) is answered with the real numbers, recomputed on the host.
NUMERIC_FACTORIES = frozenset({
    aten.linspace.default, aten.logspace.default, aten.arange.default, aten.arange.start,
    aten.arange.start_step,
})

_NOT_SPLIT = object()
_DPPROF_DIR = str(Path(__file__).resolve().parents[1])
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)


FIRST_ADDRESS = 0x7F00_0000_0000  # where the stand-in addresses of meta storages begin
_PLAIN_OP, _CONVOLUTION_OP, _FOREACH_OP = 0, 1, 2
_LOCAL_SCALAR_OP, _DATA_DEPENDENT_OP, _INDEX_TENSOR_OP, _NUMERIC_FACTORY_OP = 3, 4, 5, 6
_TENSORLESS_OP = 7  # no tensor in, none out (record_function's): nothing to count
_COPY_OP = 8  # copy_: into a real host tensor from a virtual GPU's, a value read
# op_key(op) -> (op, its kind): asked once per op, keyed by identity (an OpOverload's
# __hash__ is Python: a call per look-up, on every op); the op is kept to check the key
_OP_KINDS: dict[int, tuple[Any, int]] = {}


def _op_kind(func: Any) -> int:
    """What the fast path of ``--compute`` must do for ``func`` besides counting."""
    found = _OP_KINDS.get(op_key(func))
    if found is not None and found[0] is func:
        return found[1]
    if func is aten.convolution.default:
        kind = _CONVOLUTION_OP
    elif func in (aten._local_scalar_dense.default, aten.is_nonzero.default,
                  aten.item.default):
        # is_nonzero (``bool(t)``) and item (``.item()``) decompose above the Python key,
        # except in code that runs below autograd (DTensor's dispatch) and under
        # ``torch.inference_mode`` (no autograd key): they reach the mode whole there
        kind = _LOCAL_SCALAR_OP
    elif func in DATA_DEPENDENT:
        kind = _DATA_DEPENDENT_OP
    elif func is aten.index.Tensor:
        kind = _INDEX_TENSOR_OP
    elif func is aten.copy_.default:
        kind = _COPY_OP
    elif func in NUMERIC_FACTORIES:
        kind = _NUMERIC_FACTORY_OP
    elif func.__name__.startswith("_foreach_"):
        kind = _FOREACH_OP
    elif _tensorless(func):
        kind = _TENSORLESS_OP
    else:
        kind = _PLAIN_OP
    _OP_KINDS[op_key(func)] = (func, kind)
    return kind


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


def caller_frame(also_skip: tuple[str, ...] = ()) -> FrameType | None:
    """The innermost frame outside torch and dpprof (the user's), and outside the files
    ``also_skip`` names."""
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if not (name.startswith(_TORCH_DIR) or name.startswith(_DPPROF_DIR)
                or name.startswith("<") or name in also_skip):
            return f
        f = f.f_back
    return None


def caller_site(also_skip: tuple[str, ...] = ()) -> str:
    """``file:line`` of the innermost frame outside torch and dpprof (the user's line), and
    outside the files ``also_skip`` names."""
    f = caller_frame(also_skip)
    return "?" if f is None else f"{f.f_code.co_filename}:{f.f_lineno}"


def in_dpprof(filename: str) -> bool:
    """Whether ``filename`` is one of dpprof's own source files."""
    return filename.startswith(_DPPROF_DIR)


def caller_line() -> str:
    """The source text of :func:`caller_site`'s line ("" where unknown)."""
    import linecache

    path, _, num = caller_site().rpartition(":")
    return linecache.getline(path, int(num)) if num.isdigit() else ""


@dataclass
class StandIns:
    """Values the emulation made up, counted by kind and by the user's line."""

    counts: dict[str, int] = field(default_factory=dict)
    sites: dict[str, int] = field(default_factory=dict)  # "file:line (kind)" -> count

    def add(self, kind: str, times: int = 1) -> None:
        """One more value of ``kind`` made up (``times``: for a mirrored DataParallel
        replica, once for each replica it stands for)."""
        self.counts[kind] = self.counts.get(kind, 0) + times
        key = f"{caller_site()} ({kind})"
        self.sites[key] = self.sites.get(key, 0) + times

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class CudaDevices(VirtualDevices):
    """The runtime under a :class:`VirtualCuda`: ``device=cuda:k`` means virtual device k,
    the host stays real, reading a meta tensor's value gives a stand-in."""

    def __init__(self, num_devices: int, base: str = "meta", real_host: bool = True,
                 fix: str = "rerun with --compute (the same emulation over CPU tensors, "
                 "real numbers)") -> None:
        super().__init__(num_devices, base)
        self.cuda: VirtualCuda | None = None
        # dpprof run: the script's host side is real (data loading); compare: the host
        # holds meta tensors too (the workload's batch, made on the host, is moved)
        self.real_host = real_host
        self.fix = fix
        self.stand_ins = StandIns()
        # storages made over meta by factories whose values follow from numbers alone
        # (linspace, arange, ...): their recipe, to answer a read with the real values
        self.numeric_recipes: dict[int, tuple[weakref.ref[Any], Any, Any, dict[str, Any]]] = {}
        self.in_dispatch = 0
        self.saw_convolution = False  # cuDNN's library is loaded where convolutions run
        # dpprof run over meta tensors: the real values of small tensors that follow from
        # host data, so that reading one back needs no stand-in
        self.small_values = SmallValues() if real_host and self.base.type == "meta" else None
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

    def host_stand_in(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A real host tensor of ``t``'s shape (zeros) for a value read from a virtual GPU,
        remembered as a stand-in (:meth:`is_emulated`)."""
        host = torch.zeros(t.shape, dtype=dtype or t.dtype, device="cpu")
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
        return self.device_of(t) != HOST

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
            return self.base, self._state.meta_device
        return self.base, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if types and (sub := subclass_in(types)) is not None:  # a DTensor, a FakeTensor
            return NotImplemented if sub == SUBCLASS else func(*args, **(kwargs or {}))
        if self._beside_real_host:
            # --compute with a real host: no meta tensor anywhere, so no stand-in, no
            # data-dependent shape and no small value to follow; the fast path
            kind = _op_kind(func)
            if kind == _CONVOLUTION_OP:
                self.saw_convolution = True
            elif kind == _FOREACH_OP:
                split = self._foreach_by_device(func, types, args, kwargs or {})
                if split is not _NOT_SPLIT:
                    return split
            self.in_dispatch += 1
            try:
                out = self.dispatch_beside_real_host(func, args, kwargs)
            finally:
                self.in_dispatch -= 1
            if self._host_stand_ins:
                self._follow_stand_ins(args, kwargs or {}, out)
            return out
        kind = _op_kind(func)  # the ops with rules of their own, looked up once
        if kind == _PLAIN_OP:
            pass
        elif kind == _TENSORLESS_OP:  # no storage to count, no device to read
            return func(*args, **(kwargs or {}))
        elif kind == _LOCAL_SCALAR_OP:
            if on_meta(args[0]):
                return self.stand_in_scalar(args[0])
        elif kind == _DATA_DEPENDENT_OP:
            if self.small_values is not None:
                shaped = self._by_values(func, types, args, kwargs or {})
                if shaped is not None:
                    return shaped
            if any(isinstance(a, torch.Tensor) and on_meta(a) for a in args):
                raise DataDependentShapeError(
                    f"{func.__name__} makes a tensor whose shape depends on the values, and "
                    f"the emulated tensors have none (meta tensors), at {caller_site()}; "
                    f"{self.fix}"
                )
        elif kind == _INDEX_TENSOR_OP:
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and on_meta(i)
                   for i in (args[1] if len(args) > 1 else ())):
                if self.small_values is not None:
                    shaped = self._by_values(func, types, args, kwargs or {})
                    if shaped is not None:
                        return shaped
                raise DataDependentShapeError(
                    "indexing with a boolean mask makes a tensor whose shape depends on the "
                    f"values, and the emulated tensors have none (meta tensors), at "
                    f"{caller_site()}; {self.fix}"
                )
        elif kind == _NUMERIC_FACTORY_OP:
            if self.base.type == "meta":
                out = self._dispatch(func, types, args, kwargs)
                st = out.untyped_storage()
                self.numeric_recipes[storage_key(st)] = (weakref.ref(st), func, args,
                                                          dict(kwargs or {}))
                return out
        elif kind == _CONVOLUTION_OP:
            self.saw_convolution = True
        elif kind == _FOREACH_OP:
            split = self._foreach_by_device(func, types, args, kwargs or {})
            if split is not _NOT_SPLIT:
                return split
        elif (kind == _COPY_OP and self.real_host and len(args) > 1
              and not on_meta(args[0]) and on_meta(args[1])):
            return self._copy_to_host(args[0], args[1], bool(
                args[2] if len(args) > 2 else (kwargs or {}).get("non_blocking")))
        out = self._dispatch(func, types, args, kwargs)
        if self.small_values is not None:
            self.small_values.follow(func, args, kwargs or {}, out)
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

    def _by_values(self, func: Any, types: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """An op whose output shape depends on the values, over inputs whose values are
        followed (:class:`SmallValues`): computed on the host, its output allocated on the
        inputs' GPU with the shape it has; None where the values are not known."""
        assert self.small_values is not None
        real = self.small_values.compute(func, args, kwargs)
        if not isinstance(real, torch.Tensor):
            return None
        where = [self.device_of(a) for a in _tensors_in(args) if on_meta(a)]
        with self.placing_on(where[0] if where else self.current_device):
            out = self._dispatch(aten.empty_strided.default, types,
                                 (list(real.shape), list(real.stride())),
                                 {"dtype": real.dtype, "device": self.base})
        self.small_values.keep(out, real)
        return out

    def _dispatch(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        self.in_dispatch += 1
        try:
            return self.count_dispatch(func, types, args, kwargs)
        finally:
            self.in_dispatch -= 1

    def _foreach_by_device(self, func: Any, types: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """A ``_foreach_*`` op over tensors of several virtual devices, run per device as
        the optimizers run it on GPUs (``_group_tensors_by_device_and_dtype`` groups by
        the real device, which is the same for every emulated tensor)."""
        lists = [a for a in args if isinstance(a, (list, tuple)) and a
                 and isinstance(a[0], torch.Tensor)]
        if not lists:
            return _NOT_SPLIT
        n = len(lists[0])
        where = [self.device_of(t) for t in lists[0]]
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
        self.stand_ins.add(kind, self.multiplicity(self.device_of(t)))

    def stand_in_scalar(self, t: torch.Tensor) -> bool | int | float:
        real = self.real_values(t)
        if real is not None:
            return real.item()
        if t.dtype == torch.bool:
            if "isfinite" in caller_line():  # torch.isfinite(loss): emulated values are
                self.stand_in("bool (isfinite)", t)
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


def _tensors_in(args: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(b for b in a if isinstance(b, torch.Tensor))
    return found
