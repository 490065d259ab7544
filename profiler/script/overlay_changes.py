"""What one run left in its overlay (:class:`~dpprof.script.overlay.Overlay`): each file or
link it wrote, folder it made and real path it removed, as the report lists them and the
later ranks' runs are given them (:mod:`dpprof.script.shared_files`)."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dpprof.script.real_fs import REAL_CALLS, lstat_or_none

if TYPE_CHECKING:
    from dpprof.script.overlay import Overlay

__all__ = ["Change", "changes_of"]

_lstat = REAL_CALLS["lstat"]
_listdir = REAL_CALLS["listdir"]


@dataclass
class Change:
    """One thing the run left in its overlay: a file or link it wrote, a folder it made, or
    a real path it removed."""

    path: str  # canonical
    kind: str  # "file" | "folder" | "link" | "removed"
    size_bytes: int = 0
    mtime_ns: int = 0
    replaced: bool = False  # a real file stands at that path (the run's write is in its place)
    concrete: str = ""  # where its bytes are now (in the overlay)


def changes_of(overlay: Overlay) -> list[Change]:
    """Everything the run wrote, made or removed, by canonical path, sorted."""
    out = [Change(c, "removed", replaced=True) for c in sorted(overlay.deleted)]
    if overlay.dirty:
        _walk_upper(overlay, "/", out)
    out.sort(key=lambda ch: ch.path)
    return out


def _walk_upper(overlay: Overlay, c: str, out: list[Change]) -> None:
    up = overlay.upper(c)
    for name in sorted(_listdir(up)):
        p = os.path.join(c, name)
        st = _lstat(overlay.upper(p))
        real = lstat_or_none(p)
        if stat.S_ISDIR(st.st_mode):
            if real is None or not stat.S_ISDIR(real.st_mode) or p in overlay.opaque:
                out.append(Change(p, "folder", mtime_ns=st.st_mtime_ns,
                                  replaced=real is not None))
            _walk_upper(overlay, p, out)
        else:
            out.append(Change(p, "link" if stat.S_ISLNK(st.st_mode) else "file",
                              st.st_size, st.st_mtime_ns, replaced=real is not None,
                              concrete=overlay.upper(p)))
