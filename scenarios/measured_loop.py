"""The one training step that every backend runs, in each scenario
(:mod:`dpprof.scenarios.names`).

The measured loop (:func:`training_loop`): the PyTorch tutorial's loop in steady state,
several iterations in one scope, the last measured, every variable alive until the loop
rebinds it.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from dpprof.emulator.call_sites import dpprof_dirs
from dpprof.scenarios.loss_mean import denominator, loss_calls, sums
from dpprof.scenarios.loss_state import modules_of, on_the_replica
from dpprof.scenarios.names import BACKWARD, FORWARD, INPUTS, LOSS, OPTIMIZER, ZERO_GRAD
from dpprof.scenarios.step import take_rows


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


# the count a replica returns beside a loss that adds up (reduction="sum"): its loss is its
# share of the sum, and the counts' negative total tells combine to add
SUMMED = -1.0

# ModelWithLoss called without its targets argument (not with None: a loss may ignore them,
# as a Hugging Face model's does, and be given None)
NO_TARGETS: Any = object()


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
    (a plain ``.mean()`` of the per-replica losses is not). The share is what the loss's
    mean divides by (the targets a ``CrossEntropyLoss`` does not ignore, the elements of an
    ``MSELoss``), so ``ignore_index`` and padding combine exactly too. A loss that adds up
    (``reduction="sum"``, a VAE's ``F.binary_cross_entropy(..., reduction="sum")``) combines
    as the sum of the replicas' losses. A loss kept per element (``reduction="none"``, a
    function returning one loss per sample) comes back gathered, the whole batch's, for the
    loop to reduce as it did (``(loss * mask).sum() / mask.sum()``): the logits stay on the
    replicas all the same.

    ``loss_fn`` may be the expression the loop computed on the gathered outputs, as a
    function of the outputs and the targets; each replica then applies it to its own
    shards::

        model = nn.DataParallel(dpprof.ModelWithLoss(
            model, lambda logits, y: criterion(logits.view(-1, logits.size(-1)), y.view(-1))))
        loss = dpprof.ModelWithLoss.combine(model(x, y))

    A loss that reads several tensors of the batch (a CTC loss's targets and lengths) takes
    them all, each scattered with the inputs: ``lambda preds, text, lengths: ...`` and
    ``model(x, text, lengths)``.

    Where it calls more than one loss module (a sum of two losses), the replicas are
    weighted by their rows. The loss modules a function computes with (``criterion`` above,
    found in its closure, its globals and their attributes it reads, a ``functools.partial``'s
    arguments) are held as submodules, so each replica computes with its own copy of their
    parameters and buffers (a weighted loss's class weights), as a module given as the loss
    does.

    A loop that also uses the outputs (accuracy from ``torch.max(outputs, 1)``) keeps them
    with ``keep_outputs=True``: each replica returns its outputs too, gathered on cuda:0 as
    without the fix (the loss and its temporaries still stay on the replicas), and
    :meth:`split` gives both::

        model = nn.DataParallel(dpprof.ModelWithLoss(model, loss_fn, keep_outputs=True))
        outputs, loss = dpprof.ModelWithLoss.split(model(inputs, targets))

    Called without targets (``model(inputs)``, an evaluation loop's call), it returns the
    model's outputs, gathered on cuda:0 as without the fix.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor],
                 keep_outputs: bool = False) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.keep_outputs = keep_outputs
        # the modules a loss function computes with, replicated with the model (a module
        # given as the loss is a submodule already); the original, which every replica's
        # copy of __dict__ shares, to find their copies by: weakly (a reference to itself
        # would keep each wrapper, and what it holds, to the garbage collector)
        self.loss_modules = nn.ModuleList(
            [] if isinstance(loss_fn, nn.Module) else modules_of(loss_fn, model))
        self._source = weakref.ref(self)

    def forward(self, inputs: Any, targets: Any = NO_TARGETS, *more_targets: Any) -> Any:
        outputs = call_model(self.model, inputs)
        if targets is NO_TARGETS:  # a call for the outputs alone (evaluation): as without the fix
            return outputs
        weighted, count = self.weighted_loss(outputs, targets, inputs, more_targets)
        return (weighted, count, outputs) if self.keep_outputs else (weighted, count)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)  # a weak reference does not pickle: made again on load
        state.pop("_source", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._source = weakref.ref(self)

    def weighted_loss(self, outputs: Any, targets: Any, inputs: Any,
                      more_targets: tuple[Any, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss * d, d)`` of this replica: ``d`` what the loss's mean divided by (the
        targets not ignored, the elements: :func:`dpprof.scenarios.loss_mean.denominator`)
        where ``loss_fn`` is one loss module or calls one, else the shard's rows."""
        # the denominator reads the loss module's tensors too (a weighted loss's weights)
        with on_the_replica(self, self._source() or self):
            with loss_calls() as calls:
                loss = self.loss_fn(outputs, targets, *more_targets)
            if isinstance(loss, torch.Tensor) and loss.dim() > 0:
                return per_element(loss, (outputs, targets, more_targets))
            if len(calls) == 1 and sums(calls[0][0]):  # the replicas' losses add up
                return loss.reshape(1), loss.new_full((1,), SUMMED)
            count = denominator(*calls[0][:3]) if len(calls) == 1 else None
        if count is None:
            rows = float(batch_rows(targets) or batch_rows(inputs))
            return loss.reshape(1) * rows, loss.new_full((1,), rows)
        return loss.reshape(1) * count, count

    @staticmethod
    def combine(out: tuple[Any, ...]) -> torch.Tensor:
        """The batch loss from the gathered ``(loss * rows, rows)`` of every replica."""
        weighted, rows = out[0], out[1]
        if rows.numel() == 0:  # a loss per element: gathered as the whole batch's
            return weighted  # type: ignore[no-any-return]
        total = rows.sum()
        # a loss that adds up (reduction="sum") returns SUMMED as its count: the sum is it
        return weighted.sum() / torch.where(total < 0, 1.0, total)

    @staticmethod
    def split(out: tuple[Any, ...]) -> tuple[Any, torch.Tensor]:
        """(the gathered outputs, the batch loss) of a ``keep_outputs=True`` model."""
        if len(out) < 3:
            raise ValueError("ModelWithLoss.split needs ModelWithLoss(..., keep_outputs=True)")
        return out[2], ModelWithLoss.combine(out)


