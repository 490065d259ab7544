"""``torch``'s tensor API played by a :class:`dpprof.emulator.virtual_cuda.VirtualCuda`: the
Tensor methods a CPU build refuses before dispatch (``to``, ``cuda``, ``cpu``), the reads
of values that meta tensors do not have (stand-ins), a tensor's device as the program sees
it, stand-in addresses, ``torch.load``, the factories and modules given a CUDA device
(``torch.tensor``, ``Module.to``, ``device=rank``), and the tensors torch makes from Python
data for a tensor's device (an index given as a list, ``new_tensor``). Each group is patched
through one ``Patch`` (:meth:`dpprof.emulator.patcher.Patcher.patch`), in :func:`install`'s
order."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter, is_lazy
from torch.utils import _device
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from dpprof.emulator.cuda_devices import ORIGINALS, CudaDevices, on_meta
from dpprof.emulator.dispatch_state import HOST
from dpprof.emulator.emulated_cuda import EmulatedCuda
from dpprof.emulator.patcher import Patch
from dpprof.emulator.user_meta import default_device, names_meta


def install(vc: EmulatedCuda, p: Patch) -> None:
    """Patch torch's tensor API to place tensors on ``vc``'s virtual GPUs."""
    torch_load(vc, p)
    storage_addresses(vc, p)
    values_and_copies(vc, p)
    finiteness_checks(vc, p)
    device_identity(vc, p)
    factories(vc, p)
    python_data(p)
    legacy_types(vc, p)


def lazy_allowed(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (a Tensor property getter patched here: the device) as torch's own is on a
    LazyModule's uninitialized parameter or buffer: one of the few it allows (torch's
    ``UninitializedTensorMixin._allowed_methods``), run without its refusal of every other
    torch function, which the emulation's body calls (the storage)."""
    @functools.wraps(method)
    def call(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not is_lazy(self):
            return method(self, *args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return method(self, *args, **kwargs)
    return call


def lazy_moved(move: Callable[..., torch.Tensor],
               device_of: Callable[..., tuple[Any, Any]]) -> Callable[..., torch.Tensor]:
    """``move`` (``to``, ``cuda``, ``cpu``), which on a LazyModule's uninitialized parameter
    or buffer gives one of its class, uninitialized, on the device and of the dtype asked
    (torch's move of its empty data; the shape comes at the first forward, there):
    ``device_of(self, *args, **kwargs)`` gives them (None: the tensor's own)."""
    @functools.wraps(move)
    def call(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not is_lazy(self):
            return move(self, *args, **kwargs)
        device, dtype = device_of(self, *args, **kwargs)
        made = {"requires_grad": self.requires_grad,
                "device": self.device if device is None else device,
                "dtype": self.dtype if dtype is None else dtype}
        # their constructors are __new__'s (the type stubs give Parameter's and Buffer's)
        lazy_class: Any = UninitializedParameter
        if isinstance(self, UninitializedBuffer):
            lazy_class, made["persistent"] = UninitializedBuffer, getattr(self, "persistent", True)
        return lazy_class(**made)  # type: ignore[no-any-return]
    return call


def _to_device(self: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    return device, dtype


def _cuda_device(self: torch.Tensor, device: Any = None, *_: Any, **__: Any) -> tuple[Any, Any]:
    if device is None:
        return torch.device("cuda"), None
    return (torch.device("cuda", device) if isinstance(device, int)
            else torch.device(device)), None


def torch_load(vc: EmulatedCuda, p: Patch) -> None:
    """``torch.load`` onto virtual GPUs (:meth:`VirtualCuda.load`)."""
    orig_load = torch.load

    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        if callable(map_location):
            return orig_load(f, map_location, *args, **kwargs)
        return vc.load(orig_load, f, map_location, *args, **kwargs)

    p(torch, "load", load)


def storage_addresses(vc: EmulatedCuda, p: Patch) -> None:
    """``data_ptr()`` of meta storages: stand-in addresses, disjoint per storage."""
    T = torch.Tensor
    orig_data_ptr = T.data_ptr
    orig_storage_ptr = torch.UntypedStorage.data_ptr

    def data_ptr(self: torch.Tensor) -> int:
        if not on_meta(self):
            return orig_data_ptr(self)
        base = vc.rt.address_of(self.untyped_storage())
        return base + int(self.storage_offset()) * self.element_size() if base else 0

    def storage_ptr(self: Any) -> int:
        if self.device.type != "meta":
            return orig_storage_ptr(self)  # type: ignore[no-any-return]
        return vc.rt.address_of(self)

    p(T, "data_ptr", data_ptr)
    p(torch.UntypedStorage, "data_ptr", storage_ptr)


# torch's checks of finiteness, and what each answers of the emulated values: finite, as
# GradScaler finds them (isfinite is composite: its ops alone would not say what it asked)
FINITENESS_CHECKS = {"isfinite": True, "isnan": False, "isinf": False, "isposinf": False,
                     "isneginf": False}


def finiteness_checks(vc: EmulatedCuda, p: Patch) -> None:
    """``torch.isfinite(loss)`` and the like on a virtual GPU: results known, every element
    the check's answer for finite values (:meth:`CudaDevices.assume_checked`)."""
    def checked(original: Callable[..., Any], answer: bool, name: str) -> Callable[..., Any]:
        @functools.wraps(original)
        def check(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            # the program's own check, not a meta kernel's (torch._refs.clamp calls isnan)
            if isinstance(out, torch.Tensor) and not vc.rt.state.in_dispatch:
                if on_meta(out):
                    vc.rt.assume_checked(out, answer, name)
                elif out.device.type == "cuda":
                    # a virtual GPU's, which is_meta does not say (a DeviceContext's, vmap's):
                    # not followed, its line's booleans answered as the check would
                    vc.rt.unfollowed_check()
            return out
        return check

    for name, answer in FINITENESS_CHECKS.items():
        for owner in (torch, torch.Tensor):
            p(owner, name, checked(getattr(owner, name), answer, name))


def values_and_copies(vc: EmulatedCuda, p: Patch) -> None:
    """Moves between the host and virtual GPUs, and values read from them (stand-ins)."""
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
        if on_meta(self):
            real = vc.rt.real_values(self)
            if real is not None:
                return ORIGINALS["tolist"](real)
            vc.rt.stand_in("tolist", self)
            return ORIGINALS["tolist"](vc.rt.host_stand_in(self))
        return ORIGINALS["tolist"](self)

    def numpy(self: torch.Tensor, *, force: bool = False) -> Any:
        if ORIGINALS["device"].__get__(self).type == "meta":
            values = vc.rt.real_values(self)
            if values is not None:
                return ORIGINALS["numpy"](values)
            vc.rt.stand_in("numpy", self)
            return ORIGINALS["numpy"](vc.rt.host_stand_in(self))
        return ORIGINALS["numpy"](self, force=force)

    orig_format = T.__format__

    def format_(self: torch.Tensor, spec: str) -> str:
        if self.dim() == 0 and on_meta(self):
            return format(self.detach().item(), spec)  # a stand-in, counted
        return orig_format(self, spec)

    p(T, "__format__", format_)
    p(T, "to", lazy_moved(to, _to_device))
    p(T, "cuda", lazy_moved(cuda_, _cuda_device))
    p(T, "cpu", lazy_moved(cpu, lambda self, *a, **k: (torch.device("cpu"), None)))
    p(T, "tolist", tolist)
    p(T, "numpy", numpy)

    def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
        # a CPU build has no page-locked allocator: a host copy remembered as pinned, as
        # torch's own pin_memory copies into CUDA's host allocator (the same sizes and
        # strides); an emulated GPU's tensor is refused as torch refuses a CUDA one
        if vc.rt.is_pinned(self):
            return self
        if vc.rt.storages.device_of(self) != HOST:
            raise RuntimeError(f"cannot pin a tensor of {vc.virtual_device(self)}: only "
                               "dense CPU tensors can be pinned")
        return vc.rt.pin(self.clone(memory_format=torch.preserve_format))

    p(T, "pin_memory", pin_memory)
    p(T, "is_pinned", lambda self, device=None: vc.rt.is_pinned(self))
    p(T, "record_stream", lambda self, stream: None)


def device_identity(vc: EmulatedCuda, p: Patch) -> None:
    """A tensor's device as the program sees it: ``cuda:k``, not meta."""
    T = torch.Tensor

    def is_cuda(self: torch.Tensor) -> bool:
        return vc.virtual_device(self).type == "cuda"

    def get_device(self: torch.Tensor) -> int:
        d = vc.virtual_device(self)
        return d.index if d.type == "cuda" and d.index is not None else -1

    def is_meta(self: torch.Tensor) -> bool:
        # an emulated GPU tensor is not "meta" to the program (Keras re-creates meta
        # tensors with empty_like, dropping autograd); a DTensor is what its shard is
        # (Lightning refuses an optimizer over meta parameters)
        if not on_meta(self):
            return False
        if vc.rt.state.in_dispatch > 0:
            return True
        local = getattr(self, "_local_tensor", None)
        if isinstance(local, torch.Tensor):
            return is_meta(local)
        return vc.rt.user_meta.holds(self) or vc.rt.storages.device_of(self) == HOST

    orig_repr = T.__repr__

    def repr_(self: torch.Tensor, *args: Any, **kwargs: Any) -> str:
        vc.rt.state.in_dispatch += 1  # torch's printing sees the real (meta) device
        try:
            return orig_repr(self, *args, **kwargs)
        finally:
            vc.rt.state.in_dispatch -= 1

    p(T, "is_meta", property(lazy_allowed(is_meta)))
    p(T, "__repr__", repr_)
    p(T, "device", property(lazy_allowed(vc.virtual_device)))
    p(T, "is_cuda", property(lazy_allowed(is_cuda)))
    p(T, "get_device", lazy_allowed(get_device))


def factories(vc: EmulatedCuda, p: Patch) -> None:
    """Factories and modules given a CUDA device, or an int for one."""
    T = torch.Tensor
    # torch's DeviceContext (``with torch.device(d)``, ``torch.set_default_device(d)``)
    # gives its device to the functions in this set, which is made at its first use: made
    # now it holds torch's own functions, the ones the wrappers below call (made while they
    # are in place, it would hold the wrappers, and no call would get the device)
    _device._device_constructors.cache_clear()
    _device._device_constructors()

    # torch.tensor / torch.as_tensor with a CUDA device: made on the host, then moved
    def make(orig: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def factory(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            device = kwargs.pop("device", None)
            if device is None:  # torch.device(d) entered, or set_default_device(d)
                device = default_device()
            if names_meta(device):  # the program's own meta tensor, where it asks
                with vc.rt.asking_for(device):
                    return orig(data, *args, device=device, **kwargs)
            index = vc.target_of(device)
            if orig is ORIGINALS["as_tensor"] and isinstance(data, torch.Tensor):
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
            # made on the host (given it: a device entered would be given to it instead)
            out = vc.copy(orig(data, *args, device="cpu", **kwargs), index, None)
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
    # A CPU parameter cannot take a meta tensor as .data: a module's conversions (.cuda(),
    # .to(), .half(): Module._apply) swap the tensors instead (torch.utils.swap_tensors), so
    # the Parameter objects an optimizer built before .cuda() holds stay the module's, as
    # on a GPU. Only there: load_state_dict copies into the parameters, as on a GPU (a swap
    # would fail on parameters DDP's reducer holds). Only there: a parameter the conversion
    # leaves as it is (``model.to(device)`` after ``DDP(model.cuda(rank))``) stays as it is,
    # and one converted on the GPU (``.half()``) takes the new tensor as its ``.data``, as
    # torch does: a swap of a parameter DDP holds fails.
    apply = nn.Module._apply
    swap = torch.utils.swap_tensors

    def apply_swapping(self: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor],
                       *args: Any, **kwargs: Any) -> nn.Module:
        future = torch.__future__
        before = future.get_swap_module_params_on_conversion()
        future.set_swap_module_params_on_conversion(True)
        unchanged: set[int] = set()  # the tensors ``fn`` returned as they were

        def converted(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if out is t:
                unchanged.add(id(t))
            return out

        def swap_changed(t1: torch.Tensor, t2: torch.Tensor) -> None:
            if id(t1) in unchanged:
                return
            if not is_traceable_wrapper_subclass(t2) and torch._has_compatible_shallow_copy_type(
                    t1, t2):
                t1.data = t2.data  # a GPU's conversion on the GPU (.half()): torch's own way
                return
            swap(t1, t2)  # a wrapper subclass's (DTensor's), as torch does; a host tensor's

        outer = torch.utils.swap_tensors  # a parent module's, in its children's conversion
        torch.utils.swap_tensors = swap_changed
        # a LazyModule's uninitialized parameters: torch's swap wraps the moved one in a
        # Parameter, which an uninitialized one refuses; swapped here, of their own class
        # (LazyModuleMixin materializes the very objects an optimizer may hold already)
        lazy: dict[str, nn.Parameter] = {}
        for key, param in self._parameters.items():
            if param is not None and is_lazy(param):
                lazy[key] = param
        try:
            for key, param in lazy.items():
                with torch.no_grad():
                    torch.utils.swap_tensors(param, fn(param))
                self._parameters[key] = None
            return apply(self, converted, *args, **kwargs)  # type: ignore[no-any-return]
        finally:
            self._parameters.update(lazy)
            future.set_swap_module_params_on_conversion(before)
            torch.utils.swap_tensors = outer

    p(nn.Module, "_apply", apply_swapping)
    # torch.Generator(device="cuda"): a host generator (the values are not emulated)
    generator = torch.Generator

    class Generator(generator):  # type: ignore[misc,valid-type]
        def __new__(cls, device: Any = "cpu") -> Any:
            d = torch.device(device) if isinstance(device, (str, int)) else device
            return generator("cpu" if d.type == "cuda" else d)

    p(torch, "Generator", Generator)
    p(torch, "tensor", make(ORIGINALS["tensor"]))
    p(torch, "as_tensor", make(ORIGINALS["as_tensor"]))
    # device=rank, torch.device(rank): an int names the accelerator, which C++ looks up
    # before dispatch and a CPU build does not have; here the accelerator is CUDA
    for name in INT_DEVICE_FACTORIES:
        if hasattr(torch, name):
            p(torch, name, _int_device(getattr(torch, name), vc.rt))
    for name in INT_DEVICE_METHODS:
        p(T, name, _int_device(getattr(T, name), vc.rt))
    p(torch, "device", Device)


def python_data(p: Patch) -> None:
    """Tensors torch's C++ makes from Python data on a tensor's device: an index given as a
    list (``x[[0, 2]]``, ``x[:, [1, 3]] = v``) and ``x.new_tensor(data)``. For a meta
    device C++ makes them empty (``internal_new_from_data`` skips the copy of the data, out
    of sight of dispatch modes), so the values of what they index or hold were lost; on a
    virtual GPU they are made on the host, as ``torch.tensor`` is, and keep them. (The
    index's bytes on the GPU, made there from the list or moved there inside the op, are
    freed as the op returns; the emulation counts them in neither case.)"""
    T = torch.Tensor
    getitem, setitem, new_tensor = T.__getitem__, T.__setitem__, T.new_tensor

    def get(self: torch.Tensor, index: Any) -> Any:
        if on_meta(self) and _has_sequence(index):
            return _warning_as_torch(getitem, self, _host_index(index))
        return getitem(self, index)

    def set_(self: torch.Tensor, index: Any, value: Any) -> None:
        if on_meta(self) and _has_sequence(index):
            _warning_as_torch(setitem, self, _host_index(index), value)
            return
        setitem(self, index, value)

    def new(self: torch.Tensor, data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or not on_meta(self) or isinstance(data, torch.Tensor):
            return new_tensor(self, data, *args, **kwargs)  # a copy of a tensor: dispatched
        dtype, device = kwargs.pop("dtype", None), kwargs.pop("device", None)
        return torch.tensor(data, dtype=self.dtype if dtype is None else dtype,
                            device=self.device if device is None else device, **kwargs)

    p(T, "__getitem__", get)
    p(T, "__setitem__", set_)
    p(T, "new_tensor", new)


# the legacy tensor types' names (torch.cuda.FloatTensor, "torch.cuda.HalfTensor")
LEGACY_TYPES = {
    "DoubleTensor": torch.float64, "FloatTensor": torch.float32, "HalfTensor": torch.float16,
    "BFloat16Tensor": torch.bfloat16, "LongTensor": torch.int64, "IntTensor": torch.int32,
    "ShortTensor": torch.int16, "CharTensor": torch.int8, "ByteTensor": torch.uint8,
    "BoolTensor": torch.bool,
}
_LEGACY_NAME = {dtype: name for name, dtype in LEGACY_TYPES.items()}


def legacy_types(vc: EmulatedCuda, p: Patch) -> None:
    """The legacy tensor types of older scripts on a virtual GPU: ``x.type()`` names
    ``torch.cuda.FloatTensor`` (not meta's), ``x.type(torch.cuda.HalfTensor)`` (a class or
    its name) converts as torch does (the device kept where it is CUDA already, else the
    current one), and ``torch.cuda.FloatTensor(2, 3)`` / ``(data)`` make one, of which
    ``isinstance`` answers as on a GPU. A CPU build refused them all."""
    T = torch.Tensor
    orig_type = T.type

    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False,
              **kwargs: Any) -> Any:
        virtual = on_meta(self) and vc.virtual_device(self).type == "cuda"
        if dtype is None:
            name = _LEGACY_NAME.get(self.dtype)
            if virtual and name is not None:
                return f"torch.cuda.{name}"
            return orig_type(self, **kwargs)
        cuda, scalar = _legacy_type(dtype)
        if scalar is None or not (virtual or cuda):
            return orig_type(self, dtype, non_blocking, **kwargs)
        device = self.device if cuda == virtual else (
            torch.device("cuda", vc.current_device()) if cuda else torch.device("cpu"))
        if device == self.device and scalar == self.dtype:
            return self  # of the type already: no copy, as torch's
        return self.to(device=device, dtype=scalar, non_blocking=non_blocking)

    p(T, "type", type_)
    for name, scalar in LEGACY_TYPES.items():
        if hasattr(torch.cuda, name):
            p(torch.cuda, name, _LegacyCudaType(name, (), {"dtype": scalar, "is_cuda": True,
                                                          "virtual": vc}))


def _legacy_type(t: Any) -> tuple[bool, torch.dtype | None]:
    """A legacy type given to ``Tensor.type`` (its name, or its class): whether it is
    CUDA's, and its dtype (None: not one of them)."""
    if isinstance(t, str):
        cuda = t.startswith("torch.cuda.")
        return cuda, LEGACY_TYPES.get(t.rpartition(".")[2]) if t.startswith("torch.") else None
    scalar = getattr(t, "dtype", None)
    if isinstance(t, type) and isinstance(scalar, torch.dtype):
        return bool(getattr(t, "is_cuda", False)), scalar
    return False, None


class _LegacyCudaType(type):
    """``torch.cuda.FloatTensor`` and its kin while a virtual GPU is on: calling one makes a
    tensor on the current virtual GPU (sizes, or data), ``isinstance`` asks the tensor's
    dtype and device."""

    dtype: torch.dtype
    virtual: EmulatedCuda

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        device = torch.device("cuda", cls.virtual.current_device())
        sizes = args[0] if len(args) == 1 and isinstance(args[0], torch.Size) else args or (0,)
        if all(isinstance(a, int) and not isinstance(a, bool) for a in sizes):
            return torch.empty(tuple(sizes), dtype=cls.dtype, device=device)
        return torch.tensor(args[0], dtype=cls.dtype, device=device)

    def __instancecheck__(cls, obj: Any) -> bool:
        return (isinstance(obj, torch.Tensor) and obj.dtype == cls.dtype
                and cls.virtual.virtual_device(obj).type == "cuda")


# what torch's indexing turns into an index tensor (``PySequence_Check`` in
# python_variable_indexing.cpp: numpy arrays are copied by a dispatched op, and keep values)
_SEQUENCES = (list, tuple, range)


def _has_sequence(index: Any) -> bool:
    """Whether ``index`` holds a sequence torch turns into an index tensor (cheap: every
    indexing of a virtual tensor asks)."""
    cls = type(index)
    if cls is list or cls is range:
        return True
    return cls is tuple and any(isinstance(e, _SEQUENCES) for e in index)


def _host_index(index: Any) -> Any:
    """``index`` with each sequence torch would turn into an index tensor made a host tensor
    of the dtype torch gives it (bool or uint8 kept, others int64): as torch wraps an index
    (``wrapTuple``), a tuple's sequences are, and a list's where NumPy's rule reads it as a
    tuple (it holds a sequence, a slice, a tensor, None or ``...``, and has under 32
    items); any other list is one index. What torch would refuse stays as it is, for
    torch's own error."""
    if type(index) is tuple:
        return tuple(_host_sequence(e) for e in index)
    if len(index) < 32 and any(isinstance(e, (*_SEQUENCES, slice, torch.Tensor))
                               or e is None or e is Ellipsis for e in index):
        return [_host_sequence(e) for e in index]  # a list still: torch's warning kept
    return _host_sequence(index)


def _warning_as_torch(op: Callable[..., Any], *args: Any) -> Any:
    """``op(*args)`` (torch's indexing), its warnings given at the program's line, where
    torch's C++ gives them when the program calls it (called from here, they were given at
    this module's, once for all the program's lines)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = op(*args)
    for w in caught:
        warnings.warn(w.message, w.category, stacklevel=3)
    return out


def _host_sequence(seq: Any) -> Any:
    if not isinstance(seq, _SEQUENCES):
        return seq
    try:
        made = ORIGINALS["tensor"](seq)
    except (TypeError, ValueError, RuntimeError):
        return seq
    return made if made.dtype in (torch.bool, torch.uint8) else made.to(torch.long)


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


def _int_device(orig: Callable[..., Any], rt: CudaDevices) -> Callable[..., Any]:
    """``orig`` with ``device=k`` (an int) read as ``cuda:k``, as on a CUDA machine; where
    the device it is given or takes (a constructor of torch's, under ``torch.device(d)``) is
    meta, what it makes is the program's own meta tensors (:mod:`dpprof.emulator.user_meta`)."""
    constructor = orig in _device._device_constructors()

    @functools.wraps(orig)
    def call(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None:
            device = kwargs["device"] = _cuda_if_int(device)
        elif constructor:
            device = default_device()
        with rt.asking_for(device):
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
