"""The kernel's notice that nothing changed under the census' folders (Linux ``inotify``), so
the check after a run can skip its walk (:mod:`dpprof.script.census`).

The walk costs an ``lstat`` per entry (about 6 us; 30 ms for 5,000 files) after every run.
A :class:`TreeWatch` puts a watch on every folder the census noted, before the runs; the
kernel then queues an event, inside the very call that makes the change and whoever makes it
(Python, C, Rust, another process), for each file or folder in them created, removed,
renamed, written, truncated, closed after being opened for writing, or given other
attributes (mode, owner, times, links): everything the census' signature holds. After a run,
:meth:`TreeWatch.quiet` reads the queue: nothing there (and no overflow) means every entry is
as it was, and the walk would find what it found before.

The one write that raises no event is a store into a shared writable mapping of a file
(``mmap``) whose descriptor is still open: :meth:`quiet` is False while the process maps a
file under the folders that way (``/proc/self/maps``). Once any event was seen, or where
the kernel has no inotify or no watch can be placed (its limits), :meth:`quiet` is False for
good and every check walks, as without the watch. A census cut at its limit compares only the
entries it noted, each in a folder watched before it was read.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
import weakref
from collections.abc import Iterable
from typing import Any

__all__ = ["TreeWatch"]

# inotify(7)
_IN_MODIFY = 0x002
_IN_ATTRIB = 0x004
_IN_CLOSE_WRITE = 0x008
_IN_MOVED_FROM = 0x040
_IN_MOVED_TO = 0x080
_IN_CREATE = 0x100
_IN_DELETE = 0x200
_IN_DELETE_SELF = 0x400
_IN_MOVE_SELF = 0x800
_IN_Q_OVERFLOW = 0x4000
_IN_IGNORED = 0x8000
_IN_ONLYDIR = 0x01000000
_IN_DONT_FOLLOW = 0x02000000
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000
_MASK = (_IN_MODIFY | _IN_ATTRIB | _IN_CLOSE_WRITE | _IN_MOVED_FROM | _IN_MOVED_TO
         | _IN_CREATE | _IN_DELETE | _IN_DELETE_SELF | _IN_MOVE_SELF)
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)


class TreeWatch:
    """Watches on the census' folders, each placed (:meth:`add`) before the census reads it;
    ``roots``: the census' roots; events on a path in ``exclude`` (or under one) are none of
    the user's files."""

    def __init__(self, roots: Iterable[str], exclude: Iterable[str] = ()) -> None:
        self.roots = tuple(r.rstrip("/") or "/" for r in roots)
        self._exclude = {e.rstrip("/") for e in exclude}
        self._folders: dict[int, str] = {}  # watch descriptor -> its folder
        self._fd = -1
        self._changed = True  # no watch: every check walks
        calls = _inotify()
        if calls is None:
            return
        fd = calls[0](_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:  # the kernel's limit of instances
            return
        self._fd = fd
        weakref.finalize(self, os.close, fd)
        self._changed = False

    def add(self, folder: str) -> None:
        """Watch ``folder`` (before reading it: a change made after the read raises an
        event)."""
        calls = _inotify()
        if self._changed or calls is None:
            return
        wd = calls[1](self._fd, os.fsencode(folder), _MASK | _IN_ONLYDIR | _IN_DONT_FOLLOW)
        if wd < 0:  # the watch limit, or the folder gone meanwhile: every check walks
            self._changed = True
            return
        self._folders[wd] = folder

    def quiet(self, exclude: Iterable[str] = ()) -> bool:
        """Nothing under the folders changed since the watches were placed (``exclude``:
        more paths whose events are not the user's, as the census leaves them out)."""
        if self._changed:
            return False
        skip = self._exclude | {e.rstrip("/") for e in exclude}
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                break
            except OSError:
                self._changed = True
                return False
            at = 0
            while at + _EVENT.size <= len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, at)
                name = data[at + _EVENT.size:at + _EVENT.size + length].rstrip(b"\0")
                at += _EVENT.size + length
                if mask & _IN_IGNORED and not mask & ~_IN_IGNORED:
                    continue  # a watch went with its folder: the folder's own event came
                folder = self._folders.get(wd)
                if folder is None or mask & _IN_Q_OVERFLOW:
                    self._changed = True
                    continue
                path = os.path.join(folder, os.fsdecode(name)) if name else folder
                if not _under_any(path, skip):
                    self._changed = True
        if self._changed:
            return False
        return not self._mapped_for_writing()

    def _mapped_for_writing(self) -> bool:
        """A file under the roots is mapped shared and writable by this process (stores
        into it raise no event)."""
        try:
            with open("/proc/self/maps", "rb") as f:
                maps = f.read()
        except OSError:
            return True
        for line in maps.splitlines():
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[1][1:2] == b"w" and fields[1][3:4] == b"s":
                path = os.fsdecode(fields[5])
                if any(path == r or path.startswith(r + "/") or r == "/" for r in self.roots):
                    return True
        return False


_CALLS: list[tuple[Any, Any] | None] = []


def _inotify() -> tuple[Any, Any] | None:
    """libc's ``inotify_init1`` and ``inotify_add_watch``, or None (not Linux, no libc)."""
    if not _CALLS:
        calls = None
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                init, add = libc.inotify_init1, libc.inotify_add_watch
                init.argtypes = (ctypes.c_int,)
                add.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
                calls = (init, add)
            except (OSError, AttributeError):
                calls = None
        _CALLS.append(calls)
    return _CALLS[0]


def _under_any(path: str, prefixes: set[str]) -> bool:
    return any(path == p or path.startswith(p + "/") for p in prefixes)
