"""A rank's share of a batch the script makes by hand: a torch factory's arguments
(``torch.randint(0, V, (B, T))``, ``torch.randn(B, D)``, ``torch.full((B,), 1.0)``) with the
batch's rows, along the dimension DataParallel split them (its ``dim``), cut to the share
(the DDP alternative's run, :mod:`dpprof.script.ddp_run`)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["with_rows"]


def with_rows(func: str, args: tuple[Any, ...], kwargs: dict[str, Any], rows: int,
              share: int, dim: int = 0) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """``func``'s arguments with a size whose dimension ``dim`` is ``rows`` given ``share``
    rows there instead; None where the size has no such dimension."""
    def cut(size: Any) -> Any:
        if isinstance(size, (tuple, list, torch.Size)) and len(size) > dim and (
                size[dim] == rows):
            cut_size = [*size[:dim], share, *size[dim + 1:]]
            return torch.Size(cut_size) if isinstance(size, torch.Size) else type(size)(
                cut_size)
        return None

    if "size" in kwargs:
        new = cut(kwargs["size"])
        return None if new is None else (args, {**kwargs, "size": new})
    if func == "randint":  # randint(high, size) / randint(low, high, size)
        at = next((i for i, a in enumerate(args) if isinstance(a, (tuple, list, torch.Size))),
                  None)
        if at is None:
            return None
        new = cut(args[at])
        return None if new is None else ((*args[:at], new, *args[at + 1:]), kwargs)
    if func == "full" and args:  # full((B, D), value)
        new = cut(args[0])
        return None if new is None else ((new, *args[1:]), kwargs)
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):  # randn((B, D))
        new = cut(args[0])
        return None if new is None else ((new,), kwargs)
    if len(args) > dim and all(isinstance(a, int) for a in args[:dim + 1]) and (
            args[dim] == rows):  # randn(B, D); randn(T, B, D) split along 1
        return (*args[:dim], share, *args[dim + 1:]), kwargs
    return None
