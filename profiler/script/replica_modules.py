"""The modules the loss-inside-forward alternative runs on each replica
(:mod:`dpprof.script.deferred_outputs`): the model's forward with its outputs held for a
loss to come (:class:`HeldForward`), and ``ModelWithLoss`` noting each replica's outputs
(:func:`recording_class`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from dpprof.scenarios.model_with_loss import (
    NO_TARGETS,
    ModelWithLoss,
    call_model,
    nothing_to_gather,
)


class HeldForward(nn.Module):
    """The model's forward on each replica, its outputs kept (and their shapes noted) for a
    loss computed beside them; what it returns for DataParallel to gather is empty."""

    shapes: list[Any]
    kept: list[Any]

    def __init__(self, model: nn.Module, dim: int = 0) -> None:
        super().__init__()
        self.model = model
        self.dim = dim  # DataParallel's, which the empty result is gathered along

    def forward(self, inputs: Any) -> torch.Tensor:
        outputs = call_model(self.model, inputs)
        self.shapes.append(tree_map(shape_only, outputs))
        self.kept.append(outputs)
        first = next((t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)), None)
        return nothing_to_gather(first, self.dim)


def recording_class() -> type:
    class RecordingModelWithLoss(ModelWithLoss):
        """``ModelWithLoss`` that notes each replica's output shapes (for stand-ins)."""

        shapes: list[Any]
        kept: list[Any]  # each replica's outputs, in the order the replicas ran

        def forward(self, inputs: Any, targets: Any = NO_TARGETS, *more_targets: Any) -> Any:
            outputs = call_model(self.model, inputs)
            if targets is NO_TARGETS:  # a call for the outputs alone, as ModelWithLoss's
                return outputs
            self.shapes.append(tree_map(shape_only, outputs))
            self.kept.append(outputs)
            weighted, count = self.weighted_loss(outputs, targets, inputs, more_targets)
            return (weighted, count, outputs) if self.keep_outputs else (weighted, count)

    return RecordingModelWithLoss


def shape_only(leaf: Any) -> Any:
    """A leaf of a replica's outputs as its stand-in is made of: a tensor's (shape, dtype), a
    plain value itself, any other object nothing (a cache of keys and values the outputs
    carry would stay alive with it)."""
    if isinstance(leaf, torch.Tensor):
        return (tuple(leaf.shape), leaf.dtype)
    return leaf if isinstance(leaf, (int, float, str, bool)) else None
