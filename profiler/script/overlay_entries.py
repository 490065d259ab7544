"""What :func:`os.scandir` gives for a folder of a run's view
(:class:`~dpprof.script.overlay.Overlay`): a real ``os.DirEntry`` cannot be made for a folder
that exists in two places (the real one and the overlay's), so these stand for them, each
answering from the view."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import os

    from dpprof.script.overlay import Overlay

__all__ = ["OverlayEntry", "OverlayScandir"]


class OverlayEntry:
    """One entry of a folder of the view, as :func:`os.scandir` gives it (a real
    ``os.DirEntry`` cannot be made for a folder that exists in two places)."""

    __slots__ = ("_c", "_overlay", "name", "path")

    def __init__(self, name: Any, path: Any, c: str, overlay: Overlay) -> None:
        self.name = name
        self.path = path
        self._c = c
        self._overlay = overlay

    def __fspath__(self) -> Any:
        return self.path

    def __repr__(self) -> str:
        return f"<DirEntry {self.name!r}>"

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        return self._overlay.stat(self._c, follow_symlinks, self.path)

    def inode(self) -> int:
        return self.stat(follow_symlinks=False).st_ino

    def is_symlink(self) -> bool:
        try:
            return stat.S_ISLNK(self.stat(follow_symlinks=False).st_mode)
        except OSError:
            return False

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        try:
            return stat.S_ISDIR(self.stat(follow_symlinks=follow_symlinks).st_mode)
        except OSError:
            return False

    def is_file(self, *, follow_symlinks: bool = True) -> bool:
        try:
            return stat.S_ISREG(self.stat(follow_symlinks=follow_symlinks).st_mode)
        except OSError:
            return False

    def is_junction(self) -> bool:
        return False


class OverlayScandir:
    """What :func:`os.scandir` returns for a folder of the view: an iterator of
    :class:`OverlayEntry`, usable as a context manager."""

    def __init__(self, entries: list[OverlayEntry]) -> None:
        self._it = iter(entries)

    def __iter__(self) -> Iterator[OverlayEntry]:
        return self

    def __next__(self) -> OverlayEntry:
        return next(self._it)

    def close(self) -> None:
        self._it = iter(())

    def __enter__(self) -> OverlayScandir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

