"""A loss's own state on every replica, as DataParallel gives a module's.

A loss module may hold tensors: ``nn.CrossEntropyLoss(weight=w)`` its class weights, a centre
loss its learned centres. Moved inside ``forward`` (:class:`ModelWithLoss`), the loss runs
on each replica's GPU, and DataParallel copies there only the parameters and buffers of the
modules it wraps. A loss given as a module is one of them; a loss given as a function (a
lambda of two losses, a ``functools.partial``) reaches its modules through the function's
names, which DataParallel does not see, so cuda:1's replica would read cuda:0's weights and
fail ("Expected all tensors to be on the same device").

:func:`modules_of` finds the modules a function computes with, for the wrapper to hold as
submodules (replicated with the model); :func:`on_the_replica` then has the function, run on
a replica, read that replica's copies wherever it reaches an original's parameter or buffer
(the model's too: a loss that reads a tied weight). The copies are DataParallel's own, made
by its broadcast: gradients reach the originals as they do from the model's."""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from dpprof.emulator.call_sites import in_torch

__all__ = ["modules_of", "on_the_replica"]

# the wrappers whose replicas are not the loss's (a loss that names the DataParallel model
# reads its module, which the wrapper holds already)
_WRAPPERS = (nn.DataParallel, nn.parallel.DistributedDataParallel)


def modules_of(loss_fn: Callable[..., Any], beside: nn.Module) -> list[nn.Module]:
    """The modules ``loss_fn`` (a function, a partial, a bound method) computes with, found in
    its closure, defaults, partial arguments and the global names its code reads (and their
    attributes it reads: ``self.criterion``), outermost only, without ``beside``'s (the
    model, replicated already) and without DataParallel and DDP wrappers."""
    held = {id(t) for t in _tensors(beside)}
    found: dict[int, nn.Module] = {}
    for value in _reached(loss_fn, set()):
        if (isinstance(value, nn.Module) and not isinstance(value, _WRAPPERS)
                and not any(id(t) in held for t in _tensors(value))):
            found.setdefault(id(value), value)
    inner = {id(m) for module in found.values() for m in list(module.modules())[1:]}
    return [m for key, m in found.items() if key not in inner]


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _reached(fn: Any, seen: set[int]) -> Iterator[Any]:
    """The values ``fn`` computes with: for a function its closure's, its defaults', the
    globals its code names and their attributes it names; a partial's function and
    arguments; a bound method's object and its attributes the method names."""
    if id(fn) in seen:
        return
    seen.add(id(fn))
    if isinstance(fn, functools.partial):
        yield from _reached(fn.func, seen)
        for value in (*fn.args, *fn.keywords.values()):
            yield value
            yield from _reached(value, seen)
    elif isinstance(fn, types.MethodType):
        yield fn.__self__
        if isinstance(fn.__func__, types.FunctionType):
            yield from _attributes(fn.__self__, _names(fn.__func__.__code__))
        yield from _reached(fn.__func__, seen)
    elif isinstance(fn, types.FunctionType) and not in_torch(fn.__code__.co_filename):
        # (torch's own functions hold no module of the script's)
        names = _names(fn.__code__)
        values = [c.cell_contents for c in fn.__closure__ or () if _filled(c)]
        values += [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()]
        values += [fn.__globals__[n] for n in names if n in fn.__globals__]
        for value in values:
            yield value
            yield from _attributes(value, names)
            if isinstance(value, (types.FunctionType, functools.partial, types.MethodType)):
                yield from _reached(value, seen)


def _attributes(value: Any, names: list[str]) -> Iterator[nn.Module]:
    """The modules among ``value``'s attributes of ``names`` (``self.criterion``), where
    ``value`` is an object of the script's (not a module, a Python module or a class)."""
    if isinstance(value, (nn.Module, types.ModuleType, type)):
        return
    for name in names:
        try:
            found = getattr(value, name, None)
        except Exception:  # a property that raises: not a module it holds
            continue
        if isinstance(found, nn.Module):
            yield found


def _names(code: types.CodeType) -> list[str]:
    """The global and attribute names ``code`` and the functions inside it read, in the
    order the code first reads them (the modules found are held in it)."""
    out = dict.fromkeys(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out.update(dict.fromkeys(_names(const)))
    return list(out)


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018  (an empty cell raises)
    except ValueError:
        return False
    return True


def on_the_replica(replica: nn.Module, source: nn.Module) -> contextlib.AbstractContextManager[
        None]:
    """Inside it, on ``replica`` (DataParallel's copy of ``source``), every torch call that is
    given one of ``source``'s parameters or buffers is given the replica's copy instead;
    where the replica is ``source`` itself (one GPU), nothing changes."""
    if replica is source:
        return contextlib.nullcontext()
    copies: dict[int, torch.Tensor] = {}
    for original, copy in zip(source.modules(), replica.modules(), strict=True):
        for key, tensor in [*original._parameters.items(), *original._buffers.items()]:
            mirrored = getattr(copy, key, None)
            if tensor is not None and isinstance(mirrored, torch.Tensor):
                copies[id(tensor)] = mirrored
    return _Copies(copies)


class _Copies(TorchFunctionMode):
    """Each tensor argument with a copy given as that copy."""

    def __init__(self, copies: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.copies = copies

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        def copied(x: Any) -> Any:
            return self.copies.get(id(x), x) if isinstance(x, torch.Tensor) else x

        return func(*tree_map(copied, args), **tree_map(copied, kwargs or {}))
