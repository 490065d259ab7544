"""The paired scenarios and the one training step that every backend runs.

| name              | what runs                                       | where the loss is      |
| ----------------- | ----------------------------------------------- | ---------------------- |
| `dp-loss-primary` | ``nn.DataParallel(model)``; outputs gathered    | on cuda:0, whole batch |
| `dp-loss-forward` | ``nn.DataParallel(ModelWithLoss(model, loss))`` | on each replica        |
| `ddp`             | ``DistributedDataParallel``, one rank per GPU   | on each rank           |
| `single`          | one GPU, batch = ceil(B / N)                    | the floor to approach  |

The measured step (:func:`train_step`): the batch, already moved to the device, goes
through forward, loss, backward, ``optimizer.step()`` and ``zero_grad(set_to_none=True)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

DP_LOSS_PRIMARY = "dp-loss-primary"
DP_LOSS_FORWARD = "dp-loss-forward"
DDP = "ddp"
SINGLE = "single"

SCENARIOS: tuple[str, ...] = (DP_LOSS_PRIMARY, DP_LOSS_FORWARD, DDP, SINGLE)

DESCRIPTIONS: dict[str, str] = {
    DP_LOSS_PRIMARY: "nn.DataParallel(model); outputs gathered on cuda:0, loss there",
    DP_LOSS_FORWARD: "nn.DataParallel(ModelWithLoss(model, loss)); loss on each replica",
    DDP: "DistributedDataParallel, one process per GPU, each its shard",
    SINGLE: "one GPU with batch ceil(B / N): the floor a balanced scheme approaches",
}

PHASES: tuple[str, ...] = ("inputs", "forward", "loss", "backward", "optimizer", "zero_grad")


def batch_rows(x: Any) -> int:
    """Rows (dim 0) of the first tensor found in ``x`` (a tensor, tuple, list or dict)."""
    if isinstance(x, torch.Tensor):
        return int(x.shape[0]) if x.dim() > 0 else 1
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        for v in x:
            n = batch_rows(v)
            if n:
                return n
    return 0


def as_args(inputs: Any) -> tuple[Any, ...]:
    """A workload's inputs as the positional arguments of the model."""
    return inputs if isinstance(inputs, tuple) else (inputs,)


class ModelWithLoss(nn.Module):
    """Compute the loss inside ``forward``, on every replica: the DataParallel fix.

    Wrap the model and the loss, give DataParallel the targets too, and combine::

        model = nn.DataParallel(dpprof.ModelWithLoss(model, loss_fn))
        loss = dpprof.ModelWithLoss.combine(model(inputs, targets))
        loss.backward()

    cuda:0 then receives one number per GPU instead of the whole batch's outputs, and the
    loss, its temporaries and its gradient are computed per replica. Each replica returns
    ``(loss * rows, rows)``, so :meth:`combine` weights replicas by their share of the
    batch: the same number as the loss over the whole batch even when the shards are uneven
    (a plain ``.mean()`` of the per-replica losses is not).
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, inputs: Any, targets: Any) -> tuple[torch.Tensor, torch.Tensor]:
        outputs = self.model(*as_args(inputs))
        loss = self.loss_fn(outputs, targets)
        rows = float(batch_rows(targets) or batch_rows(inputs))
        return loss.reshape(1) * rows, loss.new_full((1,), rows)

    @staticmethod
    def combine(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The batch loss from the gathered ``(loss * rows, rows)`` of every replica."""
        weighted, rows = out
        return weighted.sum() / rows.sum()


@dataclass
class StepHooks:
    """What a backend plugs into :func:`train_step`."""

    phase: Callable[[str], contextlib.AbstractContextManager[None]]
    after_forward: Callable[[Any], None] = lambda outputs: None
    after_loss: Callable[[torch.Tensor, Any], None] = lambda loss, outputs: None
    after_backward: Callable[[], None] = lambda: None
    after_optimizer: Callable[[], None] = lambda: None


@contextlib.contextmanager
def _no_phase(name: str) -> Iterator[None]:
    yield


def train_step(
    model: Callable[..., Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    inputs: Any,
    targets: Any,
    loss_inside: bool,
    hooks: StepHooks | None = None,
) -> torch.Tensor:
    """One training step, the same for every scenario and backend; returns the loss.

    ``model`` is the wrapped model (DataParallel, DDP or the bare model); with
    ``loss_inside`` it is a :class:`ModelWithLoss` inside and gets the targets too.
    """
    hooks = hooks or StepHooks(phase=_no_phase)
    with hooks.phase("forward"):
        outputs = model(inputs, targets) if loss_inside else model(*as_args(inputs))
        hooks.after_forward(outputs)
    with hooks.phase("loss"):
        loss = ModelWithLoss.combine(outputs) if loss_inside else loss_fn(outputs, targets)
        hooks.after_loss(loss, outputs)
    del outputs
    with hooks.phase("backward"):
        loss.backward()
        hooks.after_backward()
    with hooks.phase("optimizer"):
        optimizer.step()
        hooks.after_optimizer()
    with hooks.phase("zero_grad"):
        optimizer.zero_grad(set_to_none=True)
    return loss.detach()