def per_element(loss: torch.Tensor, operands: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A replica's loss kept per element (``reduction="none"``: one loss per row, or per
    token) as ``(loss, no count)``: DataParallel's gather concatenates the replicas' along
    the batch, which is the whole batch's loss as the gathered outputs would have given it,
    and :meth:`ModelWithLoss.combine` returns it for the loop to reduce as it does. Its first
    dimension must be a shard's rows, or those rows flattened with the dimensions after
    them (``out.view(-1, V)``: rows x tokens), of the outputs or of the targets
    (``operands``); any other shape (a loss per class) has no such order: a clear error."""
    firsts = set()
    for t in tree_leaves(operands):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            n = 1
            for size in t.shape:
                n *= int(size)
                firsts.add(n)
    if int(loss.shape[0]) not in firsts:
        raise ValueError(
            f"the loss returns a tensor of shape {tuple(loss.shape)}, which is not one value "
            "per row of the batch (nor per element of a row, rows first): the replicas' "
            "losses do not make the whole batch's; reduce it inside the loss function (a "
            "mean or a sum), or keep the loss outside forward")
    return loss, loss.new_empty((0,))


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


def takes_one_dict(model: Callable[..., Any], inputs: dict[str, Any]) -> bool:
    """Whether the plain model (inside DataParallel, DDP, ModelWithLoss) takes the dict
    ``inputs`` as its one positional parameter (``forward(self, batch)``) rather than its keys
    as keyword arguments (``forward(self, input_ids, labels)``, the Hugging Face way)."""
    inner: Any = model
    while isinstance(getattr(inner, "module", None), nn.Module):
        inner = inner.module
    if isinstance(inner, ModelWithLoss):
        inner = inner.model
    try:
        params = list(inspect.signature(inner.forward if isinstance(inner, nn.Module)
                                        else inner).parameters.values())
    except (TypeError, ValueError):  # no signature to read: the keys, as before
        return False
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return False
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if set(inputs) <= named:
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 1 or (
        bool(positional) and all(p.default is not p.empty for p in positional[1:]))


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


def call_model(model: Callable[..., Any], inputs: Any) -> Any:
    """The model called on a workload's inputs: a dict as keyword arguments (``model(**batch)``,
    the Hugging Face way) or, where the model's forward takes one positional parameter and not
    the keys, as that one argument (``model(batch)``); a tuple as positional arguments,
    anything else as the one argument."""
    if isinstance(inputs, dict):
        return model(inputs) if takes_one_dict(model, inputs) else model(**inputs)
    return model(*as_args(inputs))


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
