"""The output of an op whose shape depends on values (``x[mask]``, ``nonzero``, ``unique``)
over a virtual GPU's tensors, which hold none (meta tensors).

The shape is computed on the host, from the values the emulation follows
(:class:`dpprof.emulator.small_values.SmallValues`) where it has them; else from the
stand-ins a host copy reads (:data:`dpprof.emulator.stand_in_values.STAND_INS`: zeros, so a
mask of them selects nothing), and that shape is counted as a stand-in at the script's
line, which the report names. The output is allocated on the inputs' GPU with the shape it
has; a mask indexes by its positions first, as ATen's ``expandTensors`` does."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from dpprof.emulator.small_values import SmallValues
from dpprof.emulator.storage_ledger import StorageLedger
from dpprof.emulator.value_traits import tensors

__all__ = ["ValueShapes", "by_mask_positions", "by_values"]

aten = torch.ops.aten
# Tensor.is_meta as torch answers it (the emulation patches the property)
_is_meta: Callable[[torch.Tensor], bool] = torch._C.TensorBase.__dict__["is_meta"].__get__


class ValueShapes(Protocol):
    """What of the runtime (:class:`dpprof.emulator.cuda_devices.CudaDevices`) this asks."""

    small_values: SmallValues | None
    storages: StorageLedger
    base: torch.device

    @property
    def current_device(self) -> int: ...

    def placing_on(self, index: int) -> contextlib.AbstractContextManager[None]: ...

    def dispatch_counted(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any: ...

    def stand_in(self, kind: str, t: torch.Tensor) -> None: ...


def by_values(rt: ValueShapes, func: Any, types: Any, args: Any, kwargs: dict[str, Any],
              stand_ins: bool = False) -> Any:
    """``func``'s output, of the shape its inputs' values give it (followed ones; with
    ``stand_ins``, the stand-ins of the others, counted): allocated on the inputs' GPU.
    None where the values are not known (and no stand-ins are taken)."""
    values = rt.small_values
    metas = [a for a in tensors(args, kwargs) if _is_meta(a)]
    if values is None or not metas:  # the host's own op: the host runs it
        return None
    real = values.compute(func, args, kwargs)
    known = None
    if real is None:  # the positions known, the values moved known in part or not
        parts = values.compute_partly(func, args, kwargs)
        if parts is not None and len(parts) == 1:
            real, known = parts[0]
    if real is None and stand_ins:
        real = _over_stand_ins(values, func, args, kwargs)
        if real is not None:
            rt.stand_in("shape", metas[0])
    flat, spec = tree_flatten(real)
    if real is None or not all(isinstance(r, torch.Tensor) for r in flat):
        return None
    where = [rt.storages.device_of(a) for a in metas]
    made = []
    with rt.placing_on(where[0] if where else rt.current_device):
        for r in flat:
            out = rt.dispatch_counted(aten.empty_strided.default, types,
                                      (list(r.shape), list(r.stride())),
                                      {"dtype": r.dtype, "device": rt.base})
            values.keep(out, r, known)
            made.append(out)
    return tree_unflatten(made, spec)


def by_mask_positions(rt: ValueShapes, func: Any, types: Any, args: Any,
                      kwargs: dict[str, Any], stand_ins: bool = False) -> Any:
    """``x[mask]`` with boolean masks on a virtual GPU and an ``x`` whose values are not
    followed (an activation; its gradient in the backward of ``x[mask] = v``): indexed as
    ATen's ``expandTensors`` indexes, each mask's positions first (``nonzero``, an
    allocation of its own until the op returns), then ``x`` by them. A mask's positions
    come from its values followed (with ``stand_ins``, else from its stand-ins: none);
    None where they are not known."""
    indices: list[Any] = []
    positions = []  # kept until the op has run, as the GPU keeps nonzero's output
    for ix in args[1]:
        if not (isinstance(ix, torch.Tensor) and ix.dtype == torch.bool and _is_meta(ix)):
            indices.append(ix)
            continue
        found = by_values(rt, aten.nonzero.default, types, (ix,), {}, stand_ins)
        if found is None:
            return None
        positions.append(found)
        indices += [found.select(1, d) for d in range(ix.dim())]
    return rt.dispatch_counted(func, types, (args[0], indices, *args[2:]), kwargs)


def _over_stand_ins(values: SmallValues, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """``func`` on the host over its inputs' values, each tensor of a virtual GPU whose
    values are not followed standing in with zeros (a host copy's stand-ins; expanded from
    one element, so none is allocated for them); None where the host cannot run it."""
    def real(a: Any) -> Any:
        if isinstance(a, torch.device):
            return torch.device("cpu")
        if not (isinstance(a, torch.Tensor) and _is_meta(a)):
            return a
        known = values.value_of(a)
        return known if known is not None else torch.zeros((), dtype=a.dtype).expand(a.shape)

    flat, spec = tree_flatten((args, kwargs))
    real_args, real_kwargs = tree_unflatten([real(a) for a in flat], spec)
    try:
        with _disable_current_modes():
            return func(*real_args, **real_kwargs)
    except Exception:  # a kernel the host lacks for this dtype
        return None

