"""The check after every run that the seal held: the user's files as they were.

Before the runs, :func:`take` notes the state of every file and folder under the working
directory and the script's folder (up to a limit, shallowest first); after each run the
same walk is compared with it, and so is every real file the run would have changed (a file
it wrote over, appended to, renamed or removed: :attr:`dpprof.script.overlay.Overlay.touched_real`).
A file is the same when its inode, size, permissions, modification time and change time
are: the kernel sets the change time at every write, so a file written and put back, or
given its old modification time, still differs. A folder counts by what it holds (a new
file is found as created). Reads change none of these.

The walk after a run costs a system call per file (tens of milliseconds in a folder of
thousands): where the kernel keeps a record of what changed in the folders walked
(:mod:`dpprof.script.folder_watch`, begun with the walk before the runs), the state after is
the state before with only the paths it names looked at again (and any folder made since
walked whole); where it cannot vouch for that record, the walk is done again.
"""

from __future__ import annotations

import os
import stat
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from dpprof.script.folder_watch import FolderWatch

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
    # the kernel's record of changes in every folder walked, since the walk (None: none)
    watch: FolderWatch | None = field(default=None, repr=False, compare=False)


@dataclass
class Difference:
    path: str
    what: str  # "changed" | "removed" | "created"


def take(folders: Iterable[str], exclude: Iterable[str] = (), limit: int = LIMIT,
         watch: bool = True) -> Snapshot:
    """Every entry under ``folders`` (not following links, not into ``exclude``), breadth
    first, up to ``limit`` entries; ``watch``: each folder watched from before its entries
    are noted (:attr:`Snapshot.watch`)."""
    skip = {os.path.realpath(e) for e in exclude}
    roots: list[str] = []
    for f in folders:
        real = os.path.realpath(f)
        if os.path.isdir(real) and real not in roots and real not in skip \
                and not any(real.startswith(r + "/") for r in roots):
            roots = [r for r in roots if not r.startswith(real + "/")] + [real]
    snap = Snapshot(roots=roots, limit=limit, watch=FolderWatch() if watch else None)
    _walk(roots, skip, snap.entries, limit, snap)
    return snap


def _walk(roots: Iterable[str], skip: set[str], entries: dict[str, Signature], limit: int,
          snap: Snapshot | None = None) -> bool:
    """Every entry under ``roots`` into ``entries``, breadth first, until it holds
    ``limit``; each folder added to ``snap``'s watch before it is read. Whether all fit."""
    watch = snap.watch if snap is not None else None
    todo = deque(roots)
    while todo:
        folder = todo.popleft()
        if watch is not None:
            watch.add(folder)
        try:
            it = os.scandir(folder)
        except OSError:
            continue
        with it:
            for entry in it:
                if len(entries) >= limit:
                    if snap is not None:
                        snap.complete = False
                    return False
                if entry.path in skip:
                    continue
                if watch is not None and entry.is_file(follow_symlinks=False):
                    watch.add_file(entry.path)  # before it is noted, as its folder
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                entries[entry.path] = _signature(st)
                if stat.S_ISDIR(st.st_mode):
                    todo.append(entry.path)
    return True


def again(before: Snapshot, exclude: Iterable[str] = ()) -> Snapshot:
    """The same walk as ``before``'s, now: from ``before``'s watch where its record is
    whole, else walked again."""
    watch = before.watch
    if watch is not None:
        changed = watch.changed()
        # a folder walked from moved or removed: what it held is named by no event
        if watch.complete and changed.isdisjoint(before.roots):
            return _from_changes(before, changed, {os.path.realpath(e) for e in exclude})
    return take(before.roots, exclude, before.limit, watch=False)


def _from_changes(before: Snapshot, changed: set[str], skip: set[str]) -> Snapshot:
    """``before`` with each path of ``changed`` looked at again: gone (with what it held),
    changed, or new; a folder made (or made again) since walked whole, as the walk would
    find it (nothing in it is watched)."""
    entries = dict(before.entries)
    walk_again: list[str] = []
    for path in sorted(changed):
        if path in skip or _under(path, skip):
            continue
        was = before.entries.get(path)
        try:
            st = os.lstat(path)
        except OSError:
            entries.pop(path, None)
            if was is not None and stat.S_ISDIR(was[0]):
                _drop_under(entries, path)
            continue
        sig = _signature(st)
        if was is None and not before.complete:
            continue  # beyond the limit, as the walk would leave it
        entries[path] = sig
        if stat.S_ISDIR(st.st_mode) and (was is None or not stat.S_ISDIR(was[0])
                                          or was[1:3] != sig[1:3]):
            _drop_under(entries, path)
            walk_again.append(path)
    if walk_again:
        _walk(walk_again, skip, entries, before.limit if before.complete else 1 << 62)
    return Snapshot(entries=entries, roots=list(before.roots), complete=before.complete,
                    limit=before.limit)


def _under(path: str, folders: set[str]) -> bool:
    return any(path.startswith(f + "/") for f in folders)


def _drop_under(entries: dict[str, Signature], folder: str) -> None:
    inside = folder + "/"
    for p in [p for p in entries if p.startswith(inside)]:
        del entries[p]


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
