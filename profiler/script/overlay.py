"""The private overlay one run of the script writes into: a copy-on-write view of the
filesystem, by path (the main line of the seal, :mod:`dpprof.script.seal`).

Every path is first made canonical (:meth:`Overlay.canonical`: absolute, its folders'
symbolic links resolved as the view has them); what the run wrote lives under
:attr:`Overlay.root` at the same path (``root + "/home/u/proj/ckpt.pt"``), and what it removed
is remembered (:attr:`Overlay.deleted`; a folder made again after its removal is *opaque*:
what the real one held does not show through). A path then reads from the overlay where the
run wrote it, is gone where the run removed it, and is the real file otherwise: reads of real
data stay real, a file written and read back is the run's own, and the real filesystem is
never changed. A real file is copied up (into the overlay) before anything changes it in
place (``"a"``, ``"r+"``, ``chmod``, a rename).

The operations take canonical paths and return the concrete path to hand to the real call,
or raise the error the real call would raise (named with the path as the script gave it).
Everything here calls the functions :mod:`os` and :mod:`io` had at import, never the
patched ones (the seal patches them while a run is under way).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import Any

from dpprof.script.overlay_changes import Change, changes_of
from dpprof.script.overlay_entries import OverlayEntry, OverlayScandir
from dpprof.script.real_fs import (
    REAL_CALLS,
    REAL_OPEN,
    copy_file,
    lexists,
    lstat_or_none,
    os_error,
    rmtree,
)

__all__ = ["GONE", "REAL", "UPPER", "Overlay"]

UPPER = "upper"  # the run wrote it: it lives in the overlay
REAL = "real"  # the real file (or nothing) shows through
GONE = "gone"  # the run removed it (or a folder above it)

_MAX_LINKS = 40  # symbolic links followed in one lookup, as Linux's ELOOP limit

# the real functions (:mod:`dpprof.script.real_fs`), bound here: called on every lookup
_lstat = REAL_CALLS["lstat"]
_mkdir = REAL_CALLS["mkdir"]
_replace = REAL_CALLS["replace"]
_symlink = REAL_CALLS["symlink"]
_link = REAL_CALLS["link"]
_readlink = REAL_CALLS["readlink"]
_listdir = REAL_CALLS["listdir"]
_chmod = REAL_CALLS["chmod"]
_getcwd = REAL_CALLS["getcwd"]

class Overlay:
    """The view of one run (see the module). ``root``: an empty private folder."""

    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)
        self.deleted: set[str] = set()  # real paths the run removed (with what they held)
        self.opaque: set[str] = set()  # folders made again after their removal
        self.dirty = False  # anything written or removed yet (until then reads pass through)
        # real files the run would have changed (written, removed, renamed) -> their stat
        # before: checked unchanged after the run (:mod:`dpprof.script.census`)
        self.touched_real: dict[str, os.stat_result] = {}
        self._dirs: dict[str, str] = {}  # a folder as named -> as resolved in the view
        # a path as :meth:`absolute` gives it -> :meth:`resolved` (made from ``_dirs``, and
        # forgotten with it); a path as given, absolute -> :meth:`absolute` of it (the same
        # for the whole run): a script names the same few paths at every step
        self._resolved: dict[str, str] = {}
        self._absolute: dict[str, str] = {}
        # counts the changes of the view that can change where a path leads (a link made or
        # removed, anything removed, renamed or hidden): what was found before holds while
        # it is the same
        self.generation = 0
        self._has_links = False  # the run made a symbolic link

    # ---- paths -------------------------------------------------------------------------

    def upper(self, c: str) -> str:
        return self.root + c

    def in_root(self, p: str) -> bool:
        return p == self.root or p.startswith(self.root + "/")

    def from_upper(self, p: str) -> str:
        """A path inside the overlay (a folder the script changed into that only the run
        made; a path handed back by ``os.getcwd``) stands for the path it overlays."""
        if self.in_root(p):
            return p[len(self.root):] or "/"
        return p

    def absolute(self, p: str) -> str:
        """``p`` made absolute against the working directory, normalised, out of the
        overlay (:meth:`from_upper`)."""
        if not p.startswith("/"):
            p = os.path.join(self.from_upper(_getcwd()), p)
        hit = self._absolute.get(p)
        if hit is None:
            if len(self._absolute) > 100_000:
                self._absolute.clear()
            hit = self._absolute[p] = self.from_upper(os.path.normpath(p))
        return hit

    def canonical(self, p: str) -> str:
        """``p`` absolute with its folders' symbolic links resolved in the view (the last
        component is left as it is: a call that follows it does so with :meth:`follow`)."""
        return self.resolved(self.absolute(p))

    def resolved(self, a: str) -> str:
        """:meth:`canonical` of ``a``, already as :meth:`absolute` gives it."""
        hit = self._resolved.get(a)
        if hit is not None:
            return hit
        if a == "/":
            return a
        head, name = os.path.split(a)
        hit = os.path.join(self._resolve_dir(head), name)
        if len(self._resolved) > 100_000:
            self._resolved.clear()
        self._resolved[a] = hit
        return hit

    def _resolve_dir(self, d: str) -> str:
        hit = self._dirs.get(d)
        if hit is not None:
            return hit
        todo = d.split("/")[::-1]
        out = "/"
        links = 0
        while todo:
            part = todo.pop()
            if part in ("", "."):
                continue
            if part == "..":
                out = os.path.dirname(out)
                continue
            nxt = os.path.join(out, part)
            target = self._link_target(nxt)
            if target is None:
                out = nxt
                continue
            links += 1
            if links > _MAX_LINKS:
                raise os_error(errno.ELOOP, d)
            if target.startswith("/"):
                out = "/"
            todo.extend(target.split("/")[::-1])
        if len(self._dirs) > 100_000:
            self._forget_resolved()
        self._dirs[d] = out
        return out

    def _forget_resolved(self) -> None:
        """The folders resolved so far resolved afresh from now on (a link made or
        removed, or what is removed or hidden changed)."""
        self._dirs.clear()
        self._resolved.clear()
        self.generation += 1

    def _link_target(self, c: str) -> str | None:
        """Where the symbolic link at ``c`` points in the view (None: not a link)."""
        if self._has_links:
            st = lstat_or_none(self.upper(c))
            if st is not None:
                return _readlink(self.upper(c)) if stat.S_ISLNK(st.st_mode) else None
        if (self.deleted or self.opaque) and self.where(c) != REAL:
            return None
        st = lstat_or_none(c)
        if st is not None and stat.S_ISLNK(st.st_mode):
            return _readlink(c)
        return None

    def follow(self, c: str) -> str:
        """``c`` with its last component's symbolic links followed in the view."""
        return self.followed(c)[0]

    def followed(self, c: str) -> tuple[str, str, os.stat_result | None]:
        """:meth:`follow` of ``c``, with :meth:`in_view` of where it leads: one look at
        each path on the way (a file of the run's, as a checkpoint written at every step
        is, in one system call)."""
        for _ in range(_MAX_LINKS):
            w, st = self.in_view(c)
            if st is None or not stat.S_ISLNK(st.st_mode):
                return c, w, st
            target = _readlink(self.upper(c) if w == UPPER else c)
            c = self.canonical(os.path.join(os.path.dirname(c), target))
        raise os_error(errno.ELOOP, c)

    # ---- where a path lives ------------------------------------------------------------

    def where(self, c: str) -> str:
        """:data:`UPPER`, :data:`GONE` or :data:`REAL` for the canonical path ``c``."""
        if self.dirty and lexists(self.upper(c)):
            return UPPER
        return GONE if self._real_hidden(c) else REAL

    def _real_hidden(self, c: str) -> bool:
        """Whether the real ``c`` is hidden from the view: it or a folder above it removed,
        or a folder above it made again after its removal."""
        if not (self.deleted or self.opaque):
            return False
        p = c
        while True:
            if p in self.deleted:
                return True
            parent = os.path.dirname(p)
            if parent in self.opaque:
                return True
            if parent == p:
                return False
            p = parent

    def _real_dir_shows(self, c: str) -> bool:
        """Whether a real folder at ``c`` shows through in the view (its files with the
        overlay's)."""
        if self._real_hidden(c) or c in self.opaque:
            return False
        st = lstat_or_none(c)
        return st is not None and stat.S_ISDIR(st.st_mode)

    def in_view(self, c: str) -> tuple[str, os.stat_result | None]:
        """:meth:`where` ``c`` is, and what it is there (not following a last symbolic
        link; None: nothing), in one look at the overlay."""
        if self.dirty:
            st = lstat_or_none(self.upper(c))
            if st is not None:
                return UPPER, st
        if self._real_hidden(c):
            return GONE, None
        return REAL, lstat_or_none(c)

    def lstat_in_view(self, c: str) -> os.stat_result | None:
        """What ``c`` is in the view (not following a last symbolic link), or None."""
        return self.in_view(c)[1]

    def stat(self, c: str, follow_symlinks: bool, shown: Any) -> os.stat_result:
        if follow_symlinks:
            c, _, st = self.followed(c)
        else:
            st = self.lstat_in_view(c)
        if st is None:
            raise self.missing(c, shown)
        return st

    def is_dir(self, c: str) -> bool:
        st = self.followed(c)[2]
        return st is not None and stat.S_ISDIR(st.st_mode)

    def missing(self, c: str, shown: Any, other: Any = None) -> OSError:
        """The error of a lookup of ``c``, which is not in the view: ENOTDIR where a folder
        above it is a file, else ENOENT."""
        p = "/"
        for part in c.strip("/").split("/")[:-1]:
            p = os.path.join(p, part)
            st = self.lstat_in_view(self.follow(p))
            if st is None:
                break
            if not stat.S_ISDIR(st.st_mode):
                return os_error(errno.ENOTDIR, shown, other)
        return os_error(errno.ENOENT, shown, other)

    def for_read(self, c: str, shown: Any, follow_symlinks: bool = True) -> str:
        """The concrete path that holds ``c`` for reading."""
        if follow_symlinks:
            c, w, st = self.followed(c)
        else:
            w, st = self.in_view(c)
        if st is None:
            raise self.missing(c, shown)
        return self.upper(c) if w == UPPER else c

    # ---- writing -----------------------------------------------------------------------

    def _parent_check(self, c: str, shown: Any, other: Any = None) -> None:
        """The folder of ``c`` exists in the view (else the error a real call gives, naming
        ``shown`` and ``other``)."""
        parent = os.path.dirname(c)
        st = self.lstat_in_view(parent)
        if st is None:
            raise self.missing(parent, shown, other)
        if not stat.S_ISDIR(st.st_mode):
            raise os_error(errno.ENOTDIR, shown, other)

    def _parent_ready(self, c: str, shown: Any) -> None:
        """The folder of ``c`` exists in the view and in the overlay (made there, empty,
        where only the real one exists)."""
        self._parent_check(c, shown)
        self._make_upper_dirs(os.path.dirname(c))

    def _make_upper_dirs(self, d: str) -> None:
        """The overlay's folders down to ``d`` (with the real ones' permissions)."""
        missing = []
        p = d
        while not lexists(self.upper(p)):
            missing.append(p)
            if p == "/":
                break
            p = os.path.dirname(p)
        for p in reversed(missing):
            st = lstat_or_none(p)
            mode = stat.S_IMODE(st.st_mode) if st is not None and stat.S_ISDIR(st.st_mode) \
                else 0o755
            with contextlib.suppress(FileExistsError):
                _mkdir(self.upper(p), mode | 0o700)

    def note_real(self, c: str) -> None:
        """``c`` is a real file the run would have changed: its state before, for the check
        after the run (:mod:`dpprof.script.census`)."""
        if c not in self.touched_real:
            st = lstat_or_none(c)
            if st is not None and not stat.S_ISDIR(st.st_mode):
                self.touched_real[c] = st

    def for_write(self, c: str, shown: Any, *, create: bool, truncate: bool,
                  exclusive: bool, follow_symlinks: bool = True) -> str:
        """The concrete path to open ``c`` for writing (in the overlay), after its real
        file is copied up where the write keeps what it held. A real file that is not a
        regular one (a FIFO, a device) is opened as it is."""
        if follow_symlinks and not exclusive:
            c, w, st = self.followed(c)
        else:
            w, st = self.in_view(c)
        if st is not None:
            if exclusive and create:
                raise os_error(errno.EEXIST, shown)
            if stat.S_ISDIR(st.st_mode):
                raise os_error(errno.EISDIR, shown)
            if w == REAL and not stat.S_ISREG(st.st_mode) and not stat.S_ISLNK(st.st_mode):
                return c  # a FIFO, a socket, a device: not a file of the user's to change
            if w == UPPER and stat.S_ISREG(st.st_mode):
                # the run's own file written again (a checkpoint at every step): its folder
                # is there, and nothing of the view changes
                return self.upper(c)
        elif not create:
            raise self.missing(c, shown)
        self._parent_ready(c, shown)
        self.dirty = True
        if w == REAL and st is not None:
            self.note_real(c)
            if truncate:  # emptied: the file is there for a call without O_CREAT
                with REAL_OPEN(self.upper(c), "wb"):
                    pass
                _chmod(self.upper(c), stat.S_IMODE(st.st_mode))
            else:
                copy_file(c, self.upper(c), st)
        self._replacing(c)
        return self.upper(c)

    def _replacing(self, c: str) -> None:
        """The overlay's own entry is made at ``c``: no longer removed, and where a real one
        that is not a plain file stood there (a folder, a link), what showed through it is
        hidden."""
        hidden = c in self.deleted or self._real_hidden(c)
        real = lstat_or_none(c)
        if hidden and real is not None and not stat.S_ISREG(real.st_mode):
            self.opaque.add(c)
        self.deleted.discard(c)
        # folders resolved through ``c`` resolve otherwise only where a link stood or
        # stands there, or what is removed or hidden changed; a file written over a file
        # (every checkpoint after the first) keeps them
        if hidden or self._has_links or (real is not None and stat.S_ISLNK(real.st_mode)):
            self._forget_resolved()

    def materialize(self, c: str, shown: Any, follow_symlinks: bool = True) -> str:
        """``c`` copied up (a file, a link, or an empty folder with the real one's
        permissions) for a change of its metadata; its concrete path."""
        if follow_symlinks:
            c = self.follow(c)
        w = self.where(c)
        if w == UPPER:
            return self.upper(c)
        st = lstat_or_none(c) if w == REAL else None
        if st is None:
            raise self.missing(c, shown)
        if stat.S_ISDIR(st.st_mode):
            self.dirty = True
            self._make_upper_dirs(c)
            return self.upper(c)
        if stat.S_ISLNK(st.st_mode):
            self._parent_ready(c, shown)
            self.dirty = True
            self._has_links = True
            _symlink(_readlink(c), self.upper(c))
            return self.upper(c)
        return self.for_write(c, shown, create=False, truncate=False, exclusive=False)

    def mkdir(self, c: str, mode: int, shown: Any) -> None:
        if self.lstat_in_view(c) is not None:
            raise os_error(errno.EEXIST, shown)
        self._parent_ready(c, shown)
        self.dirty = True
        _mkdir(self.upper(c), mode)
        self._replacing(c)  # made again: what the real one held stays removed

    def listdir(self, c: str, shown: Any) -> list[str]:
        """The names in folder ``c`` of the view."""
        c = self.follow(c)
        st = self.lstat_in_view(c)
        if st is None:
            raise self.missing(c, shown)
        if not stat.S_ISDIR(st.st_mode):
            raise os_error(errno.ENOTDIR, shown)
        names: dict[str, None] = {}
        if self._real_dir_shows(c):
            for name in _listdir(c):
                if self.where(os.path.join(c, name)) != GONE:
                    names[name] = None
        if self.dirty and lexists(self.upper(c)):
            for name in _listdir(self.upper(c)):
                names[name] = None
        return list(names)

    def scandir(self, c: str, given: Any) -> OverlayScandir:
        base = os.fsdecode(given)
        entries = []
        for name in self.listdir(c, given):
            path = os.path.join(base, name) if base else name
            if isinstance(given, bytes):
                entries.append(OverlayEntry(os.fsencode(name), os.fsencode(path),
                                            os.path.join(c, name), self))
            else:
                entries.append(OverlayEntry(name, path, os.path.join(c, name), self))
        return OverlayScandir(entries)

    def touches(self, c: str) -> bool:
        """Whether folder ``c`` (its path as named, resolved) may be listed differently in
        the view than by the real call on the path as given: the run made a link or removed
        something (paths resolve otherwise), or holds something in ``c`` or above it that
        is not a folder."""
        if not self.dirty:
            return False
        if self._has_links or self.deleted or self.opaque or lexists(self.upper(c)):
            return True
        followed = self.follow(c)
        if followed != c and lexists(self.upper(followed)):
            return True
        p = os.path.dirname(c)
        while p != "/":
            st = lstat_or_none(self.upper(p))
            if st is not None:
                return not stat.S_ISDIR(st.st_mode)
            p = os.path.dirname(p)
        return False

    def remove(self, c: str, shown: Any) -> None:
        """``os.remove`` / ``os.unlink`` of ``c`` (a file or a link, never a folder)."""
        st = self.lstat_in_view(c)
        if st is None:
            raise self.missing(c, shown)
        if stat.S_ISDIR(st.st_mode):
            raise os_error(errno.EISDIR, shown)
        self._drop(c)

    def _drop(self, c: str) -> None:
        """``c`` gone from the view: removed from the overlay, remembered as removed where a
        real one exists."""
        self.dirty = True
        up = self.upper(c)
        if lexists(up):
            rmtree(up)
        if self.where(c) == REAL and lexists(c):
            self.note_real(c)
            self.deleted.add(c)
            # what was removed under it is part of it now
            inside = c + "/"
            self.deleted = {p for p in self.deleted if not p.startswith(inside)}
            self.opaque = {p for p in self.opaque if not p.startswith(inside)}
        self.opaque.discard(c)
        self._forget_resolved()

    def rmdir(self, c: str, shown: Any) -> None:
        st = self.lstat_in_view(c)
        if st is None:
            raise self.missing(c, shown)
        if not stat.S_ISDIR(st.st_mode):
            raise os_error(errno.ENOTDIR, shown)
        if self.listdir(c, shown):
            raise os_error(errno.ENOTEMPTY, shown)
        self._drop(c)

    def rename(self, s: str, d: str, shown_s: Any, shown_d: Any) -> None:
        """``os.rename`` / ``os.replace`` in the view (a folder with what it holds)."""
        st = self.lstat_in_view(s)
        if st is None:
            raise self.missing(s, shown_s, shown_d)
        if s == d:
            return
        # rename(2) looks the destination's folder up before it compares the two paths:
        # a file renamed to a name inside itself ("new" -> "new/z") is ENOTDIR, not EINVAL
        self._parent_check(d, shown_s, shown_d)
        if d.startswith(s + "/"):  # a folder into itself
            raise os_error(errno.EINVAL, shown_s, shown_d)
        if s.startswith(d + "/"):  # onto a folder above it, never empty
            raise os_error(errno.ENOTEMPTY, shown_s, shown_d)
        dst = self.lstat_in_view(d)
        if dst is not None and (dst.st_dev, dst.st_ino) == (st.st_dev, st.st_ino):
            return  # two hard links of one file: rename(2) does nothing, both names stay
        if dst is not None:
            if stat.S_ISDIR(st.st_mode):
                if not stat.S_ISDIR(dst.st_mode):
                    raise os_error(errno.ENOTDIR, shown_s, shown_d)
                if self.listdir(d, shown_d):
                    raise os_error(errno.ENOTEMPTY, shown_s, shown_d)
            elif stat.S_ISDIR(dst.st_mode):
                raise os_error(errno.EISDIR, shown_s, shown_d)
        self._make_upper_dirs(os.path.dirname(d))  # its folder was checked above
        if dst is not None:
            self._drop(d)
        self.dirty = True
        self._copy_into_upper(s, d)
        self._drop(s)
        self._replacing(d)

    def _copy_into_upper(self, s: str, d: str) -> None:
        """What ``s`` is in the view, made at ``d`` in the overlay (moved where it lives in
        the overlay alone, copied where the real one shows through)."""
        up_s, up_d = self.upper(s), self.upper(d)
        st = self.lstat_in_view(s)
        assert st is not None
        w = self.where(s)
        if w == UPPER and not (stat.S_ISDIR(st.st_mode) and self._real_dir_shows(s)):
            _replace(up_s, up_d)  # the overlay's own: moved whole
            return
        if stat.S_ISLNK(st.st_mode):
            _symlink(_readlink(s), up_d)
            self._has_links = True
        elif stat.S_ISDIR(st.st_mode):
            if not lexists(up_d):
                _mkdir(up_d, stat.S_IMODE(st.st_mode) | 0o700)
            for name in self.listdir(s, s):
                self._copy_into_upper(os.path.join(s, name), os.path.join(d, name))
            _chmod(up_d, stat.S_IMODE(st.st_mode))
        elif w == UPPER:
            _replace(up_s, up_d)
        else:
            self.note_real(s)
            copy_file(s, up_d, st)

    def symlink(self, target: str, c: str, shown: Any) -> None:
        if self.lstat_in_view(c) is not None:
            raise os_error(errno.EEXIST, shown)
        self._parent_ready(c, shown)
        self.dirty = True
        self._has_links = True
        _symlink(target, self.upper(c))
        self._replacing(c)

    def readlink(self, c: str, shown: Any) -> str:
        st = self.lstat_in_view(c)
        if st is None:
            raise self.missing(c, shown)
        if not stat.S_ISLNK(st.st_mode):
            raise os_error(errno.EINVAL, shown)
        return _readlink(self.upper(c) if self.where(c) == UPPER else c)

    def link(self, s: str, d: str, shown_s: Any, shown_d: Any) -> None:
        """A hard link: both names in the overlay, one file."""
        st = self.lstat_in_view(s)
        if st is None:
            raise self.missing(s, shown_s, shown_d)
        self._parent_check(d, shown_d)
        if self.lstat_in_view(d) is not None:
            raise os_error(errno.EEXIST, shown_s, shown_d)
        if stat.S_ISDIR(st.st_mode):
            raise os_error(errno.EPERM, shown_s, shown_d)
        up_s = self.materialize(s, shown_s, follow_symlinks=False)
        self._parent_ready(d, shown_d)
        _link(up_s, self.upper(d), follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            self._has_links = True
        self._replacing(d)

    # ---- what the run left -------------------------------------------------------------

    def changes(self) -> list[Change]:
        """Everything the run wrote, made or removed, by canonical path, sorted."""
        return changes_of(self)
