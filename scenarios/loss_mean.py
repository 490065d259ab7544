"""What a loss module's mean divides by, so per-replica losses combine into the whole batch's.

``nn.CrossEntropyLoss()(logits, y)`` with ``reduction="mean"`` is the sum over the batch
divided by a denominator that is not always the rows: the targets that are not
``ignore_index`` (weighted by ``weight[target]`` where the loss has class weights), every
element for ``nn.MSELoss``, the rows for ``KLDivLoss(reduction="batchmean")``. Computed on
each replica's shard, the whole batch's loss is ``sum_i loss_i * d_i / sum_i d_i`` with
``d_i`` that replica's denominator: :class:`~dpprof.scenarios.model_with_loss.ModelWithLoss`
returns ``(loss_i * d_i, d_i)`` and combines them so. A loss with ``reduction="sum"`` adds
up instead: its shards add up (:func:`sums`; the replicas return ``(loss_i, -1)``, which
``combine`` adds).

:func:`loss_calls` records the losses a loss function calls (``lambda out, y:
criterion(out.view(-1, V), y.view(-1))``, ``F.cross_entropy(..., ignore_index=-1)``), so the
denominator of the one loss behind it can be read.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from dpprof.scenarios.losses import as_module_call, is_functional_loss

# losses whose mean is over every element of the (broadcast) input and target
_ELEMENTWISE = (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss,
                nn.BCEWithLogitsLoss, nn.SoftMarginLoss, nn.PoissonNLLLoss)
# losses whose mean is over the rows (each row's own mean or sum first)
_PER_ROW = (nn.MultiLabelSoftMarginLoss, nn.MultiMarginLoss, nn.MultiLabelMarginLoss)


def denominator(loss_fn: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> torch.Tensor | None:
    """What ``loss_fn(*args, **kwargs)`` divided its sum by, as a 1-element float32 tensor
    on the loss's device; None where not known (or it sums)."""
    reduction = getattr(loss_fn, "reduction", None)
    inputs = args[0] if args else kwargs.get("input")
    target = args[1] if len(args) > 1 else kwargs.get("target")
    if not isinstance(inputs, torch.Tensor) or not isinstance(target, torch.Tensor):
        return None
    if reduction != "mean" and not (reduction == "batchmean" and isinstance(loss_fn,
                                                                           nn.KLDivLoss)):
        return None
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)):
        if target.is_floating_point():  # class probabilities: the mean is over the rows
            rows = inputs.numel() // inputs.size(1) if inputs.dim() >= 2 else 1
            return _count(inputs, rows)
        kept = target != loss_fn.ignore_index
        weight = loss_fn.weight
        if weight is None:
            return kept.sum().reshape(1).to(torch.float32)
        # torch's weighted mean: the weights of the targets kept (nll_loss's total_weight)
        safe = torch.where(kept, target, torch.zeros_like(target))
        return (weight[safe] * kept).sum().reshape(1).to(torch.float32)
    if isinstance(loss_fn, nn.KLDivLoss):
        if reduction == "batchmean":
            return _count(inputs, inputs.size(0) if inputs.dim() else 1)
        return _count(inputs, torch.broadcast_shapes(inputs.shape, target.shape).numel())
    if isinstance(loss_fn, _ELEMENTWISE):
        return _count(inputs, torch.broadcast_shapes(inputs.shape, target.shape).numel())
    if isinstance(loss_fn, _PER_ROW):
        return _count(inputs, inputs.size(0) if inputs.dim() > 1 else 1)
    return None


def sums(loss_fn: nn.Module) -> bool:
    """Whether ``loss_fn``, one of torch's losses, adds its elements up
    (``reduction="sum"``): the whole batch's loss is then the sum of the replicas'."""
    return getattr(loss_fn, "reduction", None) == "sum"


def _count(like: torch.Tensor, n: int) -> torch.Tensor:
    return like.new_full((1,), float(n), dtype=torch.float32)


_recording = threading.local()  # this thread's list of (loss module, args, kwargs, output)


def _record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            output: Any) -> None:
    calls = getattr(_recording, "calls", None)
    if calls is not None and isinstance(module, nn.modules.loss._Loss):
        if calls and calls[-1][3] is output:  # the function its forward returned: one call
            calls.pop()
        calls.append((module, args, kwargs, output))


class _FunctionalLosses(TorchFunctionMode):
    """Records each call of a loss function of ``torch.nn.functional`` (whatever name the
    code calls it by) as the loss module that computes the same
    (:func:`dpprof.scenarios.losses.as_module_call`)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        calls = getattr(_recording, "calls", None)
        if calls is not None and is_functional_loss(func):
            as_module = as_module_call(func, args, kwargs)
            if as_module is not None:
                calls.append((as_module[0], as_module[1], {}, out))
        return out


@contextlib.contextmanager
def loss_calls() -> Iterator[list[tuple[nn.Module, tuple[Any, ...], dict[str, Any], Any]]]:
    """The losses called on this thread inside the block, as loss modules (a function of
    ``torch.nn.functional`` as the module that computes the same), with their arguments and
    output (DataParallel's replicas run in threads of their own: each records its own)."""
    outer = getattr(_recording, "calls", None)
    calls: list[tuple[nn.Module, tuple[Any, ...], dict[str, Any], Any]] = []
    _recording.calls = calls
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, a, k, o: _record(m, a, k, o), with_kwargs=True)
    try:
        with _FunctionalLosses():
            yield calls
    finally:
        handle.remove()
        _recording.calls = outer
