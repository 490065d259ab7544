"""The op memo of the virtual devices, over meta tensors only: meta kernels are
mostly Python (``torch._refs``), so a functional op on the same shapes is run once and its
outputs' metadata replayed (:class:`OpMemo`, bounded), and ops that over meta tensors
write and allocate nothing (random fills, in-place updates that return nothing) are
skipped (:class:`MetaOpRunner`, a part of the virtual devices' dispatch mode)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from dpprof.emulator.identity import op_key, storage_key

aten = torch.ops.aten

_NO = object()  # "not cacheable"


class OpMemo(dict[Any, Any]):
    """(op, metadata of its meta-tensor arguments) -> template of its outputs, bounded: a
    long search (maxbatch) meets new shapes at every batch size, so it starts afresh when
    full rather than growing without end."""

    MAX_ENTRIES = 1 << 16

    def __setitem__(self, key: Any, value: Any) -> None:
        if len(self) >= self.MAX_ENTRIES:
            self.clear()
        super().__setitem__(key, value)


OP_MEMO = OpMemo()
_SIMPLE = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
           torch.memory_format)
# Per-op facts from the schema, asked once per op and looked up by op_key (an OpOverload's
# __hash__ is Python: a call per look-up on every op); the op is kept beside its answer.
_FUNCTIONAL: dict[int, tuple[Any, bool]] = {}


def _functional(func: Any) -> bool:
    """No argument written, no output aliasing an input (per the op's schema)."""
    found = _FUNCTIONAL.get(op_key(func))
    known = found[1] if found is not None and found[0] is func else None
    if known is None:
        try:
            schema = func._schema
            known = not any(a.alias_info is not None for a in schema.returns) and not any(
                a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
            known = known and not schema.is_mutable and "rand" not in func.__name__
        except AttributeError:
            known = False
        _FUNCTIONAL[op_key(func)] = (func, known)
    return known


_IN_PLACE_ONLY: dict[int, tuple[Any, bool]] = {}


def writes_in_place_only(func: Any) -> bool:
    """An in-place op that returns nothing (``_foreach_mul_``, ``_fused_adamw_``, ...):
    over meta tensors (only: the optimizers' step counts are real host tensors) it
    allocates nothing and writes nothing, and its meta kernel (Python
    refs, per tensor: the optimizers' foreach updates were half of a step's emulation)
    can be skipped. ``out=`` variants are not in-place (they may resize their outputs)."""
    found = _IN_PLACE_ONLY.get(op_key(func))
    known = found[1] if found is not None and found[0] is func else None
    if known is None:
        try:
            schema = func._schema
            known = (schema.is_mutable and not schema.returns
                     and func._overloadpacket.__name__.endswith("_"))
        except AttributeError:
            known = False
        _IN_PLACE_ONLY[op_key(func)] = (func, known)
    return known


_OUT_ONLY: dict[int, tuple[Any, tuple[str, bool] | None]] = {}
_SELF_ONLY: dict[int, tuple[Any, bool]] = {}


def writes_self_only(func: Any) -> bool:
    """An in-place op that writes its first argument alone and returns it (``add_``,
    ``sigmoid_``, ``mul_``: an LSTM's cell runs three a step, each a Python meta kernel
    over meta tensors)."""
    found = _SELF_ONLY.get(op_key(func))
    if found is not None and found[0] is func:
        return found[1]
    known = False
    try:
        schema = func._schema
        written = [a for a in schema.arguments
                   if a.alias_info is not None and a.alias_info.is_write]
        returns = schema.returns
        known = (len(written) == 1 and written[0] is schema.arguments[0]
                 and len(returns) == 1 and returns[0].alias_info is not None
                 and returns[0].alias_info.is_write
                 and returns[0].alias_info.before_set == written[0].alias_info.before_set
                 and torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()))
    except AttributeError:
        pass
    _SELF_ONLY[op_key(func)] = (func, known)
    return known


def out_argument(func: Any) -> tuple[str, bool] | None:
    """An ``out=`` variant's one written argument, a keyword-only tensor or list of tensors
    (``mul.out``'s ``out``, FSDP2's ``chunk_cat`` and ``split_with_sizes_copy``), where the
    op writes nothing else: (its name, whether the op returns it; else it returns
    nothing); None for any other op."""
    found = _OUT_ONLY.get(op_key(func))
    if found is not None and found[0] is func:
        return found[1]
    answer: tuple[str, bool] | None = None
    try:
        schema = func._schema
        written = [a for a in schema.arguments
                   if a.alias_info is not None and a.alias_info.is_write]
        returns = schema.returns
        if len(written) == 1 and written[0].kwarg_only:
            kind = str(written[0].type)
            if not returns and kind in ("Tensor", "List[Tensor]", "Tensor[]"):
                answer = (written[0].name, False)
            elif (len(returns) == 1 and kind == "Tensor" and returns[0].alias_info is not None
                  and returns[0].alias_info.is_write):
                answer = (written[0].name, True)
    except AttributeError:
        answer = None
    _OUT_ONLY[op_key(func)] = (func, answer)
    return answer


_SAME_OUT = ("same out",)  # the memo's answer: the out= tensor returned as it was

# In-place random fills: over meta tensors they allocate nothing and return ``self`` (their
# meta kernels are Python refs whose first call imports torch._dynamo, about a second).
_FILLS_ONLY = {
    aten.normal_.default, aten.uniform_.default, aten.random_.default,
    getattr(aten.random_, "from"), aten.random_.to, aten.exponential_.default,
    aten.log_normal_.default, aten.cauchy_.default, aten.geometric_.default,
    aten.bernoulli_.float, aten.bernoulli_.Tensor,
}
_FILLS_ONLY_KEYS = frozenset(map(op_key, _FILLS_ONLY))
# Tensor.is_meta as torch answers it (an emulation may patch the property), making no device
_is_meta: Callable[[torch.Tensor], bool] = torch._C.TensorBase.__dict__["is_meta"].__get__
_SIMPLE_TYPES = frozenset(_SIMPLE)
_SEQ = (list, tuple)


def _key_of(x: Any) -> Any:
    """A hashable summary of an argument: tensors by metadata, simple values by type and
    value, sequences element-wise; _NO for anything else."""
    cls = type(x)
    if cls in _SIMPLE_TYPES:
        return (cls, x)
    if isinstance(x, torch.Tensor):
        # Only a meta tensor is its metadata: a real tensor's results depend on its values,
        # so a call that reads one is never memoised (it would hand one tensor's values to
        # another of the same shape).
        if not _is_meta(x):
            return _NO
        return (x.shape, x.stride(), x.dtype, x.storage_offset(), x.layout)
    if cls in _SEQ or isinstance(x, _SEQ):
        parts = []
        for v in x:
            p = _key_of(v)
            if p is _NO:
                return _NO
            parts.append(p)
        return (cls, tuple(parts))
    return _NO


def _key_of_call(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    parts: list[Any] = [func]
    for a in args:
        p = _key_of(a)
        if p is _NO:
            return _NO
        parts.append(p)
    if kwargs:
        for name in sorted(kwargs):
            p = _key_of(kwargs[name])
            if p is _NO:
                return _NO
            parts.append((name, p))
    return tuple(parts)


def _template(out: Any) -> Any:
    """Outputs as (shape, stride, dtype) to rebuild, or _NO when they cannot be rebuilt
    from metadata alone (a view, an offset, a storage larger than its strides need)."""
    if isinstance(out, torch.Tensor):
        if out.storage_offset() != 0 or out.layout != torch.strided or out.device.type != "meta":
            return _NO
        need = (1 + sum((n - 1) * st for n, st in zip(out.shape, out.stride(), strict=True))
                if out.numel() else 0) * out.element_size()
        if out.untyped_storage().nbytes() != need:
            return _NO
        return ("t", tuple(out.shape), tuple(out.stride()), out.dtype)
    if isinstance(out, (list, tuple)):
        parts = [_template(o) for o in out]
        if any(p is _NO for p in parts):
            return _NO
        storages = [storage_key(o.untyped_storage()) for o in out if isinstance(o, torch.Tensor)]
        if len(set(storages)) != len(storages):
            return _NO
        return ("seq", type(out), parts)
    if isinstance(out, _SIMPLE):
        return ("v", out)
    return _NO


def _rebuild(tmpl: Any) -> Any:
    kind = tmpl[0]
    if kind == "t":
        return torch.empty_strided(tmpl[1], tmpl[2], dtype=tmpl[3], device="meta")
    if kind == "seq":
        return tmpl[1](_rebuild(p) for p in tmpl[2])
    return tmpl[1]


def _tensor_args(args: Any, kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


def _tensor_outputs(out: Any) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for o in out:
            if isinstance(o, torch.Tensor):
                yield o


class MetaOpRunner:
    """Runs ops over meta tensors through the shared :data:`OP_MEMO`."""

    def __init__(self) -> None:
        # Meta kernels are mostly Python (torch._refs): the same op on the same shapes is
        # run once and its outputs' metadata replayed (fresh storages only, see run). The
        # memo is a pure function of metadata, so every runtime shares it (a comparison's
        # scenarios and fixes run the same ops on the same shapes).
        self._op_cache = OP_MEMO
        self.cache_hits = 0

    def run(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """``func(*args, **kwargs)`` over meta tensors, memoised for functional ops."""
        found = _FUNCTIONAL.get(op_key(func))
        functional = found[1] if found is not None and found[0] is func else _functional(func)
        if not functional:
            if op_key(func) in _FILLS_ONLY_KEYS and _is_meta(args[0]):
                return args[0]  # a random fill of a meta tensor writes nothing, returns self
            if writes_in_place_only(func) and all(
                    _is_meta(t) for t in _tensor_args(args, kwargs)):
                return None  # e.g. an optimizer's foreach updates: nothing to write or count
            written = out_argument(func)
            if written is not None:
                return self._run_out(func, args, kwargs, *written)
            if writes_self_only(func):
                return self._run_self(func, args, kwargs)
            return func(*args, **kwargs)
        key = _key_of_call(func, args, kwargs)
        if key is _NO:
            return func(*args, **kwargs)
        tmpl = self._op_cache.get(key)
        if tmpl is None:
            out = func(*args, **kwargs)
            tmpl = _template(out)
            if tmpl is not _NO:
                # ops like _unsafe_view return an input's storage without saying so
                ins = {storage_key(a.untyped_storage()) for a in _tensor_args(args, kwargs)}
                if any(storage_key(o.untyped_storage()) in ins for o in _tensor_outputs(out)):
                    tmpl = _NO
            self._op_cache[key] = tmpl
            return out
        if tmpl is _NO:
            return func(*args, **kwargs)
        self.cache_hits += 1
        return _rebuild(tmpl)

    def _run_out(self, func: Any, args: Any, kwargs: dict[str, Any], name: str,
                 returns: bool) -> Any:
        """An ``out=`` variant over meta tensors (DDP's ``mul(grad, 1 / N, out=bucket
        view)``, FSDP2's copies into its all-gather and reduce-scatter buffers: Python meta
        kernels, a tenth of a DDP step's emulation): where the same op on the same
        metadata (``out``'s included) once left ``out`` unresized, it writes nothing over
        meta and allocates nothing, so it is not run again; ``out`` (or nothing) is
        returned as the kernel would. The version counter is bumped above this mode."""
        out = kwargs.get(name)
        outs = [out] if isinstance(out, torch.Tensor) else out
        if (not isinstance(outs, (list, tuple)) or not outs
                or not all(isinstance(t, torch.Tensor) and _is_meta(t) for t in outs)):
            return func(*args, **kwargs)
        return self._run_unchanged(func, args, kwargs, list(outs), out if returns else None)

    def _run_self(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """An in-place op on its first argument over meta tensors: where the same op on the
        same metadata once returned that argument with its layout as it was (no resize),
        it writes nothing over meta and allocates nothing, so it is not run again (its shape
        checks passed on those shapes); the argument is returned as the kernel would."""
        target = args[0] if args else None
        if not isinstance(target, torch.Tensor) or not all(
                _is_meta(t) for t in _tensor_args(args, kwargs)):
            return func(*args, **kwargs)
        return self._run_unchanged(func, args, kwargs, [target], target)

    def _run_unchanged(self, func: Any, args: Any, kwargs: dict[str, Any],
                       written: list[torch.Tensor], returned: Any) -> Any:
        """``func`` over meta tensors, run once per op and metadata where it returned
        ``returned`` and left the layouts of ``written`` (what it writes) as they were;
        afterwards ``returned`` without running it."""
        key = _key_of_call(func, args, kwargs)
        if key is _NO:
            return func(*args, **kwargs)
        tmpl = self._op_cache.get(key)
        if tmpl is _SAME_OUT:
            self.cache_hits += 1
            return returned
        before = [_layout(t) for t in written]
        result = func(*args, **kwargs)
        if tmpl is None:
            same = result is returned and before == [_layout(t) for t in written]
            self._op_cache[key] = _SAME_OUT if same else _NO
        return result


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.shape, t.stride(), t.storage_offset(), t.untyped_storage().nbytes())
