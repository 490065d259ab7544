"""Real values for the small tensors of virtual GPUs, so that fewer reads need a stand-in.

Over meta tensors a virtual GPU holds no values, and a value read back (``.item()``,
``bool()``, ``.tolist()``, ``.cpu()``) is a stand-in. Many of the values scripts and
libraries read are small and follow from host data alone: labels and masks moved to the GPU
(Hugging Face's ``attention_mask.all()`` picks its attention path on one), a step counter,
a scalar learning rate. :class:`SmallValues` follows them: a storage made on a virtual GPU
from values it knows (host tensors other than the model's parameters, or storages it
follows) by a deterministic op, with every output within ``max_tensor_bytes`` (integers and
booleans: ``max_index_bytes``), gets its values computed on the host beside the meta op;
reads of it give the real values. What the model computes from its parameters is not
followed: its values are the GPU's arithmetic, and computing them is ``--compute``'s work.

The rules that keep it honest:

* an op with a random stream (``nondeterministic_seeded``: dropout, ``randn``) is never
  computed: the host's generator is the script's own, and a GPU draws from another;
* an op that writes a storage it cannot compute (an input without values) drops that
  storage's values, so a value is never stale;
* a view reads its base storage's values with its own geometry (a view of another dtype has
  none); the memory the emulation counts is not changed by any of this;
* what is known may be part of a storage: an op that only moves elements (``cat``, ``copy_``
  into a slice, indexing by known positions) or computes each output element from the
  elements at its place (a pointwise op) carries the known elements through, each element
  known where everything it came from is. A read needs every element it reads known.
  SyncBatchNorm needs no more: it concatenates its statistics (the model's arithmetic) with
  its count (the batch's shape), all-gathers them, and indexes by the counts alone.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.nn.parameter import is_lazy
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from dpprof.emulator import same_program
from dpprof.emulator.flat_values import all_known, geometry_of, whole_storage
from dpprof.emulator.identity import storage_key
from dpprof.emulator.value_traits import (
    COLLECTIVES,
    MOVED,
    MOVES,
    REBINDS,
    SHAPE_ONLY,
    UNINITIALIZED,
    collective_values,
    tensors,
    traits,
)
from dpprof.errors import called_where_nothing_raises

MAX_TENSOR_BYTES = 64 * 1024  # a float tensor: a scalar, a schedule's rates; no activation
# an integer or boolean tensor: labels, lengths, a mask of a batch of audio (8 clips of 16,000
# samples: 1 MiB in int64, which Hugging Face's wav2vec2 reduces to its frames' lengths)
MAX_INDEX_BYTES = 4 * 2**20
MAX_TOTAL_BYTES = 64 * 2**20  # what the values may hold on the host at once


# the device the bytes are on (``Tensor.device`` answers the virtual GPU while emulating)
_REAL_DEVICE = torch._C.TensorBase.__dict__["device"]


# Tensor.is_meta as torch answers it (the emulation patches the property); no device made
_is_meta: Callable[[torch.Tensor], bool] = torch._C.TensorBase.__dict__["is_meta"].__get__
_aten = torch.ops.aten


class _Followed:
    """One storage's values: a weak reference to the meta storage, its values as one flat
    host tensor, and which elements are known (a flat bool tensor; None: all of them)."""

    __slots__ = ("known", "ref", "values")

    def __init__(self, ref: weakref.ref[Any], values: torch.Tensor,
                 known: torch.Tensor | None) -> None:
        self.ref = ref
        self.values = values
        self.known = known


class _Pieces(NamedTuple):
    """A storage not followed, pieces of it known: (element offset, flat values) each."""

    ref: weakref.ref[Any]
    pieces: list[tuple[int, torch.Tensor]]
    nbytes: int


class SmallValues:
    """Storage (meta bytes on a virtual GPU) -> its values on the host, for small ones."""

    def __init__(self, max_tensor_bytes: int = MAX_TENSOR_BYTES,
                 max_total_bytes: int = MAX_TOTAL_BYTES,
                 max_index_bytes: int = MAX_INDEX_BYTES) -> None:
        self.max_tensor_bytes = max_tensor_bytes
        self.max_index_bytes = max_index_bytes
        self.max_total_bytes = max_total_bytes
        self.total_bytes = 0
        # storage_key(meta storage) -> its values
        self._values: dict[int, _Followed] = {}
        # storage_key(meta storage too large to follow) -> the values of some of its pieces
        self._pieces: dict[int, _Pieces] = {}

    def _small(self, nbytes: int, dtype: torch.dtype) -> bool:
        """Whether a storage of ``nbytes`` holding ``dtype`` is small enough to follow."""
        floating = dtype.is_floating_point or dtype.is_complex
        return nbytes <= (self.max_tensor_bytes if floating else self.max_index_bytes)

    def _followed(self, t: torch.Tensor) -> _Followed | None:
        """The values of ``t``'s storage, where followed and of ``t``'s dtype."""
        st = t.untyped_storage()
        found = self._values.get(storage_key(st))
        if found is None or found.ref() is not st or found.values.dtype != t.dtype:
            return None
        return found

    def value_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t``'s values on the host, if followed and every element of it known (a view:
        with its own geometry)."""
        found = self._followed(t)
        if found is None:
            # a tensor of no elements has every value it holds known: none (NMS that kept
            # no box, compared with another)
            return (torch.empty(t.size(), dtype=t.dtype) if 0 in t.size() and not is_lazy(t)
                    else None)
        if found.known is not None and not bool(geometry_of(found.known, t).all()):
            return None
        return geometry_of(found.values, t)

    def follow(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               out: Any) -> None:
        """After the meta op ``func`` made ``out``: compute its values where the rules allow,
        else forget the values of what it wrote."""
        if isinstance(out, torch.Tensor) and not _is_meta(out):
            # an op of the host (a data loader's indexing: its values are real), or a copy
            # to it (read by the rule of copies): nothing on a virtual GPU made or written
            return
        if func in REBINDS:  # ``t.set_(storage)`` writes no byte of the storage it points
            return  # ``t`` at (torch's storage copy and deepcopy go through it)
        leaves = tensors(args, kwargs)
        metas_in = [a for a in leaves if _is_meta(a)]
        values = self._values
        if func is _aten.copy_.default and (self._copied_storage(args)
                                            or self._copied_whole(args)
                                            or self._copied_piece(args)):
            return
        writes, carries = traits(func)
        whole = True
        known_in = False  # an input followed, whole or in part
        for a in metas_in if func not in SHAPE_ONLY else ():
            # an input without values (an activation): nothing to compute (the common case;
            # a storage never followed is not among the values, the cheap test first)
            if storage_key(a.untyped_storage()) in values and self._followed(a) is not None:
                known_in = True
                if self.value_of(a) is not None:
                    continue
                whole = False
            elif 0 in a.size() and not is_lazy(a):  # (a LazyModule's: not made yet)
                continue  # no element: nothing unknown
            else:
                whole = False
                if carries is not MOVED:
                    # a pointwise op's every output element reads this input: none known
                    carries = None
                    break
            if carries is None:
                break
        if not whole:
            if known_in and carries and self._follow_partly(func, args, kwargs, out):
                return
            if known_in and func is _aten.cat.default:
                self._note_pieces(args, kwargs, out)
            if (values or self._pieces) and writes:
                self._forget_written(writes, args, kwargs)
            return
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and _is_meta(o)]
        if not outs and not metas_in:
            return
        small = all(self._small(o.untyped_storage().nbytes(), o.dtype) for o in outs) and all(
            _REAL_DEVICE.__get__(a).type in ("meta", "cpu") for a in leaves)
        result = (self.compute(func, args, kwargs)
                  if small and func not in UNINITIALIZED else None)
        if result is None:
            if func is _aten.cat.default and not small:  # every input known, too large
                self._note_pieces(args, kwargs, out)
            self._forget_written(writes, args, kwargs)
            return
        for m, r in zip(tree_leaves(out), tree_leaves(result), strict=False):
            if isinstance(m, torch.Tensor) and _is_meta(m) and isinstance(r, torch.Tensor):
                self.keep(m, r)

    def _follow_partly(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                       out: Any) -> bool:
        """After the meta op ``func`` over inputs of which some elements are known: the
        known elements of what it made or wrote (:meth:`compute_partly`). False where the
        rules do not apply (then what it wrote is forgotten)."""
        if getattr(func, "is_view", False):
            return True  # a view of a storage followed: its values are that storage's
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and _is_meta(o)]
        if not all(self._small(o.untyped_storage().nbytes(), o.dtype) for o in outs):
            return False
        parts = self.compute_partly(func, args, kwargs)
        if parts is None:
            return False
        for m, (r, known) in zip(outs, parts, strict=False):
            self.keep(m, r, known)
        return True

    def _copied_storage(self, args: tuple[Any, ...]) -> bool:
        """``dst.copy_(src)`` where each views every byte of its storage, as one dtype (a
        storage's ``copy_``: torch views both as bytes; ``copy.deepcopy`` of a CUDA tensor
        and ``UntypedStorage.clone`` copy so): ``dst``'s storage gets the values ``src``'s
        has, as whatever dtype they are followed. False where the rule does not apply."""
        dst, src = args[0], args[1]
        if not (isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor)
                and _is_meta(dst) and _is_meta(src) and dst.dtype == src.dtype):
            return False
        src_st, dst_st = src.untyped_storage(), dst.untyped_storage()
        found = self._values.get(storage_key(src_st))
        if found is None or found.ref() is not src_st or not (
                whole_storage(dst, dst_st) and whole_storage(src, src_st)
                and dst_st.nbytes() == src_st.nbytes()):
            return False
        self._drop(storage_key(dst_st))
        self.keep_flat(dst_st, found.values.clone(),
                       None if found.known is None else found.known.clone())
        return True

    def _note_pieces(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """``cat`` of 1-D tensors into one not followed (DDP's broadcast bucket, as torch's
        ``flatten_dense_tensors`` makes it): its inputs known whole kept as pieces of it, for
        a copy back out of it (:meth:`_copied_piece`); anything that writes it drops them."""
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        if not isinstance(out, torch.Tensor) or out.dim() != 1 or dim not in (0, -1):
            return
        pieces: list[tuple[int, torch.Tensor]] = []
        at, nbytes = int(out.storage_offset()), 0
        for t in args[0]:
            values = self.value_of(t) if _is_meta(t) else None
            if values is not None and t.numel():
                pieces.append((at, values.reshape(-1).to(out.dtype, copy=True)))
                nbytes += pieces[-1][1].untyped_storage().nbytes()
            at += int(t.numel())
        if not pieces or self.total_bytes + nbytes > self.max_total_bytes:
            return
        st = out.untyped_storage()
        key = storage_key(st)
        self._drop(key)
        self.total_bytes += nbytes
        self._pieces[key] = _Pieces(weakref.ref(st, self._dropper(key)), pieces, nbytes)

    def _copied_piece(self, args: tuple[Any, ...]) -> bool:
        """``dst.copy_(src)`` where ``src`` lies in a piece of a concatenation whose values
        are known (:meth:`_note_pieces`; DDP copies its broadcast bucket back into the
        module's tensors so): ``dst`` gets them. False where the rule does not apply."""
        if not self._pieces:
            return False
        dst, src = args[0], args[1]
        if not (isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor)
                and _is_meta(dst) and _is_meta(src)):
            return False
        st = src.untyped_storage()
        found = self._pieces.get(storage_key(st))
        if (found is None or found.ref() is not st or not src.is_contiguous()
                or src.dtype != dst.dtype or src.shape != dst.shape):
            return False
        start, count = src.storage_offset(), src.numel()
        for at, values in found.pieces:
            if at <= start and start + count <= at + values.numel():
                self.write(dst, values[start - at:start - at + count].view(src.shape))
                return True
        return False

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
        if found is not None and found.ref() is st:
            return False  # followed already: written in place by the general rules
        if (not dst.is_contiguous() or dst.storage_offset()
                or dst.numel() * dst.element_size() != st.nbytes()
                or not self._small(st.nbytes(), dst.dtype)):
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
        leaves = tensors(args, kwargs)
        shape_only = func in SHAPE_ONLY  # ``new_full``, ``zeros_like``: no value read
        unknown = not shape_only and any(isinstance(a, torch.nn.Parameter) or (_is_meta(a) and (
            self.value_of(a) is None)) for a in leaves)
        if unknown or torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            return None
        flat, spec = tree_flatten((args, kwargs))
        # a device, positional (``aten.to.device``) or keyword, is a virtual GPU or meta:
        # the host here
        real = [torch.device("cpu") if isinstance(a, torch.device)
                else a if not (isinstance(a, torch.Tensor) and _is_meta(a))
                else torch.zeros((), dtype=a.dtype).expand(a.shape) if shape_only
                else self.value_of(a) for a in flat]
        real_args, real_kwargs = tree_unflatten(real, spec)
        if real_kwargs.get("device") is not None:  # given as a string
            real_kwargs = {**real_kwargs, "device": torch.device("cpu")}
        if getattr(func, "namespace", "") in COLLECTIVES:
            # what other ranks contribute is not on this host: never the host's own run of
            # the collective (over the fake group its output holds no data)
            return collective_values(func, real_args)
        try:
            return func(*real_args, **real_kwargs)
        except Exception:  # a kernel the host lacks for this dtype: no values, as before
            return None

    def compute_partly(self, func: Any, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """``func`` over inputs of which some elements are known, where ``func`` carries
        known elements through (a pointwise op, or one that only moves elements; the
        positions it moves by, such as an index, known whole): each output's values and
        which of them are known, an element known where everything it came from is. What
        ``func`` writes is written in the values followed (a storage not followed yet gets
        values, none of them known before). None where the rules do not apply."""
        tags = getattr(func, "tags", ())
        pointwise = torch.Tag.pointwise in tags
        positions = MOVES.get(func)
        if (not pointwise and positions is None) or torch.Tag.nondeterministic_seeded in tags:
            return None
        schema = func._schema
        names = [a.name for a in schema.arguments]
        written = {a.name for a in schema.arguments
                   if a.alias_info is not None and a.alias_info.is_write}
        leaves = tensors(args, kwargs)
        if any(isinstance(a, torch.nn.Parameter) for a in leaves) or not all(
                _REAL_DEVICE.__get__(a).type in ("meta", "cpu") for a in leaves):
            return None
        if any(_is_meta(a) and not self._small(a.numel() * a.element_size(), a.dtype)
               for a in leaves):
            return None
        pairs = [*zip(names, args, strict=False), *kwargs.items()]
        targets = [a for n, a in pairs if n in written]
        if not all(isinstance(t, torch.Tensor) and _is_meta(t) for t in targets):
            return None  # a host tensor or a list written: not these rules
        real: dict[str, Any] = {}
        masks: dict[str, Any] = {}
        for name, a in pairs:
            pair = self._part_of(a, name in written, name in (positions or ()))
            if pair is None:
                return None
            real[name], masks[name] = pair
        at = len(args)
        try:
            result = func(*[real[n] for n in names[:at]],
                          **{n: real[n] for n in names[at:] if n in real})
            outs = [r for r in tree_leaves(result) if isinstance(r, torch.Tensor)]
            if pointwise:
                read = [masks[n] for n in masks if n not in written or n == "self"]
                known = all_known(read, [r.shape for r in outs])
                for n in written:
                    masks[n].copy_(known[0])
            else:
                mask_out = func(*[masks[n] for n in names[:at]],
                                **{n: masks[n] for n in names[at:] if n in masks})
                known = [k != 0 for k in tree_leaves(mask_out) if isinstance(k, torch.Tensor)]
        except Exception:  # a kernel the host lacks, or shapes that do not broadcast
            return None
        finally:
            for t in targets:
                self._settle(t)
        return list(zip(outs, known, strict=True))

    def _part_of(self, a: Any, written: bool, position: bool) -> tuple[Any, Any] | None:
        """An argument's values and which of them are known, for :meth:`compute_partly`:
        a tensor followed gives its own (written: views of the values followed, a storage not
        followed yet given values), one not followed zeros and none known, a host tensor
        its values, all known; a position (an index) must be known whole and is its own
        mask. None where it cannot be had."""
        if isinstance(a, (list, tuple)):
            pairs = [self._part_of(b, written, position) for b in a]
            if any(p is None for p in pairs):
                return None
            return type(a)(p[0] for p in pairs), type(a)(p[1] for p in pairs)  # type: ignore[index]
        if isinstance(a, torch.device):
            return torch.device("cpu"), torch.device("cpu")
        if not isinstance(a, torch.Tensor):
            return a, a
        if not _is_meta(a):
            return a, (a if position else torch.ones(a.shape, dtype=torch.bool))
        if position:
            value = self.value_of(a)
            return None if value is None else (value, value)
        found = self._followed(a) if not written else self._for_writing(a)
        if found is None:
            if written:
                return None
            return torch.zeros(a.shape, dtype=a.dtype), torch.zeros(a.shape, dtype=torch.bool)
        if found.known is None:
            if not written:
                return geometry_of(found.values, a), torch.ones(a.shape, dtype=torch.bool)
            self._set_known(found, torch.ones(found.values.shape, dtype=torch.bool))
        assert found.known is not None
        return geometry_of(found.values, a), geometry_of(found.known, a)

    def _for_writing(self, t: torch.Tensor) -> _Followed | None:
        """The values of ``t``'s storage, to be written in part: a storage not followed yet
        (small enough) gets values, none of them known yet."""
        found = self._followed(t)
        if found is not None:
            return found
        st = t.untyped_storage()
        if storage_key(st) in self._values:
            return None  # followed as another dtype (a view of its bytes): not these rules
        count = st.nbytes() // max(t.element_size(), 1)
        if not self._small(st.nbytes(), t.dtype) or st.nbytes() != count * t.element_size():
            return None
        self.keep_flat(st, torch.zeros(count, dtype=t.dtype), torch.zeros(count, dtype=torch.bool))
        return self._followed(t)

    def _settle(self, t: Any) -> None:
        """After a write in part: a storage with every element known needs no mask, one with
        none known is not followed."""
        if not isinstance(t, torch.Tensor) or (found := self._followed(t)) is None:
            return
        if found.known is None:
            return
        if bool(found.known.all()):
            self._set_known(found, None)
        elif not bool(found.known.any()):
            self._drop(storage_key(t.untyped_storage()))

    def known_part(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``t``'s values on the host and which of them are known (both with ``t``'s
        geometry), where its storage is followed; None where it is not."""
        found = self._followed(t)
        if found is None:
            return None
        known = (torch.ones(t.shape, dtype=torch.bool) if found.known is None
                 else geometry_of(found.known, t))
        return geometry_of(found.values, t), known

    def reduce_followed(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], kind: int,
                        size: int) -> None:
        """After a reduction across ranks (:func:`dpprof.emulator.same_program.
        contributions`): each target's values the reduction of its contribution's, known
        where the contribution's are (an element is reduced alone)."""
        # every contribution read before any target is written (an all-reduce in place)
        found = [(t, self.known_part(c)) for t, c in pairs]
        for t, part in found:
            if part is None:
                self.write(t, None)
            else:
                self.write(t, same_program.reduced(part[0], kind, size), part[1].clone())

    def write(self, t: torch.Tensor, values: torch.Tensor | None,
              known: torch.Tensor | None = None) -> None:
        """``t``'s elements now hold ``values`` (host values of ``t``'s shape; ``known``:
        which of them are known, None: all), written by something other than an op followed
        (a collective); ``values`` None: none known, so ``t``'s storage is followed no
        longer."""
        found = self._for_writing(t) if values is not None else None
        if found is None:
            self._drop(storage_key(t.untyped_storage()))
            return
        assert values is not None
        if found.known is None and known is not None and not bool(known.all()):
            self._set_known(found, torch.ones(found.values.shape, dtype=torch.bool))
        geometry_of(found.values, t).copy_(values)
        if found.known is not None:
            if known is None:
                geometry_of(found.known, t).fill_(True)
            else:
                geometry_of(found.known, t).copy_(known)
            self._settle(t)

    def keep_made(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                  out: torch.Tensor) -> bool:
        """``out``, made on a virtual GPU by a factory whose values follow from its numbers
        alone (``arange``: an index into a mask), followed with them where small enough;
        whether it is."""
        if not self._small(out.untyped_storage().nbytes(), out.dtype):
            return False
        with _disable_current_modes():
            real = func(*args, **{**kwargs, "device": torch.device("cpu")})
        self.keep(out, real)
        return self._followed(out) is not None

    def keep(self, m: torch.Tensor, r: torch.Tensor, known: torch.Tensor | None = None) -> None:
        """``r`` (a host tensor of ``m``'s geometry) holds the values of ``m``'s storage,
        ``known`` (of ``r``'s shape; None: all) which of them are known."""
        st = m.untyped_storage()
        found = self._values.get(storage_key(st))
        if found is not None and found.ref() is st:
            return  # written in place, or a view of a storage followed already
        if r.dtype != m.dtype or r.shape != m.shape:
            return
        if known is not None:
            if not bool(known.any()):
                return
            if bool(known.all()):
                known = None
        nbytes = r.untyped_storage().nbytes()
        if (nbytes != st.nbytes() or r.stride() != m.stride()
                or r.storage_offset() != m.storage_offset()):
            # the host's kernel laid its result out otherwise (``ones_like`` of a view
            # with one element: stride 2 on the host, 1 on meta): placed as meta has it
            self._keep_placed(m, st, r, known)
            return
        flat = torch.empty(0, dtype=r.dtype).set_(
            r.untyped_storage(), 0, (nbytes // max(r.element_size(), 1),), (1,))
        known_flat = None
        if known is not None:
            known_flat = torch.zeros(flat.shape, dtype=torch.bool)
            known_flat.as_strided(r.shape, r.stride(), r.storage_offset()).copy_(known)
        self.keep_flat(st, flat, known_flat)

    def _keep_placed(self, m: torch.Tensor, st: Any, r: torch.Tensor,
                     known: torch.Tensor | None) -> None:
        """``r``'s values (``known``: which of them) written where ``m`` views its storage
        ``st`` (not followed yet); what ``m`` does not view is not known."""
        try:
            self.write(m, r, known)
        except RuntimeError:  # a view that overlaps itself: several values for one element
            self._drop(storage_key(st))

    def keep_flat(self, st: Any, flat: torch.Tensor, known: torch.Tensor | None) -> None:
        """Follow the meta storage ``st`` with ``flat`` (its values, one flat host tensor)
        and ``known``, within the bytes the values may hold."""
        key = storage_key(st)
        if key in self._pieces:  # its pieces' values: now the whole storage's, or none
            self._drop(key)
        nbytes = flat.untyped_storage().nbytes() + (0 if known is None else known.numel())
        if self.total_bytes + nbytes > self.max_total_bytes:
            return
        self.total_bytes += nbytes
        self._values[key] = _Followed(weakref.ref(st, self._dropper(key)), flat, known)

    def _set_known(self, found: _Followed, known: torch.Tensor | None) -> None:
        before = 0 if found.known is None else found.known.numel()
        found.known = known
        self.total_bytes += (0 if known is None else known.numel()) - before

    def _drop(self, key: int) -> None:
        found = self._values.pop(key, None)
        if found is not None:
            self.total_bytes -= found.values.untyped_storage().nbytes() + (
                0 if found.known is None else found.known.numel())
        pieces = self._pieces.pop(key, None)
        if pieces is not None:
            self.total_bytes -= pieces.nbytes

    def _dropper(self, key: int) -> Any:
        @called_where_nothing_raises
        def drop(_ref: Any) -> None:
            self._drop(key)

        return drop

    def _forget_written(self, writes: tuple[tuple[int, str], ...], args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> None:
        """The op wrote storages it could not compute (its arguments ``writes``, from
        :func:`traits`): their values are gone. What it only read keeps its values (the
        mask of ``x[mask] = v``, which its backward indexes by)."""
        for i, name in writes:
            for t in tree_leaves(args[i] if i < len(args) else kwargs.get(name)):
                if isinstance(t, torch.Tensor) and _is_meta(t):
                    self._drop(storage_key(t.untyped_storage()))
