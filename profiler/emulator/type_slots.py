"""A class's sequence slots, kept as they were across a patch of its ``__getitem__`` or
``__setitem__``.

Assigning ``__getitem__`` to a Python class fills CPython's ``sq_item`` slot as well as
``mp_subscript`` (one name, two slots: ``typeobject.c``'s slotdefs). ``torch.Tensor`` indexes
through ``TensorBase``'s mapping slot alone; given a ``__getitem__`` of its own it becomes a
sequence to C code (``PySequence_Check``), and torch's ``compute_sizes`` then asks a 0-d
tensor its length: ``torch.tensor([loss_a, loss_b])`` raised "len() of a 0-d tensor" (the
Hugging Face datasets column simpletransformers turns into labels). Deleting the attribute
again leaves the slot filled, for the rest of the process. So the two sequence slots are
read before such a patch and written back after it, and after its restore: indexing
(``x[...]``, the mapping slot) goes through the patch, and nothing else changes.

The slots are read and written where they are on CPython's 64-bit builds (``PyTypeObject``,
``PySequenceMethods``), for a heap type whose layout checks out (its basic and item sizes
where they should be); anywhere else nothing is kept, and the patch behaves as before.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

__all__ = ["SEQUENCE_DUNDERS", "assigned_keeping_sequence_slots"]

# the names whose assignment fills a sequence slot besides the mapping one
SEQUENCE_DUNDERS = frozenset({"__getitem__", "__setitem__"})

_WORD = 8
_TP_NAME, _TP_BASICSIZE, _TP_ITEMSIZE = 3 * _WORD, 4 * _WORD, 5 * _WORD
_TP_AS_SEQUENCE = 13 * _WORD
_SQ_ITEM, _SQ_ASS_ITEM = 3 * _WORD, 5 * _WORD  # in PySequenceMethods
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE


def _sequence_methods(cls: type) -> int | None:
    """The address of ``cls``'s ``PySequenceMethods``, where its layout is known."""
    if (sys.implementation.name != "cpython" or ctypes.sizeof(ctypes.c_void_p) != _WORD
            or hasattr(sys, "gettotalrefcount") or not cls.__flags__ & _HEAPTYPE):
        return None
    at = id(cls)
    size = ctypes.c_ssize_t
    name = ctypes.c_char_p.from_address(at + _TP_NAME).value or b""
    if (size.from_address(at + _TP_BASICSIZE).value != cls.__basicsize__
            or size.from_address(at + _TP_ITEMSIZE).value != cls.__itemsize__
            or name.decode(errors="replace").rpartition(".")[2] != cls.__name__):
        return None
    return ctypes.c_void_p.from_address(at + _TP_AS_SEQUENCE).value


def assigned_keeping_sequence_slots(cls: type, assign: Callable[[], None]) -> None:
    """``assign()`` (a patch or its restore of ``cls.__getitem__`` / ``__setitem__``), with
    ``cls``'s sequence slots as they stood before it."""
    methods = _sequence_methods(cls)
    if methods is None:
        assign()
        return
    item = ctypes.c_void_p.from_address(methods + _SQ_ITEM)
    ass_item = ctypes.c_void_p.from_address(methods + _SQ_ASS_ITEM)
    kept = (item.value, ass_item.value)
    try:
        assign()
    finally:
        item.value, ass_item.value = kept
        ctypes.pythonapi.PyType_Modified(ctypes.py_object(cls))
