"""A rung of the ladder where Hugging Face's ``Trainer`` runs the model and calls
``backward()``: the rung is the Trainer's own settings, given to every ``TrainingArguments``
the script makes (``bf16=True`` or ``fp16=True``; activation checkpointing, non-reentrant),
and the Trainer does the rest as it does for the user: its autocast (accelerate's, which
also turns the model's outputs to float32), ``activation_checkpointing_enable()`` on the
model's checkpointing layers, and its DDP's ``find_unused_parameters=False`` once the model
checkpoints. The change handed to the user is the same keywords in the script's
``TrainingArguments(...)`` (:mod:`dpprof.script.trainer_settings_diff`), so the script
patched with them is the run the rung measured; the generic rung (autocast from the forward
to ``backward()``, the blocks wrapped at the first forward) would measure another run
(Trainer's DDP keeps ``find_unused_parameters=True`` when it does not know the model
checkpoints)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

from torch import nn

from dpprof.measure.ladder_rungs import Rung
from dpprof.script.import_hook import on_each_load

__all__ = ["asked_precision", "checkpointing_layers", "given_to_trainer", "run_by_trainer",
           "settings_of"]

_ARGUMENTS_MODULE = "transformers.training_args"
_TRAINER_FILES = ("/transformers/trainer.py:", "/transformers/trainer_seq2seq.py:")
# the keyword transformers names activation checkpointing by (the older name is an alias of
# the newer since 5.0, and the only one before)
_CHECKPOINTING_NAMES = (("activation_checkpointing", "activation_checkpointing_kwargs"),
                        ("gradient_checkpointing", "gradient_checkpointing_kwargs"))


def run_by_trainer(forward_sites: Sequence[str], backward_sites: Sequence[str]) -> bool:
    """Whether Hugging Face's Trainer called the model and ``backward()`` (its training
    loop is in the frames that led to both: ``forward_sites``, ``backward_sites``)."""
    return all(any(f in site for site in sites for f in _TRAINER_FILES)
               for sites in (forward_sites, backward_sites))


def _arguments_class() -> Any:
    module = sys.modules.get(_ARGUMENTS_MODULE) or importlib.import_module(_ARGUMENTS_MODULE)
    return module.TrainingArguments


def settings_of(rung: Rung) -> dict[str, Any]:
    """The ``TrainingArguments`` keywords that are ``rung`` (the installed transformers'
    names), in the order they are written."""
    fields = {f.name for f in dataclasses.fields(_arguments_class())}
    out: dict[str, Any] = {}
    if rung.amp is not None:
        out["bf16" if rung.amp == "bfloat16" else "fp16"] = True
    if rung.checkpoint:
        flag, kwargs = next((n for n in _CHECKPOINTING_NAMES if n[0] in fields),
                            _CHECKPOINTING_NAMES[-1])
        # non-reentrant, as the rung's own checkpointing (transformers' default is reentrant)
        out[flag] = True
        out[kwargs] = {"use_reentrant": False}
    return out


@contextlib.contextmanager
def _post_init_wrapped(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
                       ) -> Iterator[None]:
    """For the duration: ``TrainingArguments.__post_init__`` (which every subclass calls) is
    ``wrap`` of itself, from the moment transformers' module is loaded."""
    patched: list[tuple[Any, Any]] = []

    def patch(module: ModuleType) -> None:
        cls = module.TrainingArguments
        original = cls.__dict__["__post_init__"]
        cls.__post_init__ = wrap(original)
        patched.append((cls, original))

    with on_each_load([_ARGUMENTS_MODULE], patch):
        try:
            yield
        finally:
            for cls, original in reversed(patched):
                cls.__post_init__ = original


def given_to_trainer(rung: Rung) -> contextlib.AbstractContextManager[None]:
    """For the duration: every ``TrainingArguments`` made has ``rung``'s settings before
    transformers checks them."""
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        settings = settings_of(rung)

        def __post_init__(self: Any, *args: Any, **kwargs: Any) -> Any:
            for name, value in settings.items():
                setattr(self, name, value)
            return original(self, *args, **kwargs)

        return __post_init__

    return _post_init_wrapped(wrap)


def asked_precision(asked: list[str]) -> contextlib.AbstractContextManager[None]:
    """For the duration: the mixed precision each ``TrainingArguments`` made asks for
    (``"bf16"``, ``"fp16"``) appended to ``asked``: under DataParallel the Trainer leaves
    autocast to accelerate, which does not prepare a DataParallel model, so what a script
    asks for there is not what it runs."""
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def __post_init__(self: Any, *args: Any, **kwargs: Any) -> Any:
            done = original(self, *args, **kwargs)
            asked.extend(k for k in ("bf16", "fp16") if getattr(self, k, False) is True)
            return done

        return __post_init__

    return _post_init_wrapped(wrap)


def checkpointing_layers(model: nn.Module) -> int:
    """The layers of ``model`` that transformers checkpoints (its checkpointing layers with
    the flag on; the innermost flagged modules where the model has no such layers)."""
    layers = sys.modules.get("transformers.modeling_layers")
    base = getattr(layers, "GradientCheckpointingLayer", None)
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    if base is not None and any(isinstance(m, base) for m in flagged):
        return sum(isinstance(m, base) for m in flagged)
    return sum(not any(getattr(c, "gradient_checkpointing", False) is True
                       for c in m.modules() if c is not m) for m in flagged)
