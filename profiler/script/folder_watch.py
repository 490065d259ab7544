"""The kernel's own record of what changed in some folders (Linux's inotify): every entry
created, written, truncated, given new metadata, removed or renamed in a watched folder, by
any writer of the machine (Python, C, a subprocess), named as it happens.

The check after each run (:mod:`dpprof.script.census`) reads it instead of walking and
stat'ing every file of the user's folders again (thousands of system calls a run): only the
paths named here can differ from the snapshot. Each file is watched by its inode as well as
through its folder: a folder's watch names what is done through its own entries, and a
hard link made from a folder nobody watches (``link()`` tells the file's inode, not the
folder) would write the user's file unseen; the inode's own watch names it whichever path
wrote it. A write through ``mmap`` alone is the one change
inotify does not name until the file is closed; the file's own modification time tells it
then, as it tells the walk.

Where it cannot vouch for a complete record (not Linux, the kernel's limit of watches
reached, its queue overflowed), :attr:`FolderWatch.complete` is False and the check walks.
"""

from __future__ import annotations

import _thread
import contextlib
import ctypes
import ctypes.util
import errno
import os
import struct
import sys
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["FolderWatch", "WatchMarks"]

_IN_MODIFY = 0x2
_IN_ATTRIB = 0x4
_IN_CLOSE_WRITE = 0x8
_IN_MOVED_FROM = 0x40
_IN_MOVED_TO = 0x80
_IN_CREATE = 0x100
_IN_DELETE = 0x200
_IN_DELETE_SELF = 0x400
_IN_MOVE_SELF = 0x800
_IN_Q_OVERFLOW = 0x4000
_IN_ONLYDIR = 0x01000000
_IN_DONT_FOLLOW = 0x02000000
# every change of an entry of the folder or of the folder itself; no reads
_MASK = (_IN_MODIFY | _IN_ATTRIB | _IN_CLOSE_WRITE | _IN_MOVED_FROM | _IN_MOVED_TO
         | _IN_CREATE | _IN_DELETE | _IN_DELETE_SELF | _IN_MOVE_SELF
         | _IN_ONLYDIR | _IN_DONT_FOLLOW)
# every change of a file's inode, through whichever of its links (its link count included)
_FILE_MASK = (_IN_MODIFY | _IN_ATTRIB | _IN_CLOSE_WRITE | _IN_DELETE_SELF | _IN_MOVE_SELF
              | _IN_DONT_FOLLOW)
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (the name follows, NUL padded)

_LIBC: list[ctypes.CDLL] = []
# inotify_add_watch bound so that the call keeps the GIL (ctypes.PyDLL): a census watches
# thousands of files, and in the thread that takes it beside torch's import
# (:mod:`dpprof.script.census_ahead`) each release of the GIL is a wait for it to come back;
# the call itself takes microseconds (a path looked up, a mark made)
_ADD_HELD: list[Callable[[int, bytes, int], int]] = []


def _libc() -> ctypes.CDLL | None:
    if not _LIBC:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            libc.inotify_init1.argtypes = [ctypes.c_int]
            libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
            held = ctypes.PyDLL(ctypes.util.find_library("c") or None,
                                use_errno=True).inotify_add_watch
            held.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        except (OSError, AttributeError):
            return None
        _LIBC.append(libc)
        _ADD_HELD.append(held)
    return _LIBC[0]


@dataclass
class WatchMarks:
    """The watches of a :class:`FolderWatch` by descriptor, as one process hands them to
    another that shares the instance (:meth:`FolderWatch.marks`)."""

    complete: bool
    folder_of: dict[int, str]
    path_of: dict[int, str]
    more_paths_of: dict[int, set[str]]


