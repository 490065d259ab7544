"""A storage's values as :mod:`dpprof.emulator.small_values` keeps them, one flat host
tensor: the elements a view reads in it, whether a view covers its whole storage, and which
elements of a pointwise op's output are known."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["all_known", "geometry_of", "whole_storage"]


def whole_storage(t: torch.Tensor, st: Any) -> bool:
    """Whether ``t`` views every byte of its storage ``st``, in order."""
    return (t.is_contiguous() and not t.storage_offset()
            and t.numel() * t.element_size() == st.nbytes())


def geometry_of(flat: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The elements of ``flat`` (a storage's, flat) that ``t`` views, with ``t``'s geometry."""
    return flat.as_strided(t.shape, t.stride(), t.storage_offset())


def all_known(masks: list[Any], shapes: list[torch.Size]) -> list[torch.Tensor]:
    """For a pointwise op: an output element is known where the elements of every input it
    is computed from (broadcast) are."""
    if any(isinstance(m, (list, tuple)) for m in masks):
        raise ValueError("a list of tensors: each its own, not these rules")
    found = []
    for shape in shapes:
        known = torch.ones(shape, dtype=torch.bool)
        for m in masks:
            if isinstance(m, torch.Tensor):
                known &= m.broadcast_to(shape)
        found.append(known)
    return found
