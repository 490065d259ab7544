"""One way to patch torch and the standard library: record, then undo in reverse.

A patch replaces an attribute of a module, class or object. The :class:`Patcher` records
what stood there before, or that nothing did (a class attribute inherited from a base is
not the class's own: restoring deletes the class's copy, the base's shows again), and
:meth:`Patcher.restore` puts everything back in the reverse order, also when the code run
under the patches raised.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from dpprof.emulator.type_slots import SEQUENCE_DUNDERS, assigned_keeping_sequence_slots

# what a group of patches is given: Patcher.patch (owner, name, value)
Patch = Callable[[Any, str, Any], None]


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING: Any = _Missing()


def own_attribute(owner: Any, name: str) -> Any:
    """What ``owner`` holds under ``name`` itself (a class: its own ``__dict__``, not a
    base's), or :data:`MISSING`."""
    if isinstance(owner, type):
        return owner.__dict__.get(name, MISSING)
    return getattr(owner, name, MISSING)


def put(owner: Any, name: str, value: Any) -> None:
    """``setattr``, or ``delattr`` for :data:`MISSING`; a class's sequence slots kept where
    the name fills one (:mod:`dpprof.emulator.type_slots`)."""
    def assign() -> None:
        if value is MISSING:
            with contextlib.suppress(AttributeError):
                delattr(owner, name)
        else:
            setattr(owner, name, value)

    if isinstance(owner, type) and name in SEQUENCE_DUNDERS:
        assigned_keeping_sequence_slots(owner, assign)
    else:
        assign()


def builtin_op(value: Any) -> str | None:
    """The TorchScript builtin ``value`` stands for (``"aten::tensor"`` for ``torch.tensor``),
    or None. TorchScript compiles a call by looking the function up in this table, by
    identity: a replacement of ``torch.tensor`` it does not find there it tries to compile
    as Python, and fails (``torch.distributed.optim`` scripts its functional optimizers at
    import, and their bodies call ``torch.tensor``)."""
    import torch.jit._builtins as builtins

    return builtins._find_builtin(value)  # type: ignore[no-any-return]


class Patcher:
    """Patches made through it are undone by :meth:`restore` (or on leaving its ``with``). A
    replacement of one of TorchScript's builtins stands for the same builtin while patched
    (:func:`builtin_op`), so that code scripted meanwhile calls it as the original."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []
        self._builtins: list[Any] = []  # replacements registered as TorchScript builtins

    def patch(self, owner: Any, name: str, value: Any) -> None:
        old = own_attribute(owner, name)
        self._saved.append((owner, name, old))
        op = builtin_op(old) if old is not MISSING else None
        if op is not None and builtin_op(value) is None:
            import torch.jit._builtins as builtins

            builtins._register_builtin(value, op)
            self._builtins.append(value)
        put(owner, name, value)

    def originals(self) -> list[tuple[Any, str, Any]]:
        """(owner, name, what stood there before) of every patch, oldest first."""
        return list(self._saved)

    def restore(self) -> None:
        while self._saved:
            owner, name, value = self._saved.pop()
            put(owner, name, value)
        if self._builtins:
            import torch.jit._builtins as builtins

            table = builtins._get_builtin_table()
            while self._builtins:
                table.pop(id(self._builtins.pop()), None)

    def __enter__(self) -> Patcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()
