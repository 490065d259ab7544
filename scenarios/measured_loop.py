"""The one training step that every backend runs, in each scenario
(:mod:`dpprof.scenarios.names`).

The measured loop (:func:`training_loop`): the PyTorch tutorial's loop in steady state,
several iterations in one scope, the last measured, every variable alive until the loop
rebinds it.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from dpprof.emulator.call_sites import dpprof_dirs
from dpprof.scenarios.model_with_loss import ModelWithLoss, batch_rows, call_model
from dpprof.scenarios.names import BACKWARD, FORWARD, INPUTS, LOSS, OPTIMIZER, ZERO_GRAD
from dpprof.scenarios.step import take_rows


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


def _library_dirs() -> tuple[str, ...]:
    import sysconfig

    dirs = [os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"]]
    return (*(os.path.join(os.path.realpath(d), "") for d in dirs), *dpprof_dirs())


def error_site(exc: BaseException) -> str:
    """Where ``exc`` happened, for a one-line error: the aten op that failed (when the
    emulator saw it) and the innermost frame of the user's code (not torch's, dpprof's or
    the standard library's) with its line, e.g. ``" (in aten::mm, at model.py:42 in
    forward: return h @ self.w)"``; "" when neither is known."""
    parts = []
    op = getattr(exc, "dpprof_op", None)
    if op:
        parts.append(f"in {op}")
    skip = _library_dirs()
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = os.path.realpath(frame.filename)
        if path.startswith(skip) or frame.filename.startswith("<"):
            continue
        code = f": {frame.line.strip()}" if frame.line else ""
        parts.append(f"at {frame.filename}:{frame.lineno} in {frame.name}{code}")
        break
    return f" ({', '.join(parts)})" if parts else ""


def where_outputs_are(targets: Any, outputs: Any) -> Any:
    """``targets`` on the device of the first tensor of ``outputs``: the model-parallel
    tutorial's ``labels.to(outputs.device)``, for a model that ends on another GPU than the
    one its inputs went to (elsewhere a no-op: the outputs are where the targets are)."""
    from torch.utils._pytree import tree_map

    out = next((t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)), None)
    if out is None:
        return targets
    device = out.device
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor)
                    and t.device != device else t, targets)


