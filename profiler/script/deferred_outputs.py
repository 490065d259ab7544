"""The loss inside forward in a running script (the ``loss-in-forward`` alternative,
:mod:`dpprof.script.loss_in_forward_run`): DataParallel's outputs deferred
(:class:`DeferredOutputs`) until a loss (:mod:`dpprof.scenarios.losses`) is called on them,
which then runs inside forward on every replica (``ModelWithLoss``); a loss on an expression
of the outputs (``out.view(-1, V)``) is a :class:`PendingLoss` until the statement reads it;
any other use of the outputs computes them as written (gathered). Another loss on the same
outputs (mixup's ``lam * criterion(out, y_a) + (1 - lam) * criterion(out, y_b)``, a main and
an auxiliary loss) is computed inside forward too, on each replica's own outputs, held from
the first loss until the backward begins: the forward runs once, as in the fixed code, where
every loss is computed before forward returns. A read of their shape, dtype or device before
the loss (``preds.size(1)``) runs the replicas' forward and holds their outputs there for the
loss to come, which is computed beside them; nothing is gathered."""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from dpprof.emulator.call_sites import caller_frame, caller_site
from dpprof.emulator.data_parallel import gather, replicate, scatter_kwargs
from dpprof.scenarios.losses import is_functional_loss
from dpprof.scenarios.model_with_loss import ModelWithLoss
from dpprof.script.loss_expression import (
    Binding,
    FoundLoss,
    Step,
    compiled,
    losses_in_frame,
    parts_bound,
)
from dpprof.script.parallel_state import ParallelLog, current
from dpprof.script.replica_modules import HeldForward, recording_class
from dpprof.script.source import dotted_name

if TYPE_CHECKING:
    from dpprof.script.wrappers import VirtualDataParallel


# what a shape read of the outputs can ask (preds.size(1), len(out)): answered from the
# replicas' outputs, not gathered
SHAPE_READS = frozenset({"size", "shape", "dim", "ndim", "ndimension", "dtype", "numel",
                         "nelement", "device"})
_NOT_READ = object()


