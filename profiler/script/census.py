"""The check after every run that the seal held: the user's files as they were.

Before the runs, :func:`take` notes the state of every file and folder under the working
directory and the script's folder (up to a limit, shallowest first); after each run the
same walk is compared with it, and so is every real file the run would have changed (a file
it wrote over, appended to, renamed or removed: :attr:`dpprof.script.overlay.Overlay.touched_real`).
A file is the same when its inode, size, permissions, modification time and change time
are: the kernel sets the change time at every write, so a file written and put back, or
given its old modification time, still differs. A folder counts by what it holds (a new
file is found as created). Reads change none of these.
"""

from __future__ import annotations

import os
import stat
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["LIMIT", "LIMIT_UNDER_KERNEL", "Difference", "Snapshot", "again", "differences",
           "take"]

# entries noted per snapshot (a data set under the working directory): the walk is the only
# second line where no mount namespace holds the writes, a check of it where one does
LIMIT = 20_000
LIMIT_UNDER_KERNEL = 2_000

Signature = tuple[int, int, int, int, int, int]  # mode, inode, device, size, mtime, ctime


def _signature(st: os.stat_result) -> Signature:
    return (st.st_mode, st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass
class Snapshot:
    """The state of the files under some folders."""

    entries: dict[str, Signature] = field(default_factory=dict)
    roots: list[str] = field(default_factory=list)
    complete: bool = True  # False: more entries than the limit; the shallowest were noted
    limit: int = LIMIT


@dataclass
class Difference:
    path: str
    what: str  # "changed" | "removed" | "created"


def take(folders: Iterable[str], exclude: Iterable[str] = (), limit: int = LIMIT) -> Snapshot:
    """Every entry under ``folders`` (not following links, not into ``exclude``), breadth
    first, up to ``limit`` entries."""
    skip = {os.path.realpath(e) for e in exclude}
    roots: list[str] = []
    for f in folders:
        real = os.path.realpath(f)
        if os.path.isdir(real) and real not in roots and real not in skip \
                and not any(real.startswith(r + "/") for r in roots):
            roots = [r for r in roots if not r.startswith(real + "/")] + [real]
    snap = Snapshot(roots=roots, limit=limit)
    todo = deque(roots)
    while todo:
        folder = todo.popleft()
        try:
            it = os.scandir(folder)
        except OSError:
            continue
        with it:
            for entry in it:
                if len(snap.entries) >= limit:
                    snap.complete = False
                    return snap
                if entry.path in skip:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                snap.entries[entry.path] = _signature(st)
                if stat.S_ISDIR(st.st_mode):
                    todo.append(entry.path)
    return snap


def again(before: Snapshot, exclude: Iterable[str] = ()) -> Snapshot:
    """The same walk as ``before``'s, now."""
    return take(before.roots, exclude, before.limit)


def differences(before: Snapshot, after: Snapshot,
                touched: dict[str, os.stat_result] | None = None) -> list[Difference]:
    """What differs between the two snapshots, and each of ``touched`` (a real file -> its
    stat when the run first would have changed it) that is not as it was."""
    out: dict[str, Difference] = {}
    for path, sig in before.entries.items():
        now = after.entries.get(path)
        if now is None:
            if after.complete or _gone(path):
                out[path] = Difference(path, "removed")
        elif now != sig and not (stat.S_ISDIR(sig[0]) and stat.S_ISDIR(now[0])):
            out[path] = Difference(path, "changed")
    if before.complete:
        for path in after.entries.keys() - before.entries.keys():
            out[path] = Difference(path, "created")
    for path, st in (touched or {}).items():
        if path in out:
            continue
        try:
            now_st = os.lstat(path)
        except OSError:
            out[path] = Difference(path, "removed")
            continue
        if _signature(now_st) != _signature(st):
            out[path] = Difference(path, "changed")
    return sorted(out.values(), key=lambda d: d.path)


def _gone(path: str) -> bool:
    try:
        os.lstat(path)
    except OSError:
        return True
    return False
