"""The filesystem's calls as they were before any seal patched them, and the few helpers the
seal's modules build on them alone (:mod:`dpprof.script.seal` patches :mod:`os` and :mod:`io`
while a run is under way; what the seal itself does to the real filesystem must not go
through its own patches).

Imported before any seal is entered, so what it holds is the real thing.
"""

from __future__ import annotations

import io
import os
import stat
from typing import Any

__all__ = ["REAL_CALLS", "REAL_OPEN", "as_given", "copy_file", "fd_path", "lexists",
           "lstat_or_none", "makedirs", "os_error", "rmtree"]

REAL_OPEN = io.open
REAL_CALLS: dict[str, Any] = {name: getattr(os, name) for name in (
    "open", "close", "stat", "lstat", "access", "listdir", "scandir", "remove", "unlink",
    "rename", "replace", "mkdir", "rmdir", "truncate", "symlink", "link", "readlink", "chmod",
    "chown", "lchown", "utime", "chdir", "getcwd", "getcwdb", "mkfifo", "mknod", "setxattr",
    "removexattr", "getxattr", "listxattr", "statvfs", "pathconf") if hasattr(os, name)}

_lstat = REAL_CALLS["lstat"]


def os_error(code: int, shown: Any, other: Any = None) -> OSError:
    """The error a real call gives for ``code``, naming ``shown`` (and ``other``)."""
    if other is None:
        return OSError(code, os.strerror(code), shown)
    return OSError(code, os.strerror(code), shown, None, other)


def lexists(p: str) -> bool:
    try:
        _lstat(p)
    except (OSError, ValueError):
        return False
    return True


def lstat_or_none(p: str) -> os.stat_result | None:
    try:
        return _lstat(p)  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


def rmtree(p: str) -> None:
    """``p`` and everything under it removed (a symbolic link is removed, not followed)."""
    st = lstat_or_none(p)
    if st is None:
        return
    if not stat.S_ISDIR(st.st_mode):
        REAL_CALLS["unlink"](p)
        return
    _empty(p)
    REAL_CALLS["rmdir"](p)


def _empty(folder: str) -> None:
    """What ``folder`` holds removed (each entry's kind as the folder lists it: no stat)."""
    with REAL_CALLS["scandir"](folder) as it:
        entries = list(it)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            _empty(entry.path)
            REAL_CALLS["rmdir"](entry.path)
        else:
            REAL_CALLS["unlink"](entry.path)


def copy_file(src: str, dst: str, st: os.stat_result) -> None:
    """``src``'s bytes, permissions and times into ``dst`` (a copy-up keeps what a real
    file showed until the run changes it)."""
    with REAL_OPEN(src, "rb") as a, REAL_OPEN(dst, "wb") as b:
        while chunk := a.read(1 << 20):
            b.write(chunk)
    REAL_CALLS["chmod"](dst, stat.S_IMODE(st.st_mode))
    REAL_CALLS["utime"](dst, ns=(st.st_atime_ns, st.st_mtime_ns))


def makedirs(d: str) -> None:
    """``d`` and the folders above it made (private: 0o700)."""
    if lstat_or_none(d) is not None:
        return
    makedirs(os.path.dirname(d))
    REAL_CALLS["mkdir"](d, 0o700)


def fd_path(fd: int) -> str:
    """The path an open file descriptor names."""
    return str(REAL_CALLS["readlink"](f"/proc/self/fd/{fd}"))


def as_given(given: Any, concrete: str) -> Any:
    """``concrete`` as the kind of path the script gave (bytes stay bytes)."""
    return os.fsencode(concrete) if isinstance(given, bytes) else concrete