class DeferredOutputs:
    """DataParallel's outputs in the loss-inside-forward alternative, or a part of them taken
    before the loss: nothing is computed until a loss is called on them (then every replica
    computes its loss, ``ModelWithLoss``); any other use computes them as written
    (gathered)."""

    def __init__(self, dp: VirtualDataParallel, inputs: tuple[Any, ...], site: str,
                 kwargs: dict[str, Any] | None = None, base: DeferredOutputs | None = None,
                 path: tuple[Step, ...] = ()) -> None:
        self.dp = dp
        # the model's inputs, until the forward ran with the loss inside (the fixed code holds
        # them no longer than the script does); a part holds none: its base's are used
        self.inputs = inputs
        self.kwargs = kwargs or {}  # a call with keyword arguments alone: model(**batch)
        # the batch's rows (a part's are its base's)
        self.rows: int = next((int(t.shape[dp.dim]) for t in tree_leaves((inputs, self.kwargs))
                               if isinstance(t, torch.Tensor) and t.dim() > dp.dim), 0)
        self.site = site
        # a part of another's outputs (``logits = outputs.logits``, ``out, aux = model(x)``):
        # that one's forward, and the steps to this part (loss_expression.Step)
        self._base = base  # None: these are the whole outputs (no cycle to itself: a cycle
        # would keep the outputs alive until the garbage collector runs, not the script)
        self.path = path
        # the steps still to come in the statement that made this part, and its lines
        self.expect: tuple[Step, ...] = ()
        self.where: frozenset[tuple[str, int]] = frozenset()
        self.value: Any = None
        self.used_as_loss = False
        self.pending: PendingLoss | None = None  # the loss of an expression of them
        self.shapes: list[Any] = []  # each replica's outputs as (shape, dtype) leaves
        # (device, that replica's outputs) once a loss was computed inside forward on them,
        # while another loss may still be: until the backward begins
        self.replicas: list[tuple[int, Any]] = []
        self.queued: list[FoundLoss] = []  # the statement's further losses on the outputs
        self.losses = 0  # the losses computed inside forward on them
        # the wrap's outputs before these, kept by the script (keep_outputs) and alive when
        # the model was called: alive until this forward ran, as in the fixed code, where
        # the name they are bound to is rebound by the statement that runs the forward
        # (``out, loss = ModelWithLoss.split(model(x, y))``), not before it
        self.previous: DeferredOutputs | None = None

    @property
    def base(self) -> DeferredOutputs:
        """The whole outputs this is a part of (itself, where it is them)."""
        return self._base if self._base is not None else self

    def materialize(self) -> Any:
        if self.value is None and self.base is not self:
            self.value = part_of(self.base.materialize(), self.path)
        if self.value is None:
            current().log.materialized.append(caller_site())
            if self.replicas and not self.losses:  # held for a loss (their shape read)
                self.value = self._gather_held()
            elif self.used_as_loss:
                # used after the loss (accuracy, logging): the replicas kept no outputs;
                # stand-ins of the gathered shapes on the output device, no gradient
                self.value = self._stand_ins()
            else:  # used before any loss: computed as written
                self.value = self.dp.run(self.dp.module, self.inputs, self.kwargs)
            self.previous = None
        return self.value

    def _shape_read(self, name: str) -> Any:
        """``name`` (:data:`SHAPE_READS`) of the gathered outputs, where these are a tensor
        or a part of the outputs reached by attributes and indexes (``preds.size(1)``,
        ``out.logits.shape``), read without gathering them: the replicas' forward runs
        (:meth:`held_forward`, once) and their outputs wait on their GPUs for the loss, which
        computes beside them, as inside the fixed code's forward; ``_NOT_READ`` otherwise
        (a part computed by a call, whose shape is the computation's)."""
        base = self.base
        if (name not in SHAPE_READS or self.value is not None or base.value is not None
                or not torch.is_grad_enabled() or any(s[0] == "call" for s in self.path)
                or len(base.dp.device_ids) < 2):
            return _NOT_READ
        if not base.replicas and (base.used_as_loss or not base.held_forward()):
            return _NOT_READ
        parts = [part_of(outputs, self.path) for _, outputs in base.replicas]
        if not all(isinstance(p, torch.Tensor) for p in parts):
            return _NOT_READ
        size = list(parts[0].shape)
        dim = self.dp.dim
        if len(size) > dim:
            size[dim] = sum(int(p.shape[dim]) for p in parts)
        shape = torch.Size(size)
        numel = functools.reduce(operator.mul, size, 1)
        if name == "device":  # the output device's, where its replica's part says it
            gathered_on = self.dp._vc.index_of(self.dp.output_device)
            on = [p for (d, _), p in zip(base.replicas, parts, strict=True) if d == gathered_on]
            return on[0].device if on else _NOT_READ
        return {"size": lambda d=None: shape if d is None else shape[d], "shape": shape,
                "dim": lambda: len(shape), "ndimension": lambda: len(shape),
                "ndim": len(shape), "dtype": parts[0].dtype, "numel": lambda: numel,
                "nelement": lambda: numel}[name]

    def held_forward(self) -> bool:
        """The replicas' forward, without the loss: their outputs held on their GPUs
        (:attr:`replicas`) for the loss to come, as the fixed code's forward holds them
        until its loss; False where it cannot run so (the inputs gone)."""
        if not (self.inputs or self.kwargs) or self.value is not None:
            return False
        held = HeldForward(self.dp.module, self.dp.dim)
        held.shapes, held.kept = self.shapes, []
        self.dp.run(held, (self.model_inputs(),), {})
        self.inputs, self.kwargs = (), {}
        log = current().log
        log.call_sites.append(self.site)
        self.replicas = list(zip(log.used_devices, held.kept, strict=True))
        log.holding_replica_outputs.append(self)
        self.previous = None
        return True

    def _gather_held(self) -> Any:
        """The held replicas' outputs gathered on the output device, as DataParallel's
        forward gathers them."""
        rt = self.dp._vc.rt
        with rt.category("outputs"):
            return gather(rt, [outputs for _, outputs in self.replicas],
                          self.dp._vc.index_of(self.dp.output_device), self.dp.dim)

    def after(self, last: weakref.ref[DeferredOutputs] | None) -> None:
        """These outputs follow ``last``, the wrap's previous call's (weakly: gone where
        the script let them go)."""
        previous = last() if last is not None else None
        if previous is not None and previous.value is not None:
            self.previous = previous

    def model_inputs(self) -> Any:
        """What ``ModelWithLoss`` is given as the model's inputs: the one argument, the
        arguments' tuple, or the keywords' dict (which it passes as keywords)."""
        if self.kwargs:
            return dict(self.kwargs)
        return self.inputs if len(self.inputs) != 1 else self.inputs[0]

    def part(self, step: Step, expect: tuple[Step, ...] = (),
             where: frozenset[tuple[str, int]] = frozenset()) -> DeferredOutputs:
        """The part one step further in (not computed until used); ``expect``: the steps
        still to come in the statement (its lines ``where``) that binds it."""
        part = DeferredOutputs(self.dp, (), self.site, None, self.base, (*self.path, step))
        part.expect, part.where = expect, where
        return part

    def on_part(self, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``loss_fn`` of this part, as a function of the whole outputs."""
        if not self.path:
            return loss_fn
        return functools.partial(_loss_on_part, loss_fn, self.path)

    def _stand_ins(self) -> Any:
        vc = self.dp._vc
        rt = vc.rt
        per_replica = self.shapes
        dim = self.dp.dim

        def gathered(*leaves: Any) -> Any:
            first = leaves[0]
            if not isinstance(first, tuple):
                return first
            shape, dtype = first
            size = list(shape)
            if size:
                size[dim] = sum(leaf[0][dim] for leaf in leaves)
            with rt.category("outputs"):
                return torch.empty(size, dtype=dtype,
                                   device=torch.device("cuda", self.dp.output_device))

        rt.stand_ins.add("outputs after the loss")
        flat = [tree_leaves(r, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2
                            and isinstance(x[1], torch.dtype)) for r in per_replica]
        spec = tree_map(lambda x: x, per_replica[0],
                        is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2
                        and isinstance(x[1], torch.dtype))
        leaves = [gathered(*cols) for cols in zip(*flat, strict=True)]
        from torch.utils._pytree import tree_flatten, tree_unflatten

        _, treespec = tree_flatten(spec, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2
                                   and isinstance(x[1], torch.dtype))
        return tree_unflatten(leaves, treespec)

    def in_loss(self) -> PendingLoss | None:
        """A use of the outputs inside the arguments of a loss module's call
        (``criterion(out.view(-1, V), y.view(-1))``): that call computed inside forward on
        every replica (:mod:`dpprof.script.loss_expression`), its arguments' expression
        applied to each replica's shards; what the statement then computes of the outputs
        is a stand-in that the loss call answers with the combined loss. None: any other
        use (the outputs computed as written)."""
        base = self.base
        if self.pending is not None:
            if not self.pending.answered:
                return self.pending
            if not (self.queued and base.replicas):
                return None
            # the statement's next loss on the outputs: beside the first, inside forward
            found = self.queued.pop(0)
            current().log.loss_sites.append(found.site)
            self.pending = PendingLoss(base.beside(self.on_part(compiled(found)),
                                                   found.targets))
            return self.pending
        if (self.value is not None or not torch.is_grad_enabled()
                or (base.used_as_loss and not base.replicas)):
            return None
        frame = caller_frame()
        log = current().log
        if frame is None:
            return None
        try:
            losses = losses_in_frame(frame, lambda v: v is self, self.dp, base.rows,
                                     self.dp.dim)
        except Exception as e:  # reading the script's own values: it runs on, as written
            losses = f"dpprof could not read the loss's expression ({type(e).__name__}: {e})"
        if isinstance(losses, str):
            log.no_loss_forward = log.no_loss_forward or losses
            return None
        found, *self.queued = losses
        log.loss_sites.append(found.site)
        log.whole_rows = log.whole_rows or found.whole_rows
        log.loss_expressions.setdefault(found.site, (dotted_name(found.call.func) or "",
                                                      found.function.targets_name))
        loss_fn = self.on_part(compiled(found))
        if base.replicas:  # a loss on the outputs is inside forward already: beside it
            held = not base.losses  # or the forward ran for their shape: its first loss
            self.pending = PendingLoss(base.beside(loss_fn, found.targets))
            if held:
                base.used_as_loss = True
                if current().keep_outputs:  # gathered with the loss, as the fix's are
                    base.value = base._gather_held()
            return self.pending
        base.used_as_loss = True
        log.call_sites.append(self.site)
        self.pending = PendingLoss(base.in_forward(loss_fn, found.targets))
        return self.pending

    def in_forward(self, loss_fn: Callable[..., Any],
                   targets: tuple[Any, ...]) -> torch.Tensor:
        """The loss computed inside forward on every replica (of the outputs and each of
        ``targets``, scattered with the inputs), combined as one number."""
        keep = current().keep_outputs
        wrapped = recording_class()(self.dp.module, loss_fn, keep_outputs=keep,
                                     dim=self.dp.dim)
        wrapped.shapes = self.shapes
        wrapped.kept = []
        out = self.dp.run(wrapped, (self.model_inputs(), *targets), {})
        self.inputs, self.kwargs = (), {}  # held no longer: used_as_loss says it ran
        self.previous = None
        log = self._count_loss(out)
        self.replicas = list(zip(log.used_devices, wrapped.kept, strict=True))
        log.holding_replica_outputs.append(self)
        if keep:  # the script's later uses of the outputs get the gathered ones
            self.value = ModelWithLoss.split(out)[0]
        return ModelWithLoss.combine(out)

    def beside(self, loss_fn: Callable[..., Any], targets: tuple[Any, ...]) -> torch.Tensor:
        """Another loss on these outputs, inside forward beside the first: on each replica's
        own outputs and its shard of ``targets``, combined as one number."""
        rt = self.dp._vc.rt
        ids = [device for device, _ in self.replicas]
        with rt.category("inputs"):
            shards, _ = scatter_kwargs(rt, tuple(targets), {}, ids, self.dp.dim)
        weigh = ModelWithLoss(nn.Identity(), loss_fn, dim=self.dp.dim)
        # its loss modules' tensors (a weighted loss's weights) on every replica's GPU, as
        # the replicate of a wrapper holding both losses puts them there
        held = [*weigh.parameters(), *weigh.buffers()]  # the loss module's, or its function's
        copies = (cast("list[ModelWithLoss]", replicate(rt, weigh, ids,
                                                        not torch.is_grad_enabled()))
                  if held and len(ids) > 1 else [weigh] * len(ids))
        pairs = []
        for copy, (device, outputs), (shard, *more) in zip(copies, self.replicas, shards,
                                                           strict=True):
            with rt.device(device), rt.category("activations"):
                pairs.append(copy.weighted_loss(outputs, shard, shard, tuple(more)))
        with rt.category("outputs"):
            gathered = gather(rt, pairs, self.dp._vc.index_of(self.dp.output_device),
                              self.dp.dim)
        self._count_loss(gathered)
        return ModelWithLoss.combine(gathered)

    def _count_loss(self, gathered: tuple[Any, ...]) -> ParallelLog:
        """One more loss computed inside forward on these outputs (``gathered``: what
        ``ModelWithLoss``'s replicas returned), in the run's log."""
        log = current().log
        log.loss_in_forward += 1
        if gathered[1].numel() == 0:  # kept per element: the gathered loss, not a count
            log.per_element_losses += 1
        self.losses += 1
        log.most_losses_on_outputs = max(log.most_losses_on_outputs, self.losses)
        return log

    def release(self) -> None:
        """The backward begins: every loss on the outputs was computed (in the fixed code,
        before forward returned); the replicas' outputs are not held for another."""
        self.replicas = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        shape = self._shape_read(name)  # preds.size(1): the forward runs, nothing gathered
        if shape is not _NOT_READ:
            return shape
        part = self._step(("attr", name))  # logits = outputs.logits
        if part is not None:
            return part
        pending = self.in_loss()
        return getattr(pending if pending is not None else self.materialize(), name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        part = self._step(("call", args, kwargs))  # logits = out.float()
        return part if part is not None else self.materialize()(*args, **kwargs)

    def _binding(self) -> Binding | None:
        """What the statement now running binds of these outputs, not yet computed
        (:func:`dpprof.script.loss_expression.parts_bound`): only while no loss was computed
        on them, under grad, as the training step's."""
        if (self.value is not None or self.base.used_as_loss or self.pending is not None
                or not torch.is_grad_enabled()):
            return None
        frame = caller_frame()
        try:
            return parts_bound(frame, lambda v: v is self, self.dp) if frame else None
        except Exception:  # reading the script's own values: it runs on, as written
            return None

    def _step(self, step: Step) -> DeferredOutputs | None:
        """The part ``step`` leads to, where it is the next step of the chain the statement
        now running binds to a name; else None."""
        if self.expect:  # a part made earlier in this statement's chain
            frame = caller_frame()
            if (frame is not None and (frame.f_code.co_filename, frame.f_lineno) in self.where
                    and _same_step(self.expect[0], step)):
                return self.part(step, self.expect[1:], self.where)
            return None
        binding = self._binding()
        if binding is None or not binding.steps or not _same_step(binding.steps[0], step):
            return None
        return self.part(step, binding.steps[1:], binding.where)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        deferred = [x for x in tree_leaves((args, kwargs or {}),
                                           is_leaf=lambda x: isinstance(x, DeferredOutputs))
                    if isinstance(x, DeferredOutputs)]
        if deferred and is_functional_loss(func):  # F.nll_loss(out, y)
            loss = loss_in_forward_loss_call(func, args, kwargs or {})
            if loss is not None:
                return loss
        pending = deferred[0].in_loss() if deferred else None
        if pending is not None:  # torch.nn.functional's loss answers it: F.nll_loss(out.log())
            return pending.answer() if is_functional_loss(func) else pending

        def real(x: Any) -> Any:
            return x.materialize() if isinstance(x, DeferredOutputs) else x

        args = tree_map(real, args, is_leaf=lambda x: isinstance(x, DeferredOutputs))
        kwargs = tree_map(real, kwargs or {}, is_leaf=lambda x: isinstance(x, DeferredOutputs))
        return func(*args, **kwargs)

    def __getitem__(self, key: Any) -> Any:
        part = self._step(("item", key))  # logits = outputs[0]
        if part is not None:
            return part
        pending = self.in_loss()
        return pending if pending is not None else self.materialize()[key]

    def __len__(self) -> int:
        shape = self._shape_read("shape")
        if shape is not _NOT_READ and len(shape):
            return int(shape[0])
        return len(self.materialize())

    def __iter__(self) -> Any:
        binding = None if self.expect else self._binding()  # out, aux = model(x)
        if binding is not None and binding.names:
            return iter([self.part(("item", i)) for i in range(binding.names)])
        return iter(self.materialize())

    __hash__ = object.__hash__  # by identity, as its comparisons below do not


def _operator(name: str, reflected: bool) -> Callable[..., Any]:
    """An operator of :class:`DeferredOutputs` (``out / T``, ``1 + logvar``): inside a loss's
    arguments, the statement's pending loss; else the operator on the outputs computed."""
    op = getattr(operator, name)

    def method(self: DeferredOutputs, *other: Any) -> Any:
        pending = self.in_loss()
        if pending is not None:
            return pending
        value = self.materialize()
        return op(other[0], value) if reflected else op(value, *other)

    return method


_BINARY = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and_", "or_",
           "xor", "lshift", "rshift")
for _name in _BINARY:
    _dunder = _name.rstrip("_")
    setattr(DeferredOutputs, f"__{_dunder}__", _operator(_name, False))
    setattr(DeferredOutputs, f"__r{_dunder}__", _operator(_name, True))
for _name in ("lt", "le", "gt", "ge", "eq", "ne", "neg", "pos", "abs", "invert"):
    setattr(DeferredOutputs, f"__{_name}__", _operator(_name, False))


class PendingLoss:
    """What a statement computes of the outputs on its way into a loss call whose loss was
    computed inside forward: every method, index, operator and torch function of it is
    itself, and the loss call answers it with the loss (once). Once answered it holds the
    loss weakly: the outputs keep this object until the next forward, and the loss as the
    call returned it (before the script divides it for accumulation, say) must be freed when
    the script lets it go, as the fixed code's is."""

    def __init__(self, loss: torch.Tensor) -> None:
        self._loss: torch.Tensor | None = loss
        self._answered: weakref.ref[torch.Tensor] | None = None

    @property
    def answered(self) -> bool:
        return self._answered is not None

    def answer(self) -> torch.Tensor:
        loss = self._loss
        if loss is None:  # answered already: the same tensor, while the script holds it
            assert self._answered is not None
            loss = self._answered()
            if loss is None:
                raise RuntimeError("the loss computed inside forward was asked for again "
                                   "after the script let it go")
            return loss
        self._answered, self._loss = weakref.ref(loss), None
        return loss

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> PendingLoss:
        return self

    def __getitem__(self, key: Any) -> PendingLoss:
        return self

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        pending = next(x for x in tree_leaves((args, kwargs or {}),
                                              is_leaf=lambda x: isinstance(x, PendingLoss))
                       if isinstance(x, PendingLoss))
        return pending.answer() if is_functional_loss(func) else pending

    def _same(self, *_: Any) -> PendingLoss:
        return self

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _same
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __neg__ = _same
    __pow__ = __rpow__ = __mod__ = __rmod__ = __matmul__ = __rmatmul__ = _same


def pending_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> PendingLoss | None:
    """The :class:`PendingLoss` among a loss call's arguments, if one is there."""
    return next((x for x in tree_leaves((args, kwargs),
                                        is_leaf=lambda x: isinstance(x, PendingLoss))
                 if isinstance(x, PendingLoss)), None)


def loss_in_forward_loss_call(loss_fn: Callable[..., Any], args: tuple[Any, ...],
                              kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``loss_fn(outputs, targets)`` on deferred DataParallel outputs: the loss computed
    inside forward on every replica, combined by rows (None: not such a call). The
    statement's losses are read from its source first (:meth:`DeferredOutputs.in_loss`:
    another loss on the same outputs then comes beside this one, whatever its form); where
    that source cannot be followed, a call on the outputs themselves and one tensor of
    targets still moves inside forward."""
    if not args or not isinstance(args[0], DeferredOutputs):
        return None
    part: DeferredOutputs = args[0]
    pending = part.in_loss()
    if pending is not None:
        return pending.answer()
    deferred = part.base
    targets = args[1] if len(args) > 1 else kwargs.get("target")
    rest = args[2:]  # the call's further arguments (a function of torch's gets all of them)
    keywords = {k: v for k, v in kwargs.items() if k != "target" or len(args) > 1}
    if targets is None or any(isinstance(x, (DeferredOutputs, PendingLoss))
                              for x in tree_leaves((rest, keywords))):
        return None
    if rest or keywords:
        loss_fn = functools.partial(_with_further, loss_fn, rest, keywords)
    loss_fn = part.on_part(loss_fn)
    if deferred.replicas:  # a loss on them is inside forward already: this one beside it
        current().log.loss_sites.append(caller_site())
        return deferred.beside(loss_fn, (targets,))
    if deferred.value is not None or part.value is not None or deferred.used_as_loss:
        return None
    deferred.used_as_loss = True
    current().log.call_sites.append(deferred.site)
    current().log.loss_sites.append(caller_site())
    return deferred.in_forward(loss_fn, (targets,))


def _with_further(loss_fn: Callable[..., Any], rest: tuple[Any, ...], keywords: dict[str, Any],
                  outputs: Any, targets: Any) -> Any:
    """``loss_fn(outputs, targets, *rest, **keywords)``: a loss call's further arguments,
    as written, reach its call inside forward."""
    return loss_fn(outputs, targets, *rest, **keywords)


def part_of(outputs: Any, path: tuple[Step, ...]) -> Any:
    """The part of ``outputs`` that ``path``'s attribute, index and call steps lead to."""
    for kind, *key in path:
        outputs = (getattr(outputs, key[0]) if kind == "attr" else outputs[key[0]]
                   if kind == "item" else outputs(*key[0], **key[1]))
    return outputs


def _same_step(a: Step, b: Step) -> bool:
    try:
        return a[0] == b[0] and bool(a[1:] == b[1:])
    except Exception:  # a key that does not compare (a tensor): not the chain's
        return False


def _loss_on_part(loss_fn: Callable[..., Any], path: tuple[Step, ...],
                  outputs: Any, *targets: Any) -> Any:
    return loss_fn(part_of(outputs, path), *targets)
