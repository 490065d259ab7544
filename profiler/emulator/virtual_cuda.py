"""A CUDA that is not there: ``torch.cuda`` played by virtual devices, in any torch build.

While a :class:`VirtualCuda` is active, a program written for GPUs runs unchanged:

* ``torch.cuda`` and ``torch.accelerator`` report ``num_gpus`` GPUs of the chosen model
  (``is_available``, ``device_count``, ``get_device_properties/name/capability``,
  ``mem_get_info``, ``current_device``/``set_device``/``device(...)``), after
  ``CUDA_VISIBLE_DEVICES`` (read when the program first asks, as CUDA reads it at
  initialisation, so a script that sets it before its first CUDA call is honoured);
* tensors created on, or moved to, ``"cuda"``, ``"cuda:k"``, ``torch.device("cuda", k)``
  (``.cuda()``, ``.to(...)``, ``torch.tensor(..., device=...)``, factories' ``device=``,
  ``Module.to/cuda``) live on virtual device ``k`` of a :class:`VirtualDevices` runtime, over
  meta tensors (memory only) or CPU tensors (``base="cpu"``: real numbers); they report
  ``device == cuda:k`` and ``is_cuda``; the host side of the program stays real;
* ``torch.cuda.memory_allocated()`` and friends answer from the emulator; streams, events,
  ``synchronize``, ``empty_cache``, seeds, ``pin_memory`` and ``non_blocking`` behave;
* ``.item()``, ``bool()``, ``float()``, ``.tolist()``, ``.numpy()`` and ``.cpu()`` of a meta
  tensor answer with stated stand-ins (floats 1.0, integers 1, booleans False, host copies
  zeros), counted per call site; ops whose output shape depends on values (``nonzero``,
  boolean masks) stop with one line naming the fix;
* ``nn.DataParallel`` / ``nn.parallel.data_parallel`` are re-enacted by
  :mod:`dpprof.emulator.data_parallel` and :mod:`dpprof.emulator.ddp`.

Where the hooks are: a CPU-only build raises "Torch not compiled with CUDA enabled" from
``torch.cuda._lazy_init``, which C++ calls (``torch::utils::device_lazy_init``) before a
factory with a CUDA ``device=`` reaches the dispatcher; with it replaced, the factory
reaches the runtime's ``TorchDispatchMode``, which maps the device
(:meth:`VirtualDevices.placement`). ``Tensor.to``/``cuda``/``cpu`` and ``torch.tensor`` /
``as_tensor`` fail earlier (a CUDA device guard in C++), so they are replaced at the Python
API. Everything is restored on exit.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

from dpprof.emulator.allocator import block_bytes
from dpprof.emulator.catalog import GpuSpec, lookup_gpu
from dpprof.emulator.patcher import Patcher, own_attribute, put
from dpprof.emulator.small_values import SmallValues
from dpprof.emulator.standins import load_real, standing_in
from dpprof.emulator.counting import HOST, SUBCLASS, subclass_in
from dpprof.emulator.vdevice import VirtualDevices

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
# id(op) -> (op, its kind): asked once per op; keyed by identity because an OpOverload's
# __hash__ is Python (a call per look-up, on every op); the op is kept to check the id
_OP_KINDS: dict[int, tuple[Any, int]] = {}


def _op_kind(func: Any) -> int:
    """What the fast path of ``--compute`` must do for ``func`` besides counting."""
    found = _OP_KINDS.get(id(func))
    if found is not None and found[0] is func:
        return found[1]
    if func is aten.convolution.default:
        kind = _CONVOLUTION_OP
    elif func is aten._local_scalar_dense.default:
        kind = _LOCAL_SCALAR_OP
    elif func in DATA_DEPENDENT:
        kind = _DATA_DEPENDENT_OP
    elif func is aten.index.Tensor:
        kind = _INDEX_TENSOR_OP
    elif func in NUMERIC_FACTORIES:
        kind = _NUMERIC_FACTORY_OP
    elif func.__name__.startswith("_foreach_"):
        kind = _FOREACH_OP
    else:
        kind = _PLAIN_OP
    _OP_KINDS[id(func)] = (func, kind)
    return kind


class DataDependentShapeError(RuntimeError):
    """An op whose output shape depends on tensor values, which meta tensors do not have."""


def caller_site() -> str:
    """``file:line`` of the innermost frame outside torch and dpprof (the user's line)."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if not (name.startswith(_TORCH_DIR) or name.startswith(_DPPROF_DIR)
                or name.startswith("<")):
            return f"{name}:{f.f_lineno}"
        f = f.f_back  # type: ignore[assignment]
    return "?"


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
        # stand-in addresses of meta storages (``data_ptr``): id -> (weak reference, address)
        self._addresses: dict[int, tuple[weakref.ref[Any], int]] = {}
        self._next_address = FIRST_ADDRESS
        # dpprof run --compute: CPU tensors everywhere, the host's not tracked
        self._beside_real_host = real_host and self.base.type == "cpu"

    def host_stand_in(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A real host tensor of ``t``'s shape (zeros) for a value read from a virtual GPU,
        remembered as a stand-in (:meth:`is_emulated`)."""
        host = torch.zeros(t.shape, dtype=dtype or t.dtype, device="cpu")
        st = host.untyped_storage()
        key = id(st)
        self._host_stand_ins[key] = weakref.ref(
            st, lambda _ref: self._host_stand_ins.pop(key, None))
        return host

    def address_of(self, st: Any) -> int:
        """A stand-in address for a meta storage of a virtual GPU (``data_ptr()``): meta
        storages all answer 0, and code that tells shared storages apart by address
        (safetensors' and Hugging Face's tied-weight checks before a save) would take every
        parameter for one; here each live storage has its own, disjoint from the others',
        as the caching allocator's blocks are. 0 for an empty storage, as on a GPU."""
        nbytes = st.nbytes()
        if not nbytes:
            return 0
        key = id(st)
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
        st = t.untyped_storage()
        ref = self._host_stand_ins.get(id(st))
        if ref is not None and ref() is st:
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
            return self.base, None
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
                return self.dispatch_beside_real_host(func, args, kwargs)
            finally:
                self.in_dispatch -= 1
        kind = _op_kind(func)  # the ops with rules of their own, looked up once
        if kind == _PLAIN_OP:
            pass
        elif kind == _LOCAL_SCALAR_OP:
            if _is_meta(args[0]):
                return self.stand_in_scalar(args[0])
        elif kind == _DATA_DEPENDENT_OP:
            if self.small_values is not None:
                shaped = self._by_values(func, types, args, kwargs or {})
                if shaped is not None:
                    return shaped
            if any(isinstance(a, torch.Tensor) and _is_meta(a) for a in args):
                raise DataDependentShapeError(
                    f"{func.__name__} makes a tensor whose shape depends on the values, and "
                    f"the emulated tensors have none (meta tensors), at {caller_site()}; "
                    f"{self.fix}"
                )
        elif kind == _INDEX_TENSOR_OP:
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and _is_meta(i)
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
                self.numeric_recipes[id(st)] = (weakref.ref(st), func, args, dict(kwargs or {}))
                return out
        elif kind == _CONVOLUTION_OP:
            self.saw_convolution = True
        elif kind == _FOREACH_OP:
            split = self._foreach_by_device(func, types, args, kwargs or {})
            if split is not _NOT_SPLIT:
                return split
        out = self._dispatch(func, types, args, kwargs)
        if self.small_values is not None:
            self.small_values.follow(func, args, kwargs or {}, out)
        return out

    def _by_values(self, func: Any, types: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """An op whose output shape depends on the values, over inputs whose values are
        followed (:class:`SmallValues`): computed on the host, its output allocated on the
        inputs' GPU with the shape it has; None where the values are not known."""
        assert self.small_values is not None
        real = self.small_values.compute(func, args, kwargs)
        if not isinstance(real, torch.Tensor):
            return None
        where = [self.device_of(a) for a in _tensors_in(args) if _is_meta(a)]
        with self.placing_on(where[0] if where else self.current_device):
            out = self._dispatch(aten.empty_strided.default, types,
                                 (list(real.shape), list(real.stride())),
                                 {"dtype": real.dtype, "device": self.base})
        self.small_values.keep(out, real)
        return out

    def _dispatch(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        self.in_dispatch += 1
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
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
        found = self.numeric_recipes.get(id(t.untyped_storage()))
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


# ---- crossings with autograd -----------------------------------------------------------------


class _Cross(torch.autograd.Function):
    """``t.to(device)`` between the host and virtual devices: forward copies to the target,
    backward copies the gradient back (as CUDA's ``_to_copy`` backward does)."""

    @staticmethod
    def forward(ctx: Any, vc: VirtualCuda, t: torch.Tensor, index: int,  # type: ignore[override]
                dtype: torch.dtype | None) -> torch.Tensor:
        ctx.vc = vc
        ctx.source = vc.rt.device_of(t)
        ctx.source_dtype = t.dtype
        ctx.source_real = real_device(t)
        return vc.copy(t, index, dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor | None, None, None]:
        if not ctx.needs_input_grad[1]:
            return None, None, None, None
        vc: VirtualCuda = ctx.vc
        back = vc.copy(grad, ctx.source, ctx.source_dtype, real=ctx.source_real)
        return None, back, None, None


class _DeviceProperties(SimpleNamespace):
    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, "
                f"minor={self.minor}, total_memory={self.total_memory // 2**20}MB, "
                f"multi_processor_count={self.multi_processor_count})")


class _Stream:
    """``torch.cuda.Stream`` on a virtual device: work is in order, nothing to wait for."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.device = torch.device("cuda", _index(device) or 0)
        self.priority = priority
        self.cuda_stream = 0

    def wait_stream(self, stream: Any) -> None: ...
    def wait_event(self, event: Any) -> None: ...

    def record_event(self, event: Any = None) -> _Event:
        return event or _Event()

    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:
        return False

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None: ...


class _Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, **_: Any) -> None:
        self.enable_timing = enable_timing

    def record(self, stream: Any = None) -> None: ...
    def wait(self, stream: Any = None) -> None: ...
    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


def _index(device: Any) -> int | None:
    """The cuda index named by ``device`` (None: the current one)."""
    if device is None:
        return None
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        return device.index
    return None


def parse_visible_devices(value: str | None, physical: int) -> list[int]:
    """The physical indices ``CUDA_VISIBLE_DEVICES`` leaves, as CUDA parses it: a comma-
    separated list read up to its first invalid, out-of-range or repeated entry; unset: all."""
    if value is None:
        return list(range(physical))
    out: list[int] = []
    for part in value.split(","):
        part = part.strip()
        try:
            i = int(part)
        except ValueError:
            break
        if i < 0 or i >= physical or i in out:
            break
        out.append(i)
    return out


class VirtualCuda:
    """Context manager: ``torch.cuda`` played by ``num_gpus`` virtual GPUs (see the module).

    ``rt`` may be given (a :class:`CudaDevices`); otherwise one is made over ``base``.
    ``on_data_parallel`` builds what ``nn.DataParallel(...)`` returns (default: the
    re-enactment, :class:`VirtualDataParallel`).
    """

    def __init__(self, num_gpus: int = 4, gpu: str | GpuSpec = "a100-80gb",
                 base: str = "meta", rt: CudaDevices | None = None,
                 gpu_memory_bytes: int | None = None, enter_runtime: bool = True,
                 honour_visible_devices: bool = True) -> None:
        self.spec = lookup_gpu(gpu) if isinstance(gpu, str) else gpu
        self.physical = num_gpus
        self.rt = rt or CudaDevices(num_gpus, base)
        self.rt.cuda = self
        self.base = self.rt.base
        self.capacity_bytes = gpu_memory_bytes or self.spec.total_memory_bytes
        self._visible: list[int] | None = None
        self._current = 0
        self._peak_from = [0] * num_gpus  # event index of each device's last peak reset
        self._patcher = Patcher()
        self._stack = contextlib.ExitStack()
        self._local = threading.local()
        self.enter_runtime = enter_runtime  # False: the caller has entered ``rt``
        self.honour_visible_devices = honour_visible_devices
        # the parallel wrappers' shared state while active (script_parallel.ScriptParallel)
        self.parallel: Any = None
        self.active = False

    # ---- devices ------------------------------------------------------------------------

    @property
    def visible(self) -> list[int]:
        """Physical virtual devices the program sees, read once (CUDA's initialisation)."""
        if self._visible is None:
            self._visible = parse_visible_devices(
                os.environ.get("CUDA_VISIBLE_DEVICES") if self.honour_visible_devices
                else None, self.physical)
        return self._visible

    def device_count(self) -> int:
        return len(self.visible)

    def current_device(self) -> int:
        """The current device: the replica's inside DataParallel's threads, else the one
        set with ``set_device``."""
        d = self.rt.current_device
        return d if d != HOST else self._current

    def index_of(self, device: Any) -> int:
        """The runtime's device index for a cuda device the program names (logical index
        through CUDA_VISIBLE_DEVICES; the runtime counts all devices physically)."""
        i = _index(device)
        if i is None:
            i = self.current_device() if isinstance(device, (str, torch.device)) else 0
        n = self.device_count()
        if not 0 <= i < n:
            raise RuntimeError(
                "CUDA error: invalid device ordinal (cuda:{} of {} visible GPU{})".format(
                    i, n, "" if n == 1 else "s"))
        return self.visible[i]

    def logical(self, index: int) -> int:
        """The index the program sees for runtime device ``index``."""
        return self.visible.index(index) if index in self.visible else index

    def set_device(self, device: Any) -> None:
        if isinstance(device, (str, torch.device)) and torch.device(device).type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        i = _index(device)
        if i is not None and i >= 0:
            self.index_of(i)  # validates
            self._current = i

    @contextlib.contextmanager
    def device(self, device: Any) -> Iterator[None]:
        i = _index(device)
        if i is None or i < 0:
            yield
            return
        prev = self._current
        self.set_device(i)
        try:
            yield
        finally:
            self._current = prev

    def properties(self, device: Any = None) -> _DeviceProperties:
        i = self.index_of(device if device is not None else self.current_device())
        major, minor = self.spec.compute_capability
        return _DeviceProperties(
            name=self.spec.name, major=major, minor=minor, total_memory=self.capacity_bytes,
            multi_processor_count=108, is_integrated=False, is_multi_gpu_board=False,
            uuid=f"GPU-dpprof-virtual-{i}", L2_cache_size=40 * 2**20,
            gcnArchName="", warp_size=32, pci_bus_id=i, pci_device_id=0, pci_domain_id=0,
        )

    # ---- memory ------------------------------------------------------------------------

    def _dev(self, device: Any) -> int:
        return self.index_of(device if device is not None else self.current_device())

    def memory_allocated(self, device: Any = None) -> int:
        return self.rt.live_bytes(self._dev(device))

    def max_memory_allocated(self, device: Any = None) -> int:
        i = self._dev(device)
        return max(b for _, b in self.rt.timeline(i, self._peak_from[i]))

    def _reserved(self, i: int) -> tuple[int, int]:
        """(current, peak since the last reset) reserved bytes: the caching allocator
        simulated over the device's allocations so far."""
        from dpprof.emulator.allocator import simulate

        events: list[tuple[str, int, int]] = []
        for k, ev in enumerate(self.rt.events):
            if k == self._peak_from[i]:
                events.append(("reset_peak", -1, 0))
            if ev.device == i and ev.requested != 0:
                events.append(("alloc" if ev.requested > 0 else "free", ev.serial,
                               max(ev.requested, 0)))
        stats = simulate(events, timeline_points=None, stop_on_oom=False)
        return stats.final_reserved_bytes, stats.peak_reserved_bytes

    def memory_reserved(self, device: Any = None) -> int:
        return self._reserved(self._dev(device))[0]

    def max_memory_reserved(self, device: Any = None) -> int:
        return self._reserved(self._dev(device))[1]

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self._peak_from[self._dev(device)] = len(self.rt.events)

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return (max(self.capacity_bytes - self.memory_reserved(device), 0), self.capacity_bytes)

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        i = self._dev(device)
        reserved, peak_reserved = self._reserved(i)
        return {
            "allocated_bytes.all.current": self.rt.live_bytes(i),
            "allocated_bytes.all.peak": self.max_memory_allocated(i),
            "reserved_bytes.all.current": reserved,
            "reserved_bytes.all.peak": peak_reserved,
            "active_bytes.all.current": self.rt.live_bytes(i),
            "requested_bytes.all.current": self.rt.counters[i].live_requested,
        }

    def memory_summary(self, device: Any = None, abbreviated: bool = False) -> str:
        stats = self.memory_stats(device)
        return "\n".join(f"{k}: {v}" for k, v in stats.items())

    # ---- tensors -----------------------------------------------------------------------

    def copy(self, t: torch.Tensor, index: int, dtype: torch.dtype | None,
             real: torch.device | None = None) -> torch.Tensor:
        """A copy of ``t`` on runtime device ``index`` (HOST: the host) as ``dtype``."""
        rt = self.rt
        dtype = dtype or t.dtype
        with rt.placing_on(index):
            if index == HOST:
                if rt.real_host and _is_meta(t) and (real is None or real.type != "meta"):
                    values = rt.real_values(t)
                    if values is not None:
                        return values.to(dtype)
                    rt.stand_in("host copy", t)
                    return rt.host_stand_in(t, dtype)
                host = real or (torch.device("cpu") if rt.real_host else self.base)
                return _ORIG["to"](t, device=host, dtype=dtype, copy=True)
            if rt.device_of(t) == HOST and not isinstance(t, nn.Parameter):
                with rt.category(rt.current_category if rt.current_category == "parameters"
                                 else "inputs"):
                    return _ORIG["to"](t, device=self.base, dtype=dtype, copy=True)
            return _ORIG["to"](t, device=self.base, dtype=dtype, copy=True)

    def to_index(self, t: torch.Tensor, index: int, dtype: torch.dtype | None = None,
                 copy: bool = False, memory_format: Any = None) -> torch.Tensor:
        src = self.rt.device_of(t)
        if src == index and not (src == HOST and _is_meta(t) and self.rt.real_host):
            if dtype is None and memory_format is None and not copy:
                return t
            kw: dict[str, Any] = {"copy": copy}
            if dtype is not None:
                kw["dtype"] = dtype
            if memory_format is not None:
                kw["memory_format"] = memory_format
            return _ORIG["to"](t, **kw)
        if t.requires_grad and torch.is_grad_enabled():
            return _Cross.apply(self, t, index, dtype)
        return self.copy(t, index, dtype)

    def target_of(self, device: Any) -> int | None:
        """Runtime index for a device argument (None: no device change)."""
        if device is None:
            return None
        if isinstance(device, int):
            return self.index_of(device)
        d = torch.device(device) if isinstance(device, str) else device
        if d.type == "cuda":
            return self.index_of(d)
        if d.type == "cpu":
            # compare: the emulator's own "cpu" is its base, placed by the dispatch rules
            return HOST if self.rt.real_host else None
        if d.type == "meta":
            return None
        return None

    def tensor_to(self, t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args and isinstance(args[0], torch.Tensor):  # t.to(other)
            other = args[0]
            index = self.rt.device_of(other)
            return self.to_index(t, index, other.dtype, copy=bool(kwargs.get("copy", False)))
        device = kwargs.pop("device", None)
        dtype = kwargs.pop("dtype", None)
        rest = list(args)
        if rest and (rest[0] is None or (isinstance(rest[0], (str, torch.device, int))
                     and not isinstance(rest[0], bool))):
            # to(device=None, dtype=None, non_blocking, copy): Module.to's own call is
            # t.to(None, dtype, False) for a dtype alone
            device = rest.pop(0)
            if rest and (rest[0] is None or isinstance(rest[0], torch.dtype)):
                dtype = rest.pop(0)
        elif rest and isinstance(rest[0], torch.dtype):
            dtype = rest.pop(0)
        non_blocking = kwargs.pop("non_blocking", rest.pop(0) if rest else False)
        copy = kwargs.pop("copy", rest.pop(0) if rest else False)
        memory_format = kwargs.pop("memory_format", None)
        del non_blocking  # copies are in order on virtual devices
        target = self.target_of(device)
        if target is None:  # no device, or the real one (meta): torch's own conversion
            kw: dict[str, Any] = {"copy": copy}
            if device is not None:
                kw["device"] = device
            if dtype is not None:
                kw["dtype"] = dtype
            if memory_format is not None:
                kw["memory_format"] = memory_format
            return _ORIG["to"](t, **kw)
        return self.to_index(t, target, dtype, copy, memory_format)

    def load(self, orig_load: Callable[..., Any], f: Any, map_location: Any, *args: Any,
             **kwargs: Any) -> Any:
        """``torch.load`` onto virtual GPUs: a CPU build cannot make a CUDA storage
        (``map_location="cuda"``, or a checkpoint saved on a GPU), so every storage is
        restored on the host and then moved, once, to the GPU that ``map_location`` (or
        the checkpoint) names; tensors that shared a storage (tied weights) share its copy."""
        targets: dict[int, tuple[Any, Any]] = {}  # id(storage) -> (storage, where it goes)

        def on_host(storage: Any, location: str) -> Any:
            where: Any = location
            if isinstance(map_location, dict):
                where = map_location.get(location, location)
            elif isinstance(map_location, int) and not isinstance(map_location, bool):
                where = torch.device("cuda", map_location)
            elif map_location is not None:
                where = map_location
            targets[id(storage)] = (storage, where)
            return storage

        obj = orig_load(f, on_host, *args, **kwargs)
        moved: dict[int, torch.Tensor] = {}  # id(host storage) -> its bytes on the GPU

        def place(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            found = targets.get(id(st))
            index = self.target_of(found[1]) if found is not None else None
            if index is None or index == HOST:
                return t
            flat = moved.get(id(st))
            if flat is None:
                host = torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))
                flat = moved[id(st)] = self.copy(host, index, None)
            out = flat.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
            if isinstance(t, nn.Parameter):
                return nn.Parameter(out, requires_grad=t.requires_grad)
            return out.requires_grad_(t.requires_grad)

        return _map_tensors(obj, place)

    def rng_state_stand_in(self) -> torch.Tensor:
        """``torch.cuda.get_rng_state()``: 16 bytes (Philox's seed and offset) of zeros, a
        host stand-in (:meth:`CudaDevices.is_emulated`), so a checkpoint that holds it is
        not written as if it were the GPU's."""
        return self.rt.host_stand_in(torch.empty(16, dtype=torch.uint8))

    def virtual_device(self, t: torch.Tensor) -> torch.device:
        real = _ORIG["device"].__get__(t)
        if real != self.base or self.rt.in_dispatch:
            return real
        i = self.rt.device_of(t)
        if i == HOST:
            return real if real.type != "meta" else torch.device("cuda", self.current_device())
        return torch.device("cuda", self.logical(i))

    # ---- activation --------------------------------------------------------------------

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._patcher.patch(owner, name, value)

    def __enter__(self) -> VirtualCuda:
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("a VirtualCuda is already active")
        _ACTIVE = self
        self.active = True
        try:
            # torch._dynamo and symbolic_shapes: stand-ins until something needs the real
            # ones (an eager step imports them for nothing, dpprof.emulator.standins); a
            # real one is loaded with torch's originals in place, since dynamo indexes
            # torch's functions once.
            self._stack.enter_context(standing_in(self._real_module))
            if self.enter_runtime:
                self._stack.enter_context(self.rt)
                self._stack.enter_context(self.rt.device(HOST))
            self._install()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _real_module(self, module: str) -> ModuleType:
        """The real module ``module`` (a stand-in's), imported with torch's originals in
        place of the hooks and with no mode counting what its import makes."""
        current = []
        for owner, name, original in reversed(self._patcher.originals()):
            current.append((owner, name, own_attribute(owner, name)))
            put(owner, name, original)
        try:
            with torch._C._DisableTorchDispatch():
                return load_real(module)
        finally:
            for owner, name, value in reversed(current):
                put(owner, name, value)

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        self._patcher.restore()
        self._stack.close()
        self.active = False
        _ACTIVE = None
        keras_core = sys.modules.get("keras.src.backend.torch.core")
        if (keras_core is not None and str(getattr(keras_core, "DEFAULT_DEVICE", "")) ==
                "cuda" and not torch.cuda.is_available()):
            # Keras was first imported under the emulation
            setattr(keras_core, "DEFAULT_DEVICE", "cpu")  # noqa: B010 - a module mypy cannot see

    def _install(self) -> None:
        vc = self
        cuda = torch.cuda
        p = self._patch

        # torch.cuda: the module's functions
        p(cuda, "_lazy_init", lambda: None)
        p(cuda, "init", lambda: None)
        p(cuda, "is_initialized", lambda: True)
        p(cuda, "is_available", lambda: vc.device_count() > 0)
        p(cuda, "device_count", vc.device_count)
        p(cuda, "current_device", vc.current_device)
        p(cuda, "set_device", vc.set_device)
        p(cuda, "device", _device_class(vc))
        p(cuda, "device_of", lambda obj: _device_class(vc)(
            vc.virtual_device(obj).index if obj.is_cuda else -1))
        p(cuda, "get_device_properties", vc.properties)
        p(cuda, "get_device_name", lambda device=None: vc.properties(device).name)
        p(cuda, "get_device_capability",
          lambda device=None: (vc.properties(device).major, vc.properties(device).minor))
        p(cuda, "get_arch_list", lambda: ["sm_{}{}".format(*vc.spec.compute_capability)])
        p(cuda, "is_bf16_supported",
          lambda including_emulation=True: vc.spec.compute_capability >= (8, 0))
        p(cuda, "is_tf32_supported", lambda: vc.spec.compute_capability >= (8, 0))
        p(cuda, "can_device_access_peer", lambda device, peer: True)
        p(cuda, "mem_get_info", vc.mem_get_info)
        for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                     "max_memory_reserved", "reset_peak_memory_stats", "memory_stats",
                     "memory_summary"):
            p(cuda, name, getattr(vc, name))
        p(cuda, "reset_max_memory_allocated", vc.reset_peak_memory_stats)
        p(cuda, "reset_accumulated_memory_stats", lambda device=None: None)
        p(cuda, "memory_cached", vc.memory_reserved)
        p(cuda, "max_memory_cached", vc.max_memory_reserved)
        for name in ("synchronize", "empty_cache", "ipc_collect", "set_sync_debug_mode"):
            p(cuda, name, _Noop())
        # torch.cuda.random's functions too: callers that name the module (Hugging Face's
        # Trainer saves torch.cuda.random.get_rng_state() with each checkpoint) reach its
        # own bindings of current_device and _lazy_call, which are not these
        for owner in (cuda, cuda.random):
            for name in ("manual_seed", "manual_seed_all", "seed", "seed_all",
                         "set_rng_state", "set_rng_state_all"):
                p(owner, name, _Noop())
            p(owner, "initial_seed", lambda: 0)
            # a GPU's generator state has no value here: a stand-in, never saved as real
            p(owner, "get_rng_state", lambda device="cuda": vc.rng_state_stand_in())
            p(owner, "get_rng_state_all",
              lambda: [vc.rng_state_stand_in() for _ in range(vc.device_count())])
        p(cuda, "Stream", _Stream)
        p(cuda, "Event", _Event)
        p(cuda, "current_stream", lambda device=None: _Stream(device))
        p(cuda, "default_stream", lambda device=None: _Stream(device))
        p(cuda, "stream", lambda stream=None: contextlib.nullcontext(stream))
        p(cuda, "set_stream", _Noop())
        p(cuda, "is_current_stream_capturing", lambda: False)
        with contextlib.suppress(ImportError, AttributeError):
            import torch.cuda.memory as cuda_memory

            for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                         "max_memory_reserved", "reset_peak_memory_stats", "memory_stats",
                         "mem_get_info", "empty_cache"):
                p(cuda_memory, name, getattr(cuda, name))
        with contextlib.suppress(ImportError, AttributeError):
            import torch.cuda.nvtx as nvtx

            p(nvtx, "range_push", lambda msg: 0)
            p(nvtx, "range_pop", lambda: 0)
            p(nvtx, "mark", _Noop())
            p(nvtx, "range", lambda msg, *a, **k: contextlib.nullcontext())

        # torch.accelerator (torch >= 2.6)
        acc = getattr(torch, "accelerator", None)
        if acc is not None:
            p(acc, "is_available", cuda.is_available)
            p(acc, "current_accelerator",
              lambda check_available=False: torch.device("cuda"))
            p(acc, "device_count", vc.device_count)
            p(acc, "current_device_index", vc.current_device)
            p(acc, "current_device_idx", vc.current_device)
            p(acc, "set_device_index", vc.set_device)
            p(acc, "set_device_idx", vc.set_device)
            p(acc, "synchronize", _Noop())
            p(acc, "current_stream", lambda device=None: _Stream(device))
            p(acc, "set_stream", _Noop())
            p(acc, "device_index", _device_class(vc))
            p(acc, "get_device_capability", lambda device=None: {
                "major": vc.spec.compute_capability[0],
                "minor": vc.spec.compute_capability[1]})
            mems = [acc]
            if hasattr(acc, "memory"):
                mems.append(acc.memory)
            for m in mems:
                for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                             "max_memory_reserved", "reset_peak_memory_stats", "memory_stats"):
                    if hasattr(m, name):
                        p(m, name, getattr(vc, name))
                for name in ("empty_cache", "empty_host_cache",
                             "reset_accumulated_memory_stats"):
                    if hasattr(m, name):
                        p(m, name, _Noop())
                if hasattr(m, "get_memory_info"):
                    p(m, "get_memory_info", vc.mem_get_info)

        # Tensor methods that a CPU build refuses before dispatch, and stand-ins
        T = torch.Tensor

        def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            return vc.tensor_to(self, *args, **kwargs)

        def cuda_(self: torch.Tensor, device: Any = None, non_blocking: bool = False,
                  memory_format: Any = None) -> torch.Tensor:
            i = vc.index_of(device if device is not None else vc.current_device())
            return vc.to_index(self, i, memory_format=memory_format)

        def cpu(self: torch.Tensor, memory_format: Any = None) -> torch.Tensor:
            return vc.to_index(self, HOST, memory_format=memory_format)

        def tolist(self: torch.Tensor) -> Any:
            if _is_meta(self):
                real = vc.rt.real_values(self)
                if real is not None:
                    return _ORIG["tolist"](real)
                vc.rt.stand_in("tolist", self)
                return _ORIG["tolist"](vc.rt.host_stand_in(self))
            return _ORIG["tolist"](self)

        def numpy(self: torch.Tensor, *, force: bool = False) -> Any:
            if _ORIG["device"].__get__(self).type == "meta":
                values = vc.rt.real_values(self)
                if values is not None:
                    return _ORIG["numpy"](values)
                vc.rt.stand_in("numpy", self)
                return _ORIG["numpy"](vc.rt.host_stand_in(self))
            return _ORIG["numpy"](self, force=force)

        def is_cuda(self: torch.Tensor) -> bool:
            return vc.virtual_device(self).type == "cuda"

        def get_device(self: torch.Tensor) -> int:
            d = vc.virtual_device(self)
            return d.index if d.type == "cuda" and d.index is not None else -1

        orig_format = T.__format__

        def format_(self: torch.Tensor, spec: str) -> str:
            if self.dim() == 0 and _is_meta(self):
                return format(self.detach().item(), spec)  # a stand-in, counted
            return orig_format(self, spec)

        orig_load = torch.load

        def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
            if callable(map_location):
                return orig_load(f, map_location, *args, **kwargs)
            return vc.load(orig_load, f, map_location, *args, **kwargs)

        p(torch, "load", load)
        orig_data_ptr = T.data_ptr
        orig_storage_ptr = torch.UntypedStorage.data_ptr

        def data_ptr(self: torch.Tensor) -> int:
            if not _is_meta(self):
                return orig_data_ptr(self)
            base = vc.rt.address_of(self.untyped_storage())
            return base + int(self.storage_offset()) * self.element_size() if base else 0

        def storage_ptr(self: Any) -> int:
            if self.device.type != "meta":
                return orig_storage_ptr(self)  # type: ignore[no-any-return]
            return vc.rt.address_of(self)

        p(T, "data_ptr", data_ptr)
        p(torch.UntypedStorage, "data_ptr", storage_ptr)
        p(T, "__format__", format_)
        p(T, "to", to)
        p(T, "cuda", cuda_)
        p(T, "cpu", cpu)
        p(T, "tolist", tolist)
        p(T, "numpy", numpy)
        p(T, "pin_memory", lambda self, device=None: self)
        p(T, "is_pinned", lambda self, device=None: False)
        p(T, "record_stream", lambda self, stream: None)
        def is_meta(self: torch.Tensor) -> bool:
            # an emulated GPU tensor is not "meta" to the program (Keras re-creates meta
            # tensors with empty_like, dropping autograd)
            return _is_meta(self) and (vc.rt.in_dispatch > 0
                                       or vc.rt.device_of(self) == HOST)

        orig_repr = T.__repr__

        def repr_(self: torch.Tensor, *args: Any, **kwargs: Any) -> str:
            vc.rt.in_dispatch += 1  # torch's printing sees the real (meta) device
            try:
                return orig_repr(self, *args, **kwargs)
            finally:
                vc.rt.in_dispatch -= 1

        p(T, "is_meta", property(is_meta))
        p(T, "__repr__", repr_)
        p(T, "device", property(vc.virtual_device))
        p(T, "is_cuda", property(is_cuda))
        p(T, "get_device", get_device)

        # torch.tensor / torch.as_tensor with a CUDA device: made on the host, then moved
        def make(orig: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
            def factory(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
                device = kwargs.pop("device", None)
                index = vc.target_of(device)
                if orig is _ORIG["as_tensor"] and isinstance(data, torch.Tensor):
                    # as_tensor of a tensor: no copy where it already is (autograd kept)
                    dtype = kwargs.get("dtype", args[0] if args else None)
                    if index is None:
                        return orig(data, dtype=dtype) if dtype is not None else data
                    return vc.to_index(data, index, dtype)
                if index is None or index == HOST:
                    if device is not None:
                        kwargs["device"] = device
                    return orig(data, *args, **kwargs)
                requires_grad = kwargs.pop("requires_grad", False)
                out = vc.copy(orig(data, *args, **kwargs), index, None)
                return out.requires_grad_(requires_grad) if requires_grad else out

            return factory

        # Module.to / cuda: what they move is parameters and buffers
        def module_mover(orig: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
            def move(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
                # module.to(rank): an int names an accelerator, which C++ cannot find
                args = tuple(torch.device("cuda", a) if isinstance(a, int)
                             and not isinstance(a, bool) else a for a in args)
                if isinstance(kwargs.get("device"), int):
                    kwargs["device"] = torch.device("cuda", kwargs["device"])
                with vc.rt.category("parameters"):
                    return orig(self, *args, **kwargs)

            return move

        for name in ("to", "cuda", "to_empty"):
            p(nn.Module, name, module_mover(getattr(nn.Module, name)))
        # A CPU parameter cannot take a meta tensor as .data: swap the tensors instead
        # (torch.utils.swap_tensors), so the Parameter objects an optimizer built before
        # .cuda() holds stay the module's, as on a GPU.
        p(torch.__future__, "_swap_module_params_on_conversion", True)
        # torch.Generator(device="cuda"): a host generator (the values are not emulated)
        generator = torch.Generator

        class Generator(generator):  # type: ignore[misc,valid-type]
            def __new__(cls, device: Any = "cpu") -> Any:
                d = torch.device(device) if isinstance(device, (str, int)) else device
                return generator("cpu" if d.type == "cuda" else d)

        p(torch, "Generator", Generator)
        p(torch, "tensor", make(_ORIG["tensor"]))
        p(torch, "as_tensor", make(_ORIG["as_tensor"]))
        # device=rank, torch.device(rank): an int names the accelerator, which C++ looks up
        # before dispatch and a CPU build does not have; here the accelerator is CUDA
        for name in INT_DEVICE_FACTORIES:
            if hasattr(torch, name):
                p(torch, name, _int_device(getattr(torch, name)))
        for name in INT_DEVICE_METHODS:
            p(T, name, _int_device(getattr(T, name)))
        p(torch, "device", Device)

        # Keras 3 on torch picks its device once, at import: a Keras imported before the
        # GPUs appeared must place its variables and inputs on them too
        keras_core = sys.modules.get("keras.src.backend.torch.core")
        if keras_core is not None and hasattr(keras_core, "DEFAULT_DEVICE"):
            p(keras_core, "DEFAULT_DEVICE", "cuda")

        # GradScaler: over meta tensors no gradient is inf, so the step is taken (the
        # stand-in 1.0 for found_inf would skip every step)
        import torch.amp.grad_scaler as grad_scaler

        orig_opt_step = grad_scaler.GradScaler._maybe_opt_step

        def maybe_opt_step(scaler: Any, optimizer: Any, optimizer_state: dict[str, Any],
                           *args: Any, **kwargs: Any) -> Any:
            found = list(optimizer_state["found_inf_per_device"].values())
            if found and all(_is_meta(v) for v in found):
                vc.rt.stand_ins.add("found_inf (none)")
                return optimizer.step(*args, **kwargs)
            return orig_opt_step(scaler, optimizer, optimizer_state, *args, **kwargs)

        p(grad_scaler.GradScaler, "_maybe_opt_step", maybe_opt_step)

        # Parallel wrappers
        from dpprof.emulator import script_parallel

        script_parallel.install(vc, p)


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` (what ``torch.load`` gives: nested containers of tensors and values) with
    every tensor replaced by ``fn(tensor)``; each tensor once (a shared one stays shared)."""
    done: dict[int, torch.Tensor] = {}

    def once(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in done:
            done[id(x)] = fn(x)
        return done[id(x)]

    return tree_map(once, obj)


_ACTIVE: VirtualCuda | None = None
_ORIG: dict[str, Any] = {
    "to": torch.Tensor.to,
    "tolist": torch.Tensor.tolist,
    "numpy": torch.Tensor.numpy,
    "device": torch._C.TensorBase.__dict__["device"],
    "tensor": torch.tensor,
    "as_tensor": torch.as_tensor,
}


_REAL_DEVICE = torch.device
# torch functions and Tensor methods that take device= (and may be given an int)
INT_DEVICE_FACTORIES = (
    "empty", "zeros", "ones", "full", "rand", "randn", "randint", "randperm", "arange",
    "range", "linspace", "logspace", "eye", "empty_strided", "empty_permuted", "empty_like",
    "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like",
    "scalar_tensor", "tril_indices", "triu_indices", "asarray", "normal",
)
INT_DEVICE_METHODS = ("new_empty", "new_empty_strided", "new_full", "new_ones", "new_tensor",
                      "new_zeros")


def _cuda_if_int(device: Any) -> Any:
    if isinstance(device, int) and not isinstance(device, bool):
        return _REAL_DEVICE("cuda", device)
    return device


def _int_device(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``orig`` with ``device=k`` (an int) read as ``cuda:k``, as on a CUDA machine."""

    @functools.wraps(orig)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cuda_if_int(kwargs["device"])
        return orig(*args, **kwargs)

    return call


class _DeviceType(type):
    """The type of :class:`Device`: calling it makes a real ``torch.device``;
    ``isinstance`` and ``issubclass`` answer for ``torch.device``."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs:
            return _REAL_DEVICE(_cuda_if_int(args[0]))
        return _REAL_DEVICE(*args, **kwargs)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _REAL_DEVICE)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _REAL_DEVICE)


class Device(metaclass=_DeviceType):
    """``torch.device`` while a :class:`VirtualCuda` is active: ``torch.device(rank)`` is
    ``cuda:rank`` (a CPU build's C++ finds no accelerator for an int); every object it makes
    is a real ``torch.device``."""


def real_device(t: torch.Tensor) -> torch.device:
    """The device the tensor's bytes are on (``meta`` or ``cpu`` for emulated tensors)."""
    return _ORIG["device"].__get__(t)  # type: ignore[no-any-return]


# the bytes are on meta: Tensor.is_meta as torch answers it (the emulation patches the
# property); no torch.device is made (reading ``device`` makes one, ten times the cost)
_is_meta: Callable[[torch.Tensor], bool] = torch._C.TensorBase.__dict__["is_meta"].__get__


def _tensors_in(args: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(b for b in a if isinstance(b, torch.Tensor))
    return found


def active() -> VirtualCuda | None:
    """The active :class:`VirtualCuda`, if any."""
    return _ACTIVE


class _Noop:
    """A callable that does nothing (one per hooked name)."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


def _device_class(vc: VirtualCuda) -> type:
    class device:
        """``torch.cuda.device(k)``: the current device inside the block."""

        def __init__(self, device: Any) -> None:
            self.idx = _index(device)
            self._cm: contextlib.AbstractContextManager[None] | None = None

        def __enter__(self) -> None:
            self._cm = vc.device(self.idx)
            self._cm.__enter__()

        def __exit__(self, *exc: Any) -> None:
            if self._cm is not None:
                self._cm.__exit__(*exc)

    return device
