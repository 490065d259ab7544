"""The loss computed on each GPU by DataParallel's replicas: told where the script computes
it so (the scenario is then ``dp-loss-forward``, the fix the loss-inside-forward alternative
would make), and a DataParallel around a criterion as a DDP rank computes it.

The replicas return their losses where the model returns one number (or a mapping with a
"loss", as Hugging Face's models do) or is a :class:`ModelWithLoss`.

PyTorch-Encoding's ``DataParallelCriterion``, copied into many segmentation repositories
(CCNet, OCNet, DANet, CE2P), wraps the criterion, a module with no parameters, in a
DataParallel subclass whose forward takes the replicas' outputs (left on their GPUs by a
``DataParallelModel``, whose ``gather`` returns them as they are), scatters the targets and
applies the criterion on each GPU, each in a thread of its own; torch's DataParallel around a
criterion does the same from gathered outputs. Either way each replica computes its own loss:
the scenario is ``dp-loss-forward``, the fix the loss-inside-forward alternative would make.

Under DDP the wrapper has no part: DDP refuses a module with no parameter to train, and a rank
applies the criterion to its own outputs and its share of the targets, as the wrapper applies
it to each replica. A subclass's forward of its own calls the criterion as PyTorch-Encoding's
does, a replica's outputs first and spread (``module(*(output + targets))``, a lone tensor as
a tuple of one); torch's forward calls it with what it was given, as its replicas are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from dpprof.scenarios.model_with_loss import ModelWithLoss
from dpprof.script.parallel_state import current
from dpprof.script.rewrite import Rewrite

if TYPE_CHECKING:
    from dpprof.script.wrappers import VirtualDataParallel


def note_replica_losses(module: nn.Module, outputs: Sequence[Any]) -> None:
    """After DataParallel's parallel_apply: the replicas computed their losses (with
    ModelWithLoss's keep_outputs, or a model that returns its loss under "loss" beside its
    other outputs, the outputs gathered beside it)."""
    if isinstance(module, ModelWithLoss) or all(
            t.numel() == 1 for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)) or (
            outputs and isinstance(outputs[0], Mapping)
            and isinstance(outputs[0].get("loss"), torch.Tensor)):
        current().log.replica_scalars = True


def wraps_a_criterion(dp: VirtualDataParallel) -> bool:
    """Whether ``dp`` wraps a module with no parameters (a criterion)."""
    return next(iter(dp.module.parameters()), None) is None


def note_loss_on_each_gpu(dp: VirtualDataParallel, result: Any) -> None:
    """After ``dp``'s forward as written: a criterion's wrapper that returned one number
    computed the loss on each GPU."""
    if (isinstance(result, torch.Tensor) and result.numel() == 1
            and wraps_a_criterion(dp)):
        current().log.replica_scalars = True


def criterion_on_the_rank(dp: VirtualDataParallel, own_forward: bool,
                          inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What a DDP rank computes in place of ``dp``'s forward around a criterion: the
    criterion on the rank's own outputs and targets, called as the wrapper calls it on each
    replica (see the module), on the rank's GPU."""
    criterion: nn.Module = dp.module
    log = current().log
    if own_forward and inputs:
        outputs, *targets = inputs
        first = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
        call = f"{type(criterion).__name__}(*outputs, *targets)"
        inputs = (*first, *targets)
    else:
        call = f"{type(criterion).__name__}(outputs, targets)"
    words = (f"{dp.class_words()} wraps {type(criterion).__name__}, which has no parameters: "
             f"no DDP around it (DDP refuses a module with no parameter to train); each rank "
             f"applies it to its own outputs and its share of the targets, {call}, as "
             f"{dp.class_words()} applies it on each GPU")
    if words not in log.rank_criteria:
        log.rank_criteria.append(words)
    return criterion(*inputs, **kwargs)


def with_criteria_unwrapped(rewrite: Rewrite, rank_criteria: Sequence[str]) -> Rewrite:
    """The DDP change ``rewrite`` told, besides, to unwrap each criterion the DDP rank
    applied itself (``rank_criteria``: how, in words)."""
    for words in rank_criteria:
        change = f"{words}: unwrap it and compute the loss so"
        rewrite = (dataclasses.replace(rewrite, notes=(*rewrite.notes, change)) if rewrite.ok
                   else dataclasses.replace(rewrite, reason=f"{rewrite.reason}; {change}"))
    return rewrite
