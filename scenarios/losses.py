"""Which calls are a script's loss: one rule, for the loss moved inside forward (``dpprof
run``'s alternative), for the "loss" the run as written files its memory under, and for what
:class:`~dpprof.scenarios.model_with_loss.ModelWithLoss` divides a replica's loss by
(:mod:`dpprof.scenarios.loss_mean`).

A loss is called on the model's outputs and the batch's targets, in one of three forms:

- an instance of torch's loss modules (``nn.CrossEntropyLoss()``: ``nn.modules.loss._Loss``);
- a function of ``torch.nn.functional`` that torch's loss modules compute with
  (``F.cross_entropy``, ``F.nll_loss`` ...), or a ``functools.partial`` of one: read from
  those modules' own ``forward``, so a torch that adds a loss adds it here;
- a module of the script's or a library's that holds no parameters, called with two
  arguments or more (a focal loss, timm's ``LabelSmoothingCrossEntropy``): a module with
  parameters is a model, one called on one argument an activation (``nn.Sigmoid()``).
"""

from __future__ import annotations

import ast
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import nn

__all__ = ["LOSS_FORMS", "as_module_call", "functional_loss_names", "functional_losses",
           "is_functional_loss", "is_loss"]

# what a loss is, in one clause of a message that says a call was not one
LOSS_FORMS = ("a loss is an nn loss module, one of torch.nn.functional's losses, or a "
              "module without parameters called on the outputs and the targets")


@functools.cache
def _callers() -> dict[str, tuple[type[nn.Module], ...]]:
    """The name of each function of ``torch.nn.functional`` that a loss module of torch calls
    in its ``forward``, and the modules that call it."""
    import torch.nn.modules.loss as losses

    callers: dict[str, list[type[nn.Module]]] = {}
    for cls in ast.parse(inspect.getsource(losses)).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for fn in cls.body:
            if not (isinstance(fn, ast.FunctionDef) and fn.name == "forward"):
                continue
            for node in ast.walk(fn):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "F"):
                    callers.setdefault(node.func.attr, []).append(getattr(losses, cls.name))
    return {name: tuple(classes) for name, classes in sorted(callers.items())
            if callable(getattr(F, name, None))}


@functools.cache
def _modules_by_function() -> dict[Callable[..., Any], tuple[type[nn.Module], ...]]:
    """:func:`_callers` by the function itself (the original, where one is patched)."""
    return {_original(getattr(F, name)): classes for name, classes in _callers().items()}


def functional_losses() -> frozenset[Callable[..., Any]]:
    """The functions of ``torch.nn.functional`` that torch's loss modules call in their
    ``forward`` (the originals)."""
    return frozenset(_modules_by_function())


def functional_loss_names() -> list[str]:
    """The names under ``torch.nn.functional`` of :func:`functional_losses`."""
    return list(_callers())


def is_functional_loss(fn: Any) -> bool:
    """Whether ``fn`` is one of :func:`functional_losses` (or a patch or a partial of one)."""
    try:
        return callable(fn) and _original(fn) in _modules_by_function()
    except TypeError:  # a callable that cannot be hashed: not a function of torch's
        return False


def is_loss(callee: Any, n_args: int) -> bool:
    """Whether a call of ``callee`` with ``n_args`` arguments (positional and keyword) is a
    loss by the rule of this module."""
    if isinstance(callee, nn.modules.loss._Loss):
        return True
    if isinstance(callee, nn.Module):
        return n_args >= 2 and next(iter(callee.parameters()), None) is None
    return is_functional_loss(callee)


def as_module_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
                   ) -> tuple[nn.Module, tuple[Any, ...]] | None:
    """The call ``fn(*args, **kwargs)`` of a functional loss as the loss module that computes
    the same, and that module's arguments (``F.cross_entropy(x, y, ignore_index=0)``:
    ``nn.CrossEntropyLoss(ignore_index=0)`` and ``(x, y)``), its settings the call's; None
    where torch has no single such module, or the call's arguments do not bind."""
    classes = _modules_by_function().get(_original(fn), ())
    if len(classes) != 1:
        return None
    (cls,) = classes
    try:
        bound = inspect.signature(_original(fn)).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    settings = inspect.signature(cls.__init__).parameters
    given = {name: value for name, value in bound.arguments.items()
             if name in settings and name != "self"}
    try:
        module = cls(**given)
    except (TypeError, ValueError):
        return None
    return module, tuple(bound.arguments.values())[:2]


def _original(fn: Any) -> Any:
    while isinstance(fn, functools.partial):
        fn = fn.func
    try:
        return inspect.unwrap(fn) if callable(fn) else fn
    except ValueError:  # a cycle of __wrapped__
        return fn
