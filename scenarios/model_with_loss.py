"""``ModelWithLoss``: the loss computed inside ``forward`` on every replica, the
DataParallel fix, and how a model is called on a batch's inputs (the measured loop's and
``dpprof run``'s loss-inside-forward alternative's alike)."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from dpprof.scenarios.loss_mean import denominator, loss_calls, sums
from dpprof.scenarios.loss_state import modules_of, on_the_replica


def batch_rows(x: Any, dim: int = 0) -> int:
    """Rows (along ``dim``, DataParallel's) of the first tensor found in ``x`` (a tensor,
    tuple, list or dict) that has that dimension."""
    if isinstance(x, torch.Tensor):
        return int(x.shape[dim]) if x.dim() > dim else int(dim == 0)
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        for v in x:
            n = batch_rows(v, dim)
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

    A DataParallel that splits the batch along another dimension (``nn.DataParallel(model,
    dim=1)``, a sequence-first model's) gathers along it too, and a replica's one number
    cannot be gathered along a dimension it lacks ("Dimension out of range"): give the
    wrapper the same ``dim``, and each replica returns its loss and count with that many
    dimensions more (and counts its rows along it)::

        model = nn.DataParallel(dpprof.ModelWithLoss(model, loss_fn, dim=1), dim=1)

    The wrapper stands in for the model where a script reaches it as ``model.module``: its
    ``state_dict`` is the model's, with the model's keys (a checkpoint saved with the fix
    loads without it, and one saved before it loads with it), ``load_state_dict`` takes
    them, and the model's attributes read and set through it (``model.module.fc``). Only
    ``named_parameters()`` and ``named_modules()`` show it, their names under ``model.``.
    """

    # the wrapper's own attributes: never the model's, though the model may have the names
    _OWN = frozenset({"model", "loss_fn", "keep_outputs", "dim", "loss_modules", "_source",
                      "_loading_under"})

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor],
                 keep_outputs: bool = False, dim: int = 0) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.keep_outputs = keep_outputs
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise ValueError(f"ModelWithLoss: dim={dim!r}: give DataParallel's dim, a "
                             "dimension index from 0 (its default)")
        self.dim = dim  # DataParallel's: what the replicas' losses are gathered along
        # the modules a loss function computes with, replicated with the model (a module
        # given as the loss is a submodule already); the original, which every replica's
        # copy of __dict__ shares, to find their copies by: weakly (a reference to itself
        # would keep each wrapper, and what it holds, to the garbage collector)
        self.loss_modules = nn.ModuleList(
            [] if isinstance(loss_fn, nn.Module) else modules_of(loss_fn, model))
        self._source = weakref.ref(self)
        self._register_load_state_dict_pre_hook(_the_model_s_keys, with_module=True)
        self.register_load_state_dict_post_hook(_keys_as_given)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_modules", {}).get("model")
            if model is None or name in self._OWN:
                raise
            return getattr(model, name)

    def __setattr__(self, name: str, value: Any) -> None:
        model = self.__dict__.get("_modules", {}).get("model")
        # a name of the model's, public (nn.Module's own bookkeeping, _forward_hooks and
        # the like, which unpickling may set, stays the wrapper's)
        if (model is not None and not name.startswith("_") and name not in self._OWN
                and not self._holds(name) and hasattr(model, name)):
            setattr(model, name, value)  # model.module.fc = nn.Linear(...): the model's fc
            return
        super().__setattr__(name, value)

    def _holds(self, name: str) -> bool:
        return name in self.__dict__ or any(
            name in self.__dict__.get(d, {}) for d in ("_parameters", "_buffers", "_modules"))

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> Any:
        """The model's ``state_dict``: its keys as without the wrapper (the loss's buffers,
        a weighted loss's class weights, are the script's constants and left out)."""
        return self.model.state_dict(*args, destination=destination, prefix=prefix,
                                     keep_vars=keep_vars)

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
                return per_element(loss, (outputs, targets, more_targets), self.dim)
            # one value a replica, with a dimension to gather along: DataParallel's
            one = (1,) * (self.dim + 1)
            if len(calls) == 1 and sums(calls[0][0]):  # the replicas' losses add up
                return loss.reshape(one), loss.new_full(one, SUMMED)
            count = denominator(*calls[0][:3]) if len(calls) == 1 else None
        if count is None:
            rows = float(batch_rows(targets, self.dim) or batch_rows(inputs, self.dim))
            return loss.reshape(one) * rows, loss.new_full(one, rows)
        return loss.reshape(one) * count.reshape(one), count.reshape(one)

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


