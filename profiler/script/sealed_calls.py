"""Python's file calls through the seal of the run under way: ``open`` / ``io.open`` and the
:mod:`os` functions that name a path, as :class:`~dpprof.script.seal.Seal` patches them in
while a run is under way (:data:`OS_WRAPPERS`, :func:`sealed_open`).

Each consults the seal active when it is called (:func:`active`): a name bound during one run
and called after it calls the real function. A call passes through untouched where the seal
says so (:meth:`~dpprof.script.seal.Seal.canon`); else it reads the run's view and writes into
its overlay (:class:`~dpprof.script.overlay.Overlay`).

What they cost a run is timed into the seal's ``lines.calls_s``: each :mod:`os` call whole
(where the overlay does the call's work, that work is the seal's: a stat through the view
counts its own stats), and an ``open`` up to the path it opens (the open itself is the
script's, sealed or not). Two reads of a clock a call, against the tens of microseconds
the call takes.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import stat
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dpprof.script.overlay import GONE, Overlay
from dpprof.script.real_fs import REAL_CALLS, REAL_OPEN, as_given, lstat_or_none, os_error

if TYPE_CHECKING:
    from dpprof.script.seal import Seal

__all__ = ["OS_WRAPPERS", "WRITE_FLAGS", "WRITE_MODE", "active", "make_active", "sealed_open"]

# what opens a file for writing: a mode's letters, os.open's flags
WRITE_MODE = frozenset("wax+")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

_ACTIVE: Seal | None = None
_clock = time.perf_counter


def active() -> Seal | None:
    """The seal of the run now under way, if any."""
    return _ACTIVE


def make_active(seal: Seal | None) -> Seal | None:
    """``seal`` the one under way from now (None: none); the one that was."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, seal
    return previous


def sealed_open(file: Any, *args: Any, **kwargs: Any) -> Any:
    seal = _ACTIVE
    # an opener decides what the path means (tempfile's ignores it and calls os.open, the
    # seal's, on a name of its own)
    if seal is None or isinstance(file, int) or kwargs.get("opener") is not None \
            or (len(args) >= 7 and args[6] is not None):
        return REAL_OPEN(file, *args, **kwargs)
    mode = args[0] if args else kwargs.get("mode", "r")
    started = _clock()
    try:
        concrete = seal.open_path(file, mode)
    finally:
        seal.lines.calls_s += _clock() - started
    return REAL_OPEN(concrete, *args, **kwargs)


def _os_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
    seal = _ACTIVE
    concrete = None
    if seal is not None:
        started = _clock()
        try:
            concrete = seal.open_flags_path(path, flags, dir_fd)
        finally:
            seal.lines.calls_s += _clock() - started
    if concrete is None:
        return int(REAL_CALLS["open"](path, flags, mode, dir_fd=dir_fd))
    return int(REAL_CALLS["open"](concrete, flags, mode))


