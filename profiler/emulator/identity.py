"""Keys by identity for what the emulator looks up on every op (an op's facts, a storage's
record), taken without ``id()``.

``id()`` raises the audit event ``builtins.id``. Where an audit hook is installed (the seal's
second line, where the kernel gives a run no mount namespace: :mod:`dpprof.script.seal`; or
a hook of the user's), every call is a call into that hook, about ten times the look-up
itself, and Python never removes a hook. A short meta run asks about 90,000 times.

* :func:`storage_key`: ``hash(st)``. An ``UntypedStorage`` hashes as ``object`` does, by its
  address with the bits rotated (CPython's ``_Py_HashPointer``, a bijection): distinct live
  storages have distinct keys, as with ``id``, and ``hash`` is no audit event. Where a torch
  gives storages a hash of their own, ``id``.
* :func:`op_key`: a serial kept on the op itself (an ``OpOverload``'s own ``__hash__`` is
  Python, a call per look-up; ops live as long as the process); ``id`` for an op that takes
  no attribute. Serials are small, ids are addresses: the two never meet.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["op_key", "storage_key"]

storage_key: Callable[[Any], int] = (
    hash if torch.UntypedStorage.__hash__ is object.__hash__ else id)

_OP_KEY = "_dpprof_op_key"
_serials = itertools.count(1)


def op_key(func: Any) -> int:
    """A key of ``func``'s identity, the same for the life of the process."""
    key = getattr(func, _OP_KEY, None)
    if type(key) is int:
        return key
    key = next(_serials)
    try:
        setattr(func, _OP_KEY, key)
    except (AttributeError, TypeError):
        return id(func)
    return key