class FolderWatch:
    """A watch over the folders handed to :meth:`add` from then on (see the module);
    :meth:`changed` names every path that changed since, and :attr:`complete` says whether
    that record is whole."""

    def __init__(self) -> None:
        self.complete = False
        self._fd = -1
        self._folder_of: dict[int, str] = {}  # watch descriptor -> its folder
        # watch descriptor -> the path of a watched file, and its other paths where it has
        # more than one (two hard links: one inode, one wd)
        self._path_of: dict[int, str] = {}
        self._more_paths_of: dict[int, set[str]] = {}
        self._changed: set[str] = set()
        # watched folders removed or moved away since (a folder made again at the path may
        # have the same inode number: it is another folder, which no watch covers)
        self.gone: set[str] = set()
        self._closing: weakref.finalize | None = None  # the instance's close, once opened
        self._libc = _libc() if os.name == "posix" else None
        if self._libc is None:
            return
        fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            return
        self._fd = fd
        self._closing = weakref.finalize(self, _close, fd)
        self.complete = True

    def close(self) -> None:
        """The inotify instance let go now, not when the watch is collected (each holds one
        of the user's ``fs.inotify.max_user_instances``, 128 by default, and a process that
        runs many scripts, as a test worker does, ran out); what it recorded is read first
        and stays, and nothing is recorded after."""
        if self._closing is None or not self._closing.alive:
            return
        self.changed()
        self._closing()
        self.complete = False  # no longer recording: a later change would go unseen

    def add(self, folder: str) -> None:
        """``folder`` watched from now on (before what it holds is noted: nothing that
        changes after the note goes unseen)."""
        if not self.complete or self._libc is None:
            return
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(folder), _MASK)
        if wd < 0:  # the limit of watches (fs.inotify.max_user_watches), or gone
            self.complete = False
            return
        self._folder_of[wd] = folder

    def add_file(self, path: str) -> None:
        """The file at ``path`` watched by its inode from now on (before it is noted)."""
        if not self.complete or self._libc is None:
            return
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(path), _FILE_MASK)
        if wd < 0:  # the limit of watches, or gone (then its folder's watch names it)
            if ctypes.get_errno() != errno.ENOENT:
                self.complete = False
            return
        self._note_file(wd, path)

    def _note_file(self, wd: int, path: str) -> None:
        known = self._path_of.setdefault(wd, path)
        if known != path:
            self._more_paths_of.setdefault(wd, set()).add(path)

    def add_files(self, paths: Iterable[str]) -> None:
        """:meth:`add_file` of each of ``paths``, in one call (a census watches thousands:
        the calls' own cost counts; each keeps the GIL)."""
        if not self.complete or self._libc is None:
            return
        add_watch, fd, path_of = _ADD_HELD[0], self._fd, self._path_of
        encoding, errors = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()
        for path in paths:
            wd = add_watch(fd, path.encode(encoding, errors), _FILE_MASK)  # os.fsencode's
            if wd < 0:
                if ctypes.get_errno() != errno.ENOENT:
                    self.complete = False
                    return
                continue
            if path_of.setdefault(wd, path) != path:
                self._note_file(wd, path)

    def marks(self) -> WatchMarks:
        """What the watches added so far are (each watch descriptor's path), for a process
        that shares this instance of the kernel's record (a child that took a census into
        it: :mod:`dpprof.script.census_ahead`) to hand back: :meth:`adopt`."""
        return WatchMarks(self.complete, dict(self._folder_of), dict(self._path_of),
                          {wd: set(paths) for wd, paths in self._more_paths_of.items()})

    def adopt(self, marks: WatchMarks) -> None:
        """The watches another process added to this same instance (its :meth:`marks`),
        taken as this watch's own."""
        self.complete = self.complete and marks.complete
        self._folder_of.update(marks.folder_of)
        self._path_of.update(marks.path_of)
        for wd, paths in marks.more_paths_of.items():
            self._more_paths_of.setdefault(wd, set()).update(paths)

    def changed(self) -> set[str]:
        """Every path (in a watched folder, or a watched folder itself) that changed since
        the watch began: the events read so far and any queued now."""
        if self.complete:
            self._read()
        return self._changed

    def take_changed(self) -> tuple[set[str], set[str]]:
        """:meth:`changed` and :attr:`gone`, and the record begun anew: what changes from
        now on."""
        changed, gone = self.changed(), self.gone
        self._changed, self.gone = set(), set()
        return changed, gone

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return
            except OSError:
                self.complete = False
                return
            if not data:
                return
            offset = 0
            while offset < len(data):
                wd, mask, _cookie, size = _EVENT.unpack_from(data, offset)
                offset += _EVENT.size
                name = data[offset:offset + size].rstrip(b"\0")
                offset += size
                if mask & _IN_Q_OVERFLOW:  # events were lost: the record is not whole
                    self.complete = False
                    return
                path = self._path_of.get(wd)
                if path is not None:  # a file's own watch: it names no entry
                    self._changed.add(path)
                    self._changed.update(self._more_paths_of.get(wd, ()))
                    continue
                folder = self._folder_of.get(wd)
                if folder is None:
                    continue
                if mask & (_IN_DELETE_SELF | _IN_MOVE_SELF):
                    self.gone.add(folder)
                self._changed.add(os.path.join(folder, os.fsdecode(name)) if name
                                  else folder)


def _close(fd: int) -> None:
    """The inotify instance closed in a thread of its own: the kernel frees its marks after
    a grace period that the close waits for (tens of milliseconds for thousands of watched
    files on a loaded machine), and nothing waits on that (the record is no longer read)."""
    def close() -> None:
        with contextlib.suppress(OSError):
            os.close(fd)

    try:  # a bare thread: Thread.start would wait until it runs
        _thread.start_new_thread(close, ())
    except RuntimeError:  # no new threads (the interpreter is ending): closed here
        close()