def micro_batch_rows(rows: int, micro_batches: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` rows of each micro-batch of a ``rows``-row batch, as a loader
    with ``batch_size=ceil(rows / micro_batches)`` cuts it (the last may be shorter; none
    is empty)."""
    per = -(-rows // micro_batches)
    return [(lo, min(lo + per, rows)) for lo in range(0, rows, per)]


def loader_part(host: Any, rows: tuple[int, int] | None) -> Any:
    """What the loader gives for one micro-batch of the host batch ``host``: a copy of
    ``rows`` (a ``[start, stop)`` of :func:`micro_batch_rows`), or, for the plain step's one
    micro-batch (``rows`` None), the batch itself."""
    return host if rows is None else take_rows(host, *rows)


def share_of_step(loss: torch.Tensor, parts: int | None) -> torch.Tensor:
    """A micro-batch's loss as the accumulating loop backpropagates it, ``loss / parts``
    (the step's ``parts`` micro-batches' gradients add up in ``.grad`` to the mean's);
    the plain step's (``parts`` None) as it is. A function, so the undivided loss is freed
    before the loop's ``loss`` is rebound, as in ``loss = criterion(...) / k``."""
    return loss if parts is None else loss / parts


def training_loop(
    model: Callable[..., Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    batches: Sequence[tuple[Any, Any]],
    to_device: Callable[[Any, bool], Any],
    loss_inside: bool,
    hooks: StepHooks | None = None,
    step: UserStep | None = None,
    micro_batches: int = 1,
) -> torch.Tensor | None:
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

    With ``micro_batches`` k > 1 (gradient accumulation), each step's rows come in k
    micro-batches (:func:`micro_batch_rows`, the loader's batches), one optimizer step; the
    plain loop above is the case of one micro-batch, the whole batch as the loader gave it::

        optimizer.zero_grad()
        for i, (inputs, targets) in enumerate(micro_batches_of_the_step):
            with model.no_sync() if i < k - 1 else nullcontext():  # DDP: one all-reduce
                inputs, targets = inputs.to(device), targets.to(device)
                outputs = model(inputs)
                loss = criterion(outputs, targets) / k
                loss.backward()  # the gradients add up in .grad
        optimizer.step()

    ``no_sync`` where the model has it (DDP): its reducer neither buckets nor all-reduces
    those backwards. An accumulating loop zeroes the gradients once per optimizer step,
    before its first micro-batch (as the ladder's code does, right after the previous
    ``optimizer.step()``); the tutorial's, once the step's batch is on the device. A
    micro-batch's outputs and loss live until the next micro-batch's are assigned.

    ``model`` is the wrapped model (DataParallel, DDP or the bare model); with
    ``loss_inside`` it is a :class:`ModelWithLoss` inside, gets the targets too, and the
    loss is :meth:`ModelWithLoss.combine` of what it returns. ``to_device(x, is_target)``
    moves a (nested) host batch to the device the model takes it on.

    With ``step`` (a workload's own loop body), :func:`user_loop` runs instead.
    """
    hooks = hooks or StepHooks()
    if step is not None:
        if micro_batches > 1:
            raise StepError("gradient accumulation runs the tutorial loop; the workload has "
                            "its own step: accumulate in it instead")
        return user_loop(step, model, loss_fn, optimizer, batches, to_device, loss_inside,
                         hooks)
    accumulating = micro_batches > 1
    no_sync = getattr(model, "no_sync", None) if accumulating else None
    loss: torch.Tensor | None = None
    last = len(batches) - 1
    for k in range(len(batches)):
        with hooks.iteration(k, k == last):
            host_inputs, host_targets = batches[k]
            # each micro-batch's rows; the plain step's one micro-batch is the whole batch
            parts: list[tuple[int, int] | None] = (
                list(micro_batch_rows(batch_rows(host_targets) or batch_rows(host_inputs),
                                      micro_batches)) if accumulating else [None])
            if accumulating:
                with hooks.phase(ZERO_GRAD):
                    optimizer.zero_grad()
            for i, rows in enumerate(parts):
                sync = (no_sync() if no_sync is not None and i < len(parts) - 1
                        else contextlib.nullcontext())
                with sync:
                    with hooks.phase(INPUTS):  # the previous (device) batch dies here
                        inputs = loader_part(host_inputs, rows)
                        targets = loader_part(host_targets, rows)
                        inputs, targets = to_device(inputs, False), to_device(targets, True)
                    if not accumulating:
                        with hooks.phase(ZERO_GRAD):
                            optimizer.zero_grad()
                    with hooks.phase(FORWARD):
                        outputs = (model(inputs, targets) if loss_inside
                                   else call_model(model, inputs))
                        hooks.after_forward(outputs)
                    with hooks.phase(LOSS):
                        loss = share_of_step(ModelWithLoss.combine(outputs) if loss_inside
                                             else loss_fn(outputs,
                                                          where_outputs_are(targets, outputs)),
                                             len(parts) if accumulating else None)
                        hooks.after_loss(loss, outputs)
                    with hooks.phase(BACKWARD):
                        loss.backward()
                        hooks.after_backward()
            with hooks.phase(OPTIMIZER):
                optimizer.step()
                hooks.after_optimizer()
    if loss is None:
        raise ValueError("training_loop needs at least one batch")
    return loss.detach()


# ---- the user's own loop body -------------------------------------------------------------

UserStep = Callable[[Any, tuple[Any, Any], Callable[..., Any], torch.optim.Optimizer], Any]


class StepError(RuntimeError):
    """The user's step did something its scenario cannot run (said in one line, with the
    fix)."""


class _PhaseDriver:
    """The backend's phase, switched as the user's step calls the model, the criterion
    and ``optimizer.step()``."""

    def __init__(self, hooks: StepHooks) -> None:
        self.hooks = hooks
        self.stack = contextlib.ExitStack()
        self.current = ""

    def switch(self, name: str) -> None:
        if name == self.current:
            return
        self.stack.close()
        self.stack = contextlib.ExitStack()
        self.stack.enter_context(self.hooks.phase(name))
        self.current = name

    def close(self) -> None:
        self.stack.close()
        self.current = ""


class DeferredOutputs:
    """What ``model(...)`` returns to a user's step under ``dp-loss-forward``: the call,
    not yet made. ``criterion(outputs, targets)`` makes it, as
    ``DataParallel(ModelWithLoss(model, criterion))(inputs, targets)``, so the loss is
    computed on every replica; the outputs themselves never reach cuda:0."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if args and kwargs:
            raise StepError(
                "dp-loss-forward: the step called the model with positional and keyword "
                "arguments at once; ModelWithLoss passes one of the two: call model(*inputs) "
                "or model(**inputs)")
        self.inputs: Any = dict(kwargs) if kwargs else tuple(args)

    def __getattr__(self, name: str) -> Any:
        raise StepError(
            f"dp-loss-forward: the step used the model's outputs (.{name}) other than through "
            "criterion(outputs, targets); under this scenario the outputs exist only inside "
            "each replica (ModelWithLoss computes the loss there): compute everything the "
            "loss needs inside the criterion")

    def __iter__(self) -> Any:
        return self.__getattr__("__iter__")

    def __getitem__(self, key: Any) -> Any:
        return self.__getattr__(f"__getitem__[{key!r}]")


class StepModel:
    """The ``model`` a user's step gets: the scenario's wrapper (DataParallel, DDP or the
    bare model), called inside dpprof's phases. Attributes (``parameters()``, ``train()``,
    ``module``...) are the wrapper's."""

    def __init__(self, wrapped: Any, driver: _PhaseDriver, hooks: StepHooks,
                 loss_inside: bool) -> None:
        self._wrapped = wrapped
        self._driver = driver
        self._hooks = hooks
        self._loss_inside = loss_inside

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._loss_inside:
            return DeferredOutputs(args, kwargs)
        self._driver.switch(FORWARD)
        outputs = self._wrapped(*args, **kwargs)
        self._hooks.after_forward(outputs)
        return outputs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)


class StepCriterion:
    """The ``criterion`` a user's step gets: the workload's loss, inside dpprof's phases;
    under ``dp-loss-forward`` it runs the deferred forward with the loss on every replica
    and combines the replicas' losses (:meth:`ModelWithLoss.combine`)."""

    def __init__(self, loss_fn: Callable[..., Any], wrapped: Any, driver: _PhaseDriver,
                 hooks: StepHooks) -> None:
        self._loss_fn = loss_fn
        self._wrapped = wrapped
        self._driver = driver
        self._hooks = hooks

    def __call__(self, outputs: Any, targets: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(outputs, DeferredOutputs):
            if args or kwargs:
                raise StepError(
                    "dp-loss-forward: the step passed more than (outputs, targets) to the "
                    "criterion; ModelWithLoss calls criterion(outputs, targets): put the rest "
                    "in the targets or in the criterion")
            self._driver.switch(FORWARD)
            gathered = self._wrapped(outputs.inputs, targets)
            self._hooks.after_forward(gathered)
            self._driver.switch(LOSS)
            loss = ModelWithLoss.combine(gathered)
            self._hooks.after_loss(loss, gathered)
        else:
            self._driver.switch(LOSS)
            loss = self._loss_fn(outputs, targets, *args, **kwargs)
            self._hooks.after_loss(loss, outputs)
        self._driver.switch(BACKWARD)
        return loss

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loss_fn, name)


def user_loop(
    step: UserStep,
    model: Callable[..., Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    batches: Sequence[tuple[Any, Any]],
    to_device: Callable[[Any, bool], Any],
    loss_inside: bool,
    hooks: StepHooks | None = None,
) -> torch.Tensor | None:
    """The loop around a workload's own step, the same for every scenario and backend::

        for batch in loader:
            batch = batch[0].to(device), batch[1].to(device)
            loss = step(model, batch, criterion, optimizer)

    ``model`` is the scenario's wrapper and ``criterion`` the workload's loss, both called
    inside dpprof's phases (:class:`StepModel`, :class:`StepCriterion`; under
    ``dp-loss-forward`` the model call is deferred to the criterion call, which runs
    ``DataParallel(ModelWithLoss(model, criterion))``). What the step returns lives until the
    next step returns, as the loop's ``loss`` does; the last one is returned (detached) when
    it is a tensor."""
    hooks = hooks or StepHooks()
    driver = _PhaseDriver(hooks)
    smodel = StepModel(model, driver, hooks, loss_inside)
    scrit = StepCriterion(loss_fn, model, driver, hooks)

    def pre(opt: Any, args: Any, kwargs: Any) -> None:
        hooks.after_backward()
        driver.switch(OPTIMIZER)

    def post(opt: Any, args: Any, kwargs: Any) -> None:
        hooks.after_optimizer()
        driver.switch(ZERO_GRAD)

    handles = [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]
    result: Any = None
    last = len(batches) - 1
    try:
        for k in range(len(batches)):
            with hooks.iteration(k, k == last):
                with hooks.phase(INPUTS):
                    batch = batches[k]  # the previous (device) batch dies here
                    batch = (to_device(batch[0], False), to_device(batch[1], True))
                driver.switch(ZERO_GRAD)
                try:
                    result = step(smodel, batch, scrit, optimizer)
                finally:
                    driver.close()
    finally:
        for h in handles:
            h.remove()
    return result.detach() if isinstance(result, torch.Tensor) else None
