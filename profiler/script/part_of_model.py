"""DataParallel around a part of a model: ``model.features = nn.DataParallel(model.features)``,
as pytorch/examples' ImageNet script wraps AlexNet's and VGG's convolutions (their large
classifier then runs on cuda:0 alone, on the gathered features). The whole model is the
outermost module whose forward is running when the wrapper's runs and that holds it: its own
forward, not a loss, uses the wrapper's outputs, and DDP in place of that DataParallel wraps
the whole model, as a DDP script does (every parameter's gradient averaged across the ranks,
the classifier's too: DDP around the part alone would train a different classifier on each
rank)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

# torch's class, held before a run puts its own in place (a subclass of it)
_DATA_PARALLEL = nn.DataParallel

# the DDP alternative's note where its rank wraps the whole model
PART_OF_MODEL = (
    "DataParallel wraps a part of the model ({part}): the rank's DDP wraps the whole model, as "
    "a DDP script does, every parameter's gradient in its buckets and all-reduced, the rest's "
    "too (DDP around the part alone would leave the rest's gradients each rank's own, and "
    "the ranks' weights apart); built where the script sets the wrapper into its model, or, "
    "where that model is not to be told there, at the part's first forward, after the first "
    "batch, where the caching allocator's segments can come out otherwise (reserved memory; "
    "the allocated bytes do not)")


@dataclass(frozen=True)
class WholeModel:
    """The model a DataParallel wrapper is a part of."""

    model: nn.Module
    name: str  # the wrapper's name in it: "features"

    @property
    def words(self) -> str:
        """``VGG's features``."""
        return f"{type(self.model).__name__}'s {self.name}"


def modules_in_forward() -> Iterator[nn.Module]:
    """The modules whose forward is running on the calling stack, innermost first (read from
    the frames' ``self``: ``Module._call_impl``'s and the forwards')."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self") if frame.f_code.co_name in (
            "_call_impl", "_wrapped_call_impl", "forward") else None
        if isinstance(owner, nn.Module):
            yield owner
        frame = frame.f_back  # type: ignore[assignment]


def whole_model(wrapper: nn.Module) -> WholeModel | None:
    """The outermost module in forward on the calling stack that holds ``wrapper`` as a
    submodule, or None where the script calls the wrapper itself."""
    found: nn.Module | None = None
    for owner in modules_in_forward():
        if owner is not wrapper and any(m is wrapper for m in owner.modules()):
            found = owner
    if found is None or not trains_besides(found, wrapper):
        return None
    name = next(n for n, m in found.named_modules() if m is wrapper)
    return WholeModel(found, name)


def trains_besides(model: nn.Module, part: nn.Module) -> bool:
    """Whether ``model`` trains parameters outside ``part`` and every DataParallel it holds
    (not so a GAN's module that holds both networks, each wrapped: each wrap's DDP covers
    its own)."""
    inside = {id(p) for m in [part, *model.modules()] if m is part
              or isinstance(m, _DATA_PARALLEL) for p in m.parameters()}
    return any(p.requires_grad and id(p) not in inside for p in model.parameters())