def _timed(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` with its seconds added to the active seal's ``lines.calls_s``."""
    @functools.wraps(call)
    def timed(*args: Any, **kwargs: Any) -> Any:
        seal = _ACTIVE
        if seal is None:
            return call(*args, **kwargs)
        started = _clock()
        try:
            return call(*args, **kwargs)
        finally:
            seal.lines.calls_s += _clock() - started

    return timed


def _sealed(path: Any, dir_fd: int | None = None, *,
            write: bool) -> tuple[Overlay, str] | None:
    """The active seal's overlay and ``path`` canonical in it, or None where the call
    passes through (no run under way, or :meth:`Seal.canon` says so)."""
    seal = _ACTIVE
    if seal is None:
        return None
    c = seal.canon(path, dir_fd, write=write)
    return None if c is None else (seal.overlay, c)


def _stat(path: Any, *, dir_fd: int | None = None, follow_symlinks: bool = True) -> Any:
    at = _sealed(path, dir_fd, write=False)
    if at is None:
        return REAL_CALLS["stat"](path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
    return at[0].stat(at[1], follow_symlinks, path)


def _lstat(path: Any, *, dir_fd: int | None = None) -> Any:
    at = _sealed(path, dir_fd, write=False)
    if at is None:
        return REAL_CALLS["lstat"](path, dir_fd=dir_fd)
    return at[0].stat(at[1], False, path)


def _access(path: Any, mode: int, *, dir_fd: int | None = None, effective_ids: bool = False,
            follow_symlinks: bool = True) -> bool:
    at = _sealed(path, dir_fd, write=False)
    if at is None:
        return bool(REAL_CALLS["access"](path, mode, dir_fd=dir_fd, effective_ids=effective_ids,
                                    follow_symlinks=follow_symlinks))
    try:
        concrete = at[0].for_read(at[1], path, follow_symlinks)
    except OSError:
        return False
    return bool(REAL_CALLS["access"](concrete, mode, effective_ids=effective_ids,
                                follow_symlinks=follow_symlinks))


def _listdir(path: Any = None) -> list[Any]:
    given = "." if path is None else path
    at = _sealed(given, write=False)
    if at is None or not at[0].touches(at[1]):
        return list(REAL_CALLS["listdir"](given))
    names = at[0].listdir(at[1], given)
    return [os.fsencode(n) for n in names] if isinstance(given, bytes) else names


def _scandir(path: Any = None) -> Any:
    given = "." if path is None else path
    at = _sealed(given, write=False)
    if at is None or not at[0].touches(at[1]):
        return REAL_CALLS["scandir"](given)
    return at[0].scandir(at[0].follow(at[1]), given)


def _remover(name: str) -> Callable[..., None]:
    def remove(path: Any, *, dir_fd: int | None = None) -> None:
        if _ACTIVE is not None:
            _ACTIVE.keep_before_removal(path, dir_fd)
        at = _sealed(path, dir_fd, write=True)
        if at is None:
            REAL_CALLS[name](path, dir_fd=dir_fd)
        else:
            at[0].remove(at[1], path)

    remove.__name__ = name
    return remove


def _renamer(name: str) -> Callable[..., None]:
    def rename(src: Any, dst: Any, *, src_dir_fd: int | None = None,
               dst_dir_fd: int | None = None) -> None:
        if _ACTIVE is not None:
            _ACTIVE.keep_before_removal(src, src_dir_fd)
        s = _sealed(src, src_dir_fd, write=True)
        d = _sealed(dst, dst_dir_fd, write=True)
        if s is None and d is None:
            REAL_CALLS[name](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        elif s is None or d is None:  # one end in a tree the kernel seals
            _cross_rename(src, dst, src_dir_fd, dst_dir_fd)
        else:
            s[0].rename(s[1], d[1], src, dst)

    rename.__name__ = name
    return rename


def _cross_rename(src: Any, dst: Any, src_dir_fd: int | None,
                  dst_dir_fd: int | None) -> None:
    """A rename between a tree the kernel line seals and one the overlay holds: the file
    copied into place, the source removed (both in their own overlay)."""
    if src_dir_fd is not None or dst_dir_fd is not None or stat.S_ISDIR(_stat(src).st_mode):
        # as across filesystems (EXDEV): shutil.move and its like copy instead
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), src, None, dst)
    with sealed_open(src, "rb") as a, sealed_open(dst, "wb") as b:
        shutil.copyfileobj(a, b)
    _os_remove(src)


def _mkdir(path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
    at = _sealed(path, dir_fd, write=True)
    if at is None:
        REAL_CALLS["mkdir"](path, mode, dir_fd=dir_fd)
    else:
        at[0].mkdir(at[1], mode, path)


def _rmdir(path: Any, *, dir_fd: int | None = None) -> None:
    at = _sealed(path, dir_fd, write=True)
    if at is None:
        REAL_CALLS["rmdir"](path, dir_fd=dir_fd)
    else:
        at[0].rmdir(at[1], path)


def _truncate(path: Any, length: int) -> None:
    at = _sealed(path, write=True)
    if at is None:
        REAL_CALLS["truncate"](path, length)
    else:
        REAL_CALLS["truncate"](at[0].for_write(at[1], path, create=False, truncate=False,
                                          exclusive=False), length)


def _symlink(src: Any, dst: Any, target_is_directory: bool = False, *,
             dir_fd: int | None = None) -> None:
    at = _sealed(dst, dir_fd, write=True)
    if at is None:
        REAL_CALLS["symlink"](src, dst, target_is_directory, dir_fd=dir_fd)
    else:
        at[0].symlink(os.fsdecode(src), at[1], dst)


def _link(src: Any, dst: Any, *, src_dir_fd: int | None = None,
          dst_dir_fd: int | None = None, follow_symlinks: bool = True) -> None:
    s = _sealed(src, src_dir_fd, write=True)
    d = _sealed(dst, dst_dir_fd, write=True)
    if s is None and d is None:
        REAL_CALLS["link"](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd,
                      follow_symlinks=follow_symlinks)
    elif s is None or d is None:
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), src, None, dst)
    else:
        s[0].link(s[1], d[1], src, dst)


def _readlink(path: Any, *, dir_fd: int | None = None) -> Any:
    at = _sealed(path, dir_fd, write=False)
    if at is None:
        return REAL_CALLS["readlink"](path, dir_fd=dir_fd)
    return as_given(path, at[0].readlink(at[1], path))


def _metadata(name: str) -> Callable[..., Any]:
    """A call that changes a path's metadata (chmod, chown, utime, setxattr...): on the
    overlay's copy."""
    def change(path: Any, *args: Any, dir_fd: int | None = None,
               follow_symlinks: bool = True, **kwargs: Any) -> Any:
        if not follow_symlinks:
            kwargs["follow_symlinks"] = False
        at = _sealed(path, dir_fd, write=True)
        if at is None:
            if dir_fd is not None:
                kwargs["dir_fd"] = dir_fd
            return REAL_CALLS[name](path, *args, **kwargs)
        concrete = at[0].materialize(at[1], path, follow_symlinks)
        return REAL_CALLS[name](as_given(path, concrete), *args, **kwargs)

    change.__name__ = name
    return change


def _lchown(path: Any, uid: int, gid: int) -> None:
    _metadata("chown")(path, uid, gid, follow_symlinks=False)


def _reader(name: str) -> Callable[..., Any]:
    """A call that reads a path (getxattr, listxattr, statvfs, pathconf): from the view."""
    def read(path: Any = None, *args: Any, **kwargs: Any) -> Any:
        at = _sealed(path, write=False) if path is not None else None
        if at is None:
            return REAL_CALLS[name](*(() if path is None else (path,)), *args, **kwargs)
        concrete = at[0].for_read(at[1], path, kwargs.get("follow_symlinks", True))
        return REAL_CALLS[name](as_given(path, concrete), *args, **kwargs)

    read.__name__ = name
    return read


def _maker(name: str) -> Callable[..., None]:
    """mkfifo / mknod: the node made in the overlay."""
    def make(path: Any, *args: Any, dir_fd: int | None = None) -> None:
        at = _sealed(path, dir_fd, write=True)
        if at is None:
            REAL_CALLS[name](path, *args, dir_fd=dir_fd)
        else:
            REAL_CALLS[name](at[0].for_write(at[1], path, create=True, truncate=True,
                                        exclusive=True), *args)

    make.__name__ = name
    return make


def _chdir(path: Any) -> None:
    at = _sealed(path, write=False)
    if at is None:
        REAL_CALLS["chdir"](path)
        return
    overlay, c = at[0], at[0].follow(at[1])
    st = overlay.lstat_in_view(c)
    if st is None:
        raise overlay.missing(c, path)
    if not stat.S_ISDIR(st.st_mode):
        raise os_error(errno.ENOTDIR, path)
    # a folder that exists for real is entered for real (reads of it stay real; the
    # overlay's files in it are found by path), one only the run made in the overlay
    real = lstat_or_none(c)
    inside = overlay.where(c) == GONE or real is None or c in overlay.opaque
    REAL_CALLS["chdir"](overlay.upper(c) if inside else c)


def _getcwd() -> str:
    seal = _ACTIVE
    cwd = str(REAL_CALLS["getcwd"]())
    return seal.overlay.from_upper(cwd) if seal is not None else cwd


def _getcwdb() -> bytes:
    return os.fsencode(_getcwd())


_os_remove = _remover("remove")

_CALLS: dict[str, Callable[..., Any]] = {
    "open": _os_open, "stat": _stat, "lstat": _lstat, "access": _access,
    "listdir": _listdir, "scandir": _scandir, "remove": _os_remove,
    "unlink": _remover("unlink"), "rename": _renamer("rename"),
    "replace": _renamer("replace"), "mkdir": _mkdir, "rmdir": _rmdir,
    "truncate": _truncate, "symlink": _symlink, "link": _link, "readlink": _readlink,
    "chmod": _metadata("chmod"), "chown": _metadata("chown"), "lchown": _lchown,
    "utime": _metadata("utime"), "setxattr": _metadata("setxattr"),
    "removexattr": _metadata("removexattr"), "getxattr": _reader("getxattr"),
    "listxattr": _reader("listxattr"), "statvfs": _reader("statvfs"),
    "pathconf": _reader("pathconf"), "mkfifo": _maker("mkfifo"),
    "mknod": _maker("mknod"), "chdir": _chdir, "getcwd": _getcwd, "getcwdb": _getcwdb,
}
# os.open times only the finding of its path (as open does)
OS_WRAPPERS: dict[str, Callable[..., Any]] = {
    name: call if name == "open" else _timed(call) for name, call in _CALLS.items()}
