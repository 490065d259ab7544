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
    """``setattr``, or ``delattr`` for :data:`MISSING`."""
    if value is MISSING:
        with contextlib.suppress(AttributeError):
            delattr(owner, name)
    else:
        setattr(owner, name, value)


class Patcher:
    """Patches made through it are undone by :meth:`restore` (or on leaving its ``with``)."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def patch(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, own_attribute(owner, name)))
        setattr(owner, name, value)

    def originals(self) -> list[tuple[Any, str, Any]]:
        """(owner, name, what stood there before) of every patch, oldest first."""
        return list(self._saved)

    def restore(self) -> None:
        while self._saved:
            owner, name, value = self._saved.pop()
            put(owner, name, value)

    def __enter__(self) -> Patcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()
