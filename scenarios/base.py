"""The paired scenarios and the one training step that every backend runs.

| name              | what runs                                       | where the loss is      |
| ----------------- | ----------------------------------------------- | ---------------------- |
| `dp-loss-primary` | ``nn.DataParallel(model)``; outputs gathered    | on cuda:0, whole batch |
| `dp-loss-forward` | ``nn.DataParallel(ModelWithLoss(model, loss))`` | on each replica        |
| `ddp`             | ``DistributedDataParallel``, one rank per GPU   | on each rank           |
| `single`          | one GPU, batch = ceil(B / N)                    | the floor to approach  |

The measured loop (:func:`training_loop`): the PyTorch tutorial's loop in steady state,
several iterations in one scope, the last measured, every variable alive until the loop
rebinds it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
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

PHASES: tuple[str, ...] = ("inputs", "zero_grad", "forward", "loss", "backward", "optimizer")


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
        outputs = call_model(self.model, inputs)
        loss = self.loss_fn(outputs, targets)
        rows = float(batch_rows(targets) or batch_rows(inputs))
        return loss.reshape(1) * rows, loss.new_full((1,), rows)

    @staticmethod
    def combine(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The batch loss from the gathered ``(loss * rows, rows)`` of every replica."""
        weighted, rows = out
        return weighted.sum() / rows.sum()


@contextlib.contextmanager
def _no_phase(name: str) -> Iterator[None]:
    yield


@dataclass
class StepHooks:
    """What a backend plugs into :func:`training_loop`.

    ``phase(name)`` is entered around each phase of every iteration; ``iteration(k,
    measured)`` around the whole of iteration ``k`` (``measured``: the last one, from the
    moment its batch is assigned to the end of ``optimizer.step()``).
    """

    phase: Callable[[str], contextlib.AbstractContextManager[None]] = _no_phase
    after_forward: Callable[[Any], None] = lambda outputs: None
    after_loss: Callable[[torch.Tensor, Any], None] = lambda loss, outputs: None
    after_backward: Callable[[], None] = lambda: None
    after_optimizer: Callable[[], None] = lambda: None
    iteration: Callable[[int, bool], contextlib.AbstractContextManager[None]] = (
        lambda k, measured: contextlib.nullcontext())


LOOP_DESCRIPTION = (
    "the PyTorch tutorial loop in steady state: for inputs, targets in loader: inputs, "
    "targets = inputs.to(device), targets.to(device); optimizer.zero_grad(); "
    "outputs = model(inputs); loss = criterion(outputs, targets); loss.backward(); "
    "optimizer.step() -- {n} iterations in one scope, {measured} measured; every variable "
    "lives until the loop reassigns it (outputs and loss through backward and the optimizer "
    "step; the previous iteration's outputs and batch until the new ones are assigned)"
)


def loop_description(iterations: int, measured: int = 1) -> str:
    """The loop dpprof measured, in one sentence (for the report)."""
    which = "the last" if measured == 1 else f"the last {measured}"
    return LOOP_DESCRIPTION.format(n=iterations, measured=which)


def call_model(model: Callable[..., Any], inputs: Any) -> Any:
    """The model called on a workload's inputs: a dict as keyword arguments (``model(**batch)``,
    the Hugging Face way), a tuple as positional arguments, anything else as the one
    argument."""
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*as_args(inputs))


def training_loop(
    model: Callable[..., Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    batches: Sequence[tuple[Any, Any]],
    to_device: Callable[[Any, bool], Any],
    loss_inside: bool,
    hooks: StepHooks | None = None,
) -> torch.Tensor:
    """The measured loop, the same for every scenario and backend; returns the last loss.

    The PyTorch tutorial's loop, written out as users write it, over ``batches`` (the
    loader's host batches, one per iteration; the last iteration is the measured one)::

        for inputs, targets in loader:
            inputs, targets = inputs.to(device), targets.to(device)
            optimizer.zero_grad()
            outputs = model(inputs)
            loss = criterion(outputs, targets)
            loss.backward()
            optimizer.step()

    Every name lives until the loop rebinds it, as in Python: the previous iteration's
    outputs and loss through this iteration's ``zero_grad`` and forward, this iteration's
    through backward and the optimizer step; the previous batch until the new one is
    assigned; gradients until ``zero_grad()`` (``set_to_none=True``, torch's default).

    ``model`` is the wrapped model (DataParallel, DDP or the bare model); with
    ``loss_inside`` it is a :class:`ModelWithLoss` inside, gets the targets too, and the
    loss is :meth:`ModelWithLoss.combine` of what it returns. ``to_device(x, is_target)``
    moves a (nested) host batch to the device the model takes it on.
    """
    hooks = hooks or StepHooks()
    loss: torch.Tensor | None = None
    last = len(batches) - 1
    for k in range(len(batches)):
        with hooks.iteration(k, k == last):
            with hooks.phase("inputs"):
                inputs, targets = batches[k]  # the previous (device) batch dies here
                inputs, targets = to_device(inputs, False), to_device(targets, True)
            with hooks.phase("zero_grad"):
                optimizer.zero_grad()
            with hooks.phase("forward"):
                outputs = model(inputs, targets) if loss_inside else call_model(model, inputs)
                hooks.after_forward(outputs)
            with hooks.phase("loss"):
                loss = ModelWithLoss.combine(outputs) if loss_inside else loss_fn(
                    outputs, targets)
                hooks.after_loss(loss, outputs)
            with hooks.phase("backward"):
                loss.backward()
                hooks.after_backward()
            with hooks.phase("optimizer"):
                optimizer.step()
                hooks.after_optimizer()
    if loss is None:
        raise ValueError("training_loop needs at least one batch")
    return loss.detach()
