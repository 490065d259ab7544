"""How an aten op carries the values :mod:`dpprof.emulator.small_values` follows: the
arguments its schema says it writes, whether each output element comes from the inputs'
elements at its place (pointwise) or is moved from one (``cat``, ``index``), the ops whose
output holds no values yet (``empty``) or that write no byte (``set_``), and what a
functional collective's output holds on this host."""

from __future__ import annotations

from typing import Any

import torch

from dpprof.emulator.identity import op_key

__all__ = ["COLLECTIVES", "MOVED", "MOVES", "POINTWISE", "REBINDS", "SHAPE_ONLY", "UNINITIALIZED",
           "collective_values", "tensors", "traits"]

# the functional collectives' namespaces (torch.distributed._functional_collectives)
COLLECTIVES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd"})


def collective_values(func: Any, args: tuple[Any, ...]) -> torch.Tensor | None:
    """A functional collective's values where they are its input's: ``wait_tensor`` and the
    autograd wrapper. None for any other: what other ranks contribute is not on this host
    (a reduction's values: :mod:`dpprof.emulator.same_program`, after the op)."""
    name = func._schema.name.split("::")[-1]
    if name in ("wait_tensor", "_wrap_tensor_autograd"):
        return args[0]  # type: ignore[no-any-return]
    return None


POINTWISE = "pointwise"  # each output element from the inputs' elements at its place
MOVED = "moved"  # elements moved, from one input or several (cat, copy_ into a slice)

# op_key(op) -> (op, whether its schema says it writes, how it carries known elements)
_TRAITS: dict[int, tuple[Any, tuple[tuple[int, str], ...], str | None]] = {}


def traits(func: Any) -> tuple[tuple[tuple[int, str], ...], str | None]:
    """The arguments ``func`` writes (position and name: its schema's ``(a!)`` ones; none
    where it has no schema), and how it carries known elements through
    (:data:`POINTWISE`, :data:`MOVED`, or None), asked once per op, by identity (an
    OpOverload's __hash__ is Python)."""
    found = _TRAITS.get(op_key(func))
    if found is not None and found[0] is func:
        return found[1], found[2]
    arguments = getattr(getattr(func, "_schema", None), "arguments", ())
    writes = tuple((i, a.name) for i, a in enumerate(arguments)
                   if a.alias_info is not None and a.alias_info.is_write)
    lists = any(a.type.kind() == "ListType" and "Tensor" in str(a.type) for a in arguments)
    carries = (MOVED if func in MOVES
               else POINTWISE if torch.Tag.pointwise in getattr(func, "tags", ()) and not lists
               else None)
    _TRAITS[op_key(func)] = (func, writes, carries)
    return writes, carries


_aten = torch.ops.aten
# ops whose output holds whatever memory held: no values until something writes them
UNINITIALIZED = frozenset({
    _aten.empty.memory_format, _aten.empty_like.default, _aten.empty_strided.default,
    _aten.new_empty.default, _aten.new_empty_strided.default, _aten.empty_permuted.default,
    _aten.resize_.default,
})


# ops that only move elements, by the names of their arguments that say where to (known whole)
MOVES: dict[Any, tuple[str, ...]] = {
    _aten.cat.default: (), _aten.stack.default: (), _aten.copy_.default: (),
    _aten._to_copy.default: (), _aten.clone.default: (), _aten.repeat.default: (),
    _aten._unsafe_view.default: (), _aten.index.Tensor: ("indices",),
    _aten.index_select.default: ("index",),
}


# ops that read their input's shape, dtype and layout, never its values (the model's
# activation an op makes a filled tensor like: Ultralytics' stride tensor by new_full)
SHAPE_ONLY = frozenset({
    _aten.new_full.default, _aten.new_zeros.default, _aten.new_ones.default,
    _aten.full_like.default, _aten.zeros_like.default, _aten.ones_like.default,
})


# ops that point a tensor at a storage (another's, a new one) and write none of its bytes
REBINDS = frozenset({
    _aten.set_.source_Storage, _aten.set_.source_Storage_storage_offset,
    _aten.set_.source_Tensor, _aten.set_.source_Tensor_storage_offset, _aten.set_.default,
})



def tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensor arguments of an aten op (top level, and in lists: ``TensorList``)."""
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(b for b in a if isinstance(b, torch.Tensor))
    return found
