"""The program's own meta tensors, told apart from the virtual GPUs' (which are meta
underneath too).

A program asks for meta tensors to build a model without memory (``with
torch.device("meta")``, ``device="meta"``, ``.to("meta")``: torchtitan, Lightning's
``init_module(empty_init=True)``, accelerate's ``init_empty_weights``) and then gives them
memory on a GPU (``to_empty``). On a GPU machine those tensors are on no device and hold no
bytes; here they must not be counted on a virtual GPU, must say ``device(type='meta')``,
and cannot be copied out (torch's own error, which the frameworks expect).

The device argument alone cannot tell them apart in dispatch: torch's C++ code that makes a
tensor "like" an emulated one passes ``device=meta`` too, as do torch's Python
decompositions while the emulation dispatches (``device=a.device``) and dpprof's own code
(the emulator's base). What the program asked is seen where it asks, at the Python call
(:func:`asked_by_program`, then :meth:`UserMeta.asked`), and what it computes from its own
meta tensors alone is its own meta tensors again (:meth:`UserMeta.reads`).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch.utils import _device
from torch.utils._pytree import tree_leaves

from dpprof.emulator.call_sites import in_dpprof
from dpprof.emulator.identity import storage_key

# Tensor.is_meta as torch answers it (the emulation patches the property)
_on_meta: Any = torch._C.TensorBase.__dict__["is_meta"].__get__

# torch's own message where a meta tensor is copied to a device (Tensor.to, copy_):
# libraries catch it and fall back to Module.to_empty
CANNOT_COPY_OUT = ("Cannot copy out of meta tensor; no data! Please use "
                   "torch.nn.Module.to_empty() instead of torch.nn.Module.to() when moving "
                   "module from meta to a different device.")


def names_meta(device: Any) -> bool:
    """Whether a ``device=`` argument is the meta device."""
    if isinstance(device, str):
        return device == "meta" or device.startswith("meta:")
    return isinstance(device, torch.device) and device.type == "meta"


# the emulator's patched entry points of the tensor API, and the runtime that asks: a call
# through them is its caller's
_ENTRY_POINT_FILES = frozenset(str(Path(__file__).parent / name)
                               for name in ("tensor_api.py", "virtual_cuda.py", "cuda_devices.py"))


def asked_by_program(device: Any) -> bool:
    """Whether a ``device=`` given at a Python call (a patched entry point of the tensor API)
    is the program asking for its own meta tensors: meta, and not asked by dpprof's own code
    (the emulator's base, which is meta)."""
    if not names_meta(device):
        return False
    f: FrameType | None = sys._getframe(1)
    while f is not None and f.f_code.co_filename in _ENTRY_POINT_FILES:
        f = f.f_back
    return f is None or not in_dpprof(f.f_code.co_filename)


def default_device() -> torch.device | None:
    """The device torch's constructors take when given none (None: their own default):
    the innermost ``DeviceContext`` on the torch function mode stack (``with
    torch.device(d)`` pushes one without entering it, so torch's ``CURRENT_DEVICE`` does
    not say; ``torch.set_default_device(d)`` enters one)."""
    depth = torch._C._len_torch_function_stack()
    if not depth or not torch._C._is_torch_function_mode_enabled():
        return None
    for i in range(depth - 1, -1, -1):
        mode = torch._C._get_function_stack_at(i)
        if isinstance(mode, _device.DeviceContext):
            return mode.device  # type: ignore[no-any-return]
    return None


class UserMeta:
    """The storages of the program's own meta tensors (weakly held), and whether a call of
    the program's that asks for meta tensors is under way."""

    def __init__(self) -> None:
        self.asking = False
        self._storages: dict[int, weakref.ref[Any]] = {}

    def __bool__(self) -> bool:
        return bool(self._storages)

    @contextlib.contextmanager
    def asked(self) -> Iterator[None]:
        """The storages made until it ends are the program's meta tensors."""
        before, self.asking = self.asking, True
        try:
            yield
        finally:
            self.asking = before

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is one of the program's meta tensors."""
        if not self._storages:
            return False
        st = t.untyped_storage()
        ref = self._storages.get(storage_key(st))
        return ref is not None and ref() is st

    def holds_or_wraps(self, t: torch.Tensor) -> bool:
        """:meth:`holds`, or ``t`` wraps one (a DTensor's local shard: the wrapper's own
        storage holds nothing, and is meta here whatever its shard is)."""
        if not self._storages:
            return False
        local = getattr(t, "_local_tensor", None)
        return self.holds(local if isinstance(local, torch.Tensor) else t)

    def reads(self, args: Any, kwargs: dict[str, Any] | None) -> bool:
        """Whether an op reads the program's meta tensors and no other tensor, and is given
        no other device: then what it makes is the program's meta tensors, as on a GPU
        machine. (Beside a tensor of a virtual GPU, the GPU's rules place it.)"""
        if not self._storages:
            return False
        if kwargs and kwargs.get("device") is not None and not names_meta(kwargs["device"]):
            return False
        tensor = torch.Tensor
        found = False
        for a in (*args, *kwargs.values()) if kwargs else args:
            for b in ((a,) if isinstance(a, tensor) else a if isinstance(a, (list, tuple))
                      else ()):
                if isinstance(b, tensor):
                    if not self.holds(b):
                        return False
                    found = True
        return found

    def remember(self, out: Any) -> None:
        """The tensors of ``out`` (any nesting) are the program's meta tensors."""
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _on_meta(t):
                st = t.untyped_storage()
                key = storage_key(st)
                self._storages[key] = weakref.ref(
                    st, lambda _ref, key=key: self._storages.pop(key, None))  # type: ignore[misc]
