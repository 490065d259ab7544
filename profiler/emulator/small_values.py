"""Real values for the small tensors of virtual GPUs, so that fewer reads need a stand-in.

Over meta tensors a virtual GPU holds no values, and a value read back (``.item()``,
``bool()``, ``.tolist()``, ``.cpu()``) is a stand-in. Many of the values scripts and
libraries read are small and follow from host data alone: labels and masks moved to the GPU
(Hugging Face's ``attention_mask.all()`` picks its attention path on one), a step counter,
a scalar learning rate. :class:`SmallValues` follows them: a storage made on a virtual GPU
from values it knows (host tensors other than the model's parameters, or storages it
follows) by a deterministic op, with every output within ``max_tensor_bytes``, gets its
values computed on the host beside the meta op; reads of it give the real values. What the
model computes from its parameters is not followed: its values are the GPU's arithmetic,
and computing them is ``--compute``'s work.

The rules that keep it honest:

* an op with a random stream (``nondeterministic_seeded``: dropout, ``randn``) is never
  computed: the host's generator is the script's own, and a GPU draws from another;
* an op that writes a storage it cannot compute (an input without values) drops that
  storage's values, so a value is never stale;
* a view reads its base storage's values with its own geometry (a view of another dtype has
  none); the memory the emulation counts is not changed by any of this.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from dpprof.emulator.identity import op_key, storage_key
from dpprof.errors import called_where_nothing_raises

MAX_TENSOR_BYTES = 64 * 1024  # a mask or the labels of a large batch; no activation
MAX_TOTAL_BYTES = 64 * 2**20  # what the values may hold on the host at once


# the device the bytes are on (``Tensor.device`` answers the virtual GPU while emulating)
_REAL_DEVICE = torch._C.TensorBase.__dict__["device"]


# Tensor.is_meta as torch answers it (the emulation patches the property); no device made
_is_meta: Callable[[torch.Tensor], bool] = torch._C.TensorBase.__dict__["is_meta"].__get__


class SmallValues:
    """Storage (meta bytes on a virtual GPU) -> its values on the host, for small ones."""

    def __init__(self, max_tensor_bytes: int = MAX_TENSOR_BYTES,
                 max_total_bytes: int = MAX_TOTAL_BYTES) -> None:
        self.max_tensor_bytes = max_tensor_bytes
        self.max_total_bytes = max_total_bytes
        self.total_bytes = 0
        # storage_key(meta storage) -> (weak reference to it, its values as one flat host tensor)
        self._values: dict[int, tuple[weakref.ref[Any], torch.Tensor]] = {}
        self.computed_ops = 0

    def value_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t``'s values on the host, if followed (a view: with its own geometry)."""
        st = t.untyped_storage()
        found = self._values.get(storage_key(st))
        if found is None or found[0]() is not st:
            return None
        flat = found[1]
        if flat.dtype != t.dtype:
            return None
        return flat.as_strided(t.shape, t.stride(), t.storage_offset())

    def follow(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               out: Any) -> None:
        """After the meta op ``func`` made ``out``: compute its values where the rules allow,
        else forget the values of what it wrote."""
        leaves = _tensors(args, kwargs)
        metas_in = [a for a in leaves if _is_meta(a)]
        values = self._values
        if func is _aten.copy_.default and self._copied_whole(args):
            return
        for a in metas_in:
            # an input without values (an activation): nothing to compute (the common case;
            # a storage never followed is not among the values, the cheap test first)
            if storage_key(a.untyped_storage()) not in values or self.value_of(a) is None:
                if values and _mutable(func):
                    self._forget_written(func, metas_in)
                return
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and _is_meta(o)]
        if not outs and not metas_in:
            return
        small = all(o.untyped_storage().nbytes() <= self.max_tensor_bytes for o in outs) and all(
            _REAL_DEVICE.__get__(a).type in ("meta", "cpu") for a in leaves)
        result = (self.compute(func, args, kwargs)
                  if small and func not in _UNINITIALIZED else None)
        if result is None:
            self._forget_written(func, metas_in)
            return
        for m, r in zip(tree_leaves(out), tree_leaves(result), strict=False):
            if isinstance(m, torch.Tensor) and _is_meta(m) and isinstance(r, torch.Tensor):
                self.keep(m, r)

    def _copied_whole(self, args: tuple[Any, ...]) -> bool:
        """``dst.copy_(src)`` that writes every byte of a storage not followed yet (a buffer
        made by ``empty`` and then filled, as torch's C++ fills the bucket indices DDP's
        reducer broadcasts) from values known (a host tensor, or one followed): ``dst``'s
        storage gets them. False where the rule does not apply (the general rules then)."""
        dst, src = args[0], args[1]
        if not (isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor)
                and _is_meta(dst)):
            return False
        st = dst.untyped_storage()
        found = self._values.get(storage_key(st))
        if found is not None and found[0]() is st:
            return False  # followed already: written in place by the general rules
        if (not dst.is_contiguous() or dst.storage_offset()
                or dst.numel() * dst.element_size() != st.nbytes()
                or st.nbytes() > self.max_tensor_bytes):
            return False
        if _is_meta(src):
            values = self.value_of(src)
        elif _REAL_DEVICE.__get__(src).type == "cpu" and not isinstance(src, torch.nn.Parameter):
            values = src
        else:
            values = None
        if values is None:
            return False
        try:
            real = torch.empty(dst.shape, dtype=dst.dtype).copy_(values)
        except RuntimeError:  # shapes that do not broadcast: torch's own error came first
            return False
        self.keep(dst, real)
        return True

    def compute(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func`` over the values of its arguments, on the host; None where one has none,
        one is a parameter (what the model computes is not followed, only what host data
        alone decides), the op draws random numbers, or the host cannot run it."""
        leaves = _tensors(args, kwargs)
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()) or any(
                isinstance(a, torch.nn.Parameter) for a in leaves):
            return None
        if any(_is_meta(a) and self.value_of(a) is None for a in leaves):
            return None
        flat, spec = tree_flatten((args, kwargs))
        # a device, positional (``aten.to.device``) or keyword, is a virtual GPU or meta:
        # the host here
        real = [self.value_of(a) if isinstance(a, torch.Tensor) and _is_meta(a)
                else torch.device("cpu") if isinstance(a, torch.device) else a
                for a in flat]
        real_args, real_kwargs = tree_unflatten(real, spec)
        if real_kwargs.get("device") is not None:  # given as a string
            real_kwargs = {**real_kwargs, "device": torch.device("cpu")}
        if getattr(func, "namespace", "") in _COLLECTIVES:
            # what other ranks contribute is not on this host: never the host's own run of
            # the collective (over the fake group its output holds no data)
            result = _collective_values(func, real_args)
            if result is not None:
                self.computed_ops += 1
            return result
        try:
            result = func(*real_args, **real_kwargs)
        except Exception:  # a kernel the host lacks for this dtype: no values, as before
            return None
        self.computed_ops += 1
        return result

    def keep(self, m: torch.Tensor, r: torch.Tensor) -> None:
        """``r`` (a host tensor of ``m``'s geometry) holds the values of ``m``'s storage."""
        st = m.untyped_storage()
        key = storage_key(st)
        found = self._values.get(key)
        if found is not None and found[0]() is st:
            return  # written in place, or a view of a storage followed already
        if (r.dtype != m.dtype or r.stride() != m.stride()
                or r.storage_offset() != m.storage_offset()):
            return
        nbytes = r.untyped_storage().nbytes()
        if nbytes != st.nbytes() or self.total_bytes + nbytes > self.max_total_bytes:
            return
        flat = torch.empty(0, dtype=r.dtype).set_(
            r.untyped_storage(), 0, (nbytes // max(r.element_size(), 1),), (1,))
        self.total_bytes += nbytes
        self._values[key] = (weakref.ref(st, self._dropper(key, nbytes)), flat)

    def _dropper(self, key: int, nbytes: int) -> Any:
        @called_where_nothing_raises
        def drop(_ref: Any) -> None:
            if self._values.pop(key, None) is not None:
                self.total_bytes -= nbytes

        return drop

    def _forget_written(self, func: Any, metas_in: list[torch.Tensor]) -> None:
        """The op wrote storages it could not compute: their values are gone."""
        schema = getattr(func, "_schema", None)
        if schema is None or not schema.is_mutable:
            return
        for t in metas_in:
            st = t.untyped_storage()
            found = self._values.pop(storage_key(st), None)
            if found is not None:
                self.total_bytes -= found[1].untyped_storage().nbytes()


# the functional collectives' namespaces (torch.distributed._functional_collectives)
_COLLECTIVES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd"})


def _collective_values(func: Any, args: tuple[Any, ...]) -> torch.Tensor | None:
    """A functional collective's values as one rank of ranks that all run the same program
    sees them (:mod:`dpprof.emulator.process_group`'s rule): an all-reduce of ``size`` equal
    contributions (``sum``: the input times ``size``; ``avg``, ``min``, ``max``: the input);
    ``wait_tensor`` and the autograd wrapper give their input. None for any other (a
    stand-in is read instead)."""
    name = func._schema.name.split("::")[-1]
    if name in ("wait_tensor", "_wrap_tensor_autograd"):
        return args[0]  # type: ignore[no-any-return]
    if name != "all_reduce" or len(args) < 3:
        return None
    op = str(args[1]).lower()
    if op in ("avg", "min", "max"):
        return args[0].clone()  # type: ignore[no-any-return]
    if op != "sum":
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        size = _resolve_process_group(args[2]).size()
    except (RuntimeError, ValueError, KeyError):
        return None
    return args[0] * size  # type: ignore[no-any-return]


# op_key(op) -> (op, whether its schema says it writes): asked once per op, by identity
# (an OpOverload's __hash__ is Python)
_MUTABLE: dict[int, tuple[Any, bool]] = {}


def _mutable(func: Any) -> bool:
    found = _MUTABLE.get(op_key(func))
    if found is not None and found[0] is func:
        return found[1]
    schema = getattr(func, "_schema", None)
    known = schema is not None and bool(schema.is_mutable)
    _MUTABLE[op_key(func)] = (func, known)
    return known


_aten = torch.ops.aten
# ops whose output holds whatever memory held: no values until something writes them
_UNINITIALIZED = frozenset({
    _aten.empty.memory_format, _aten.empty_like.default, _aten.empty_strided.default,
    _aten.new_empty.default, _aten.new_empty_strided.default, _aten.empty_permuted.default,
    _aten.resize_.default,
})


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensor arguments of an aten op (top level, and in lists: ``TensorList``)."""
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(b for b in a if isinstance(b, torch.Tensor))
    return found