def _the_model_s_keys(wrapper: ModelWithLoss, state_dict: dict[str, Any], prefix: str,
                      *_: Any) -> None:
    """Before ``load_state_dict`` reaches the wrapper: the model's keys (as
    :meth:`ModelWithLoss.state_dict` gives them, and as the script saved them before the fix)
    moved under ``model.``, and the loss's own tensors given as they are, so that a strict
    load finds every key it expects and no other."""
    wrapper.__dict__["_loading_under"] = prefix  # for _keys_as_given, after the model's
    for key in [k for k in state_dict if k.startswith(prefix)]:
        state_dict[f"{prefix}model.{key[len(prefix):]}"] = state_dict.pop(key)
    own = nn.Module.state_dict(wrapper, prefix=prefix, keep_vars=True)
    for key, value in own.items():
        if not key.startswith(f"{prefix}model."):
            state_dict.setdefault(key, value)


def _keys_as_given(wrapper: ModelWithLoss, incompatible: Any) -> None:
    """After ``load_state_dict`` has loaded the model: the missing and unexpected keys it
    names, as the state dict had them (without the ``model.`` they were moved under)."""
    prefix = wrapper.__dict__.pop("_loading_under", None)
    if prefix is None:
        return
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        under = f"{prefix}model."
        keys[:] = [prefix + k[len(under):] if k.startswith(under) else k for k in keys]


def per_element(loss: torch.Tensor, operands: Any,
                dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A replica's loss kept per element (``reduction="none"``: one loss per row, or per
    token) as ``(loss, no count)``: DataParallel's gather concatenates the replicas' along
    the batch, which is the whole batch's loss as the gathered outputs would have given it,
    and :meth:`ModelWithLoss.combine` returns it for the loop to reduce as it does. Its first
    dimension must be a shard's rows, or those rows flattened with the dimensions after
    them (``out.view(-1, V)``: rows x tokens), of the outputs or of the targets
    (``operands``); any other shape (a loss per class) has no such order: a clear error.
    Gathered along DataParallel's ``dim`` beyond 0, it must keep that dimension, the
    shard's rows there (a sequence-first model's ``(T, rows)`` loss per token)."""
    if dim:
        if loss.dim() <= dim or not any(
                isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] == loss.shape[dim]
                for t in tree_leaves(operands)):
            raise ValueError(
                f"the loss returns a tensor of shape {tuple(loss.shape)}, which does not keep "
                f"the batch's rows in dimension {dim}, the one DataParallel gathers along: "
                "the replicas' losses do not make the whole batch's; reduce it inside the "
                "loss function (a mean or a sum), keep that dimension, or keep the loss "
                "outside forward")
        return loss, nothing_to_gather(loss, dim)
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
    return loss, nothing_to_gather(loss)


def nothing_to_gather(like: torch.Tensor | None, dim: int = 0) -> torch.Tensor:
    """An empty tensor a replica returns where it has nothing for DataParallel to gather
    (no count beside a loss per element; outputs held for a loss to come), with the
    dimension DataParallel gathers along (``dim``) for the gather to take it."""
    shape = (1,) * dim + (0,)
    return like.new_empty(shape) if like is not None else torch.empty(shape)


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


def call_model(model: Callable[..., Any], inputs: Any) -> Any:
    """The model called on a workload's inputs: a dict as keyword arguments (``model(**batch)``,
    the Hugging Face way) or, where the model's forward takes one positional parameter and not
    the keys, as that one argument (``model(batch)``); a tuple as positional arguments,
    anything else as the one argument."""
    if isinstance(inputs, dict):
        return model(inputs) if takes_one_dict(model, inputs) else model(**inputs)
    return model(*as_args(inputs))
