"""The check after every run that the seal held: the user's files as they were.

Before the runs, :func:`take` notes the state of every file and folder under the working
directory and the script's folder (up to a limit, shallowest first); after each run the
same walk is compared with it, and so is every real file the run would have changed (a file
it wrote over, appended to, renamed or removed: :attr:`dpprof.script.overlay.Overlay.touched_real`).
A file is the same when its inode, size, permissions, modification time and change time
are: the kernel sets the change time at every write, so a file written and put back, or
given its old modification time, still differs. A folder counts by what it holds (a new
file is found as created). Reads change none of these. The files dpprof's own output and
errors go to (``> log.txt``, ``| tee log.txt``: :mod:`dpprof.script.output_files`) are
left out: the user sent the script's prints there.

The walk after a run costs a system call per file (tens of milliseconds in a folder of
thousands): where the kernel keeps a record of what changed in the folders walked
(:mod:`dpprof.script.folder_watch`, begun with the walk before the runs), the state after is
the state before with only the paths it names looked at again (and any folder made since
walked whole), and only those compared; where it cannot vouch for that record, the walk is
done again.

Each file is watched by its inode as well (:meth:`FolderWatch.add_file`: a hard link made
from a folder nobody watches would write it unseen), except where :func:`take` is told that
no such link can be made during the runs (``every_inode=False``: the kernel line, where every
process of the run sees the user's folders only through their overlays,
:mod:`dpprof.script.namespace`: ``link()`` from there to another mount fails with EXDEV, and
one inside the overlay copies the file up first); there only a file that has another link
already (``st_nlink > 1``: that link may lie in a folder no overlay covers) is watched by its
inode. A change made by a process outside dpprof's namespace through a link it makes then
is the one the record would not name there.
"""

from __future__ import annotations

import os
import stat
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from dpprof.script.folder_watch import FolderWatch
from dpprof.script.output_files import output_files

__all__ = ["LIMIT", "LIMIT_UNDER_KERNEL", "Difference", "Snapshot", "again", "differences",
           "refresh", "roots_of", "skipped", "take", "watch_every_inode"]

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
    # each file watched by its inode (else only those with more than one link)
    every_inode: bool = True
    # a snapshot made from another's record (:func:`again`): that one, and the only paths
    # where the two can differ
    made_from: Snapshot | None = field(default=None, repr=False, compare=False)
    differs_only_at: set[str] = field(default_factory=set, repr=False, compare=False)
    # the paths not walked into or noted: the writes kept, the files dpprof's own output goes to
    skip: set[str] = field(default_factory=set, repr=False, compare=False)
    # seconds its walks took (wherever they ran: :mod:`dpprof.script.census_ahead`), and
    # the seconds the runs waited for it
    taken_s: float = field(default=0.0, compare=False)
    waited_s: float = field(default=0.0, compare=False)


@dataclass
class Difference:
    path: str
    what: str  # "changed" | "removed" | "created"


def take(folders: Iterable[str], exclude: Iterable[str] = (), limit: int = LIMIT,
         watch: bool | FolderWatch = True, every_inode: bool = True) -> Snapshot:
    """Every entry under ``folders`` (not following links, not into ``exclude``), breadth
    first, up to ``limit`` entries; ``watch``: each folder watched from before its entries
    are noted (:attr:`Snapshot.watch`: a new one, or the one given), and each file by its
    inode (``every_inode`` False: only a file with more than one link; see the module)."""
    started = time.perf_counter()
    skip = skipped(exclude)
    roots = roots_of(folders, skip)
    if watch is True:
        watch = FolderWatch()
    snap = Snapshot(roots=roots, limit=limit, watch=watch or None, every_inode=every_inode,
                    skip=skip)
    _walk(roots, skip, snap.entries, limit, snap, every_inode)
    snap.taken_s = time.perf_counter() - started
    return snap


def skipped(exclude: Iterable[str]) -> set[str]:
    """The paths a census of folders leaves out: ``exclude`` (made real), and the files
    dpprof's own output goes to."""
    return {os.path.realpath(e) for e in exclude} | output_files()


def roots_of(folders: Iterable[str], skip: set[str]) -> list[str]:
    """The folders a census of ``folders`` walks from: each made real, a folder inside
    another (or left out) dropped."""
    roots: list[str] = []
    for f in folders:
        real = os.path.realpath(f)
        if os.path.isdir(real) and real not in roots and real not in skip \
                and not any(real.startswith(r + "/") for r in roots):
            roots = [r for r in roots if not r.startswith(real + "/")] + [real]
    return roots


def refresh(snap: Snapshot) -> bool:
    """``snap`` brought up to now, in place, from its watch's record: each path that
    changed since it was taken looked at again (a folder made or replaced since walked, and
    watched, as :func:`take` walks), and the record begun anew, so that ``snap`` is what
    :func:`take` would note now. A census taken ahead of the runs
    (:mod:`dpprof.script.census_ahead`) is made current so before the first run. False
    where the record cannot vouch for that (no watch, not whole, a folder walked from moved
    or removed): then take it again."""
    started = time.perf_counter()
    watch = snap.watch
    if watch is None or not watch.complete:
        return False
    changed, gone = watch.take_changed()
    if not watch.complete or not changed.isdisjoint(snap.roots):
        return False
    entries, skip = snap.entries, snap.skip
    # a folder's own times change with what it holds (events name the entry, not it)
    changed |= {os.path.dirname(p) for p in changed if os.path.dirname(p) in entries}
    walk_again: list[str] = []
    for path in sorted(changed):
        if path in skip or _under(path, skip):
            continue
        was = entries.get(path)
        if was is None and not snap.complete:
            continue  # beyond the limit, as the walk would leave it
        st = _watched_lstat(snap, path)
        if st is None:
            entries.pop(path, None)
            if was is not None and stat.S_ISDIR(was[0]):
                _drop_under(entries, path)
            continue
        sig = _signature(st)
        if was is None and len(entries) >= snap.limit:
            snap.complete = False
            continue
        entries[path] = sig
        if stat.S_ISDIR(st.st_mode) and (was is None or not stat.S_ISDIR(was[0])
                                          or was[1:3] != sig[1:3] or path in gone):
            _drop_under(entries, path)
            walk_again.append(path)
    if walk_again:
        _walk(walk_again, skip, entries, snap.limit, snap, snap.every_inode)
    snap.taken_s += time.perf_counter() - started
    return watch.complete


def _watched_lstat(snap: Snapshot, path: str) -> os.stat_result | None:
    """``os.lstat(path)`` (None: gone); the file at ``path`` watched by its inode first, as
    :func:`take` watches it (a folder is watched as it is walked). Watched again even where
    its inode number is the one noted: a file replaced twice can have its first inode's
    number again (ext4 reuses them at once) while that inode's watch went with it; a watch
    asked again of an inode already watched is the one it has."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or not (snap.every_inode or st.st_nlink > 1):
        return st
    assert snap.watch is not None
    snap.watch.add_file(path)  # before it is noted
    try:
        return os.lstat(path)
    except OSError:
        return None


def watch_every_inode(snap: Snapshot) -> None:
    """Each file of ``snap`` watched by its inode from now on, where :func:`take` watched
    only those with more than one link: a run that is not held by the kernel line (its
    overlays could not be mounted) follows runs that were, in which no new link to a file
    of the user's could be made."""
    if snap.every_inode or snap.watch is None:
        return
    snap.every_inode = True
    for path, sig in snap.entries.items():
        if stat.S_ISREG(sig[0]):
            snap.watch.add_file(path)


def _walk(roots: Iterable[str], skip: set[str], entries: dict[str, Signature], limit: int,
          snap: Snapshot | None = None, every_inode: bool = True) -> bool:
    """Every entry under ``roots`` into ``entries``, breadth first, until it holds
    ``limit``; each folder added to ``snap``'s watch before it is read, and each file
    (``every_inode`` False: each with more than one link) before it is noted. Whether all
    fit."""
    watch = snap.watch if snap is not None else None
    is_dir, is_reg = stat.S_ISDIR, stat.S_ISREG
    todo = deque(roots)
    while todo:
        folder = todo.popleft()
        if watch is not None:
            watch.add(folder)
        try:
            with os.scandir(folder) as it:
                listed = [e for e in it if e.path not in skip]
        except OSError:
            continue
        if watch is not None and every_inode:
            # each file watched before it is noted, as its folder: the folder's in one call
            watch.add_files([e.path for e in listed[:max(0, limit - len(entries))]
                             if e.is_file(follow_symlinks=False)])
        for entry in listed:
            if len(entries) >= limit:
                if snap is not None:
                    snap.complete = False
                return False
            path = entry.path
            try:
                st = entry.stat(follow_symlinks=False)
                if watch is not None and not every_inode and st.st_nlink > 1 \
                        and is_reg(st.st_mode):
                    watch.add_file(path)  # watched, then noted
                    st = os.lstat(path)
            except OSError:
                continue
            mode = st.st_mode
            entries[path] = (mode, st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns,
                             st.st_ctime_ns)
            if is_dir(mode):
                todo.append(path)
    return True


def again(before: Snapshot, exclude: Iterable[str] = ()) -> Snapshot:
    """The same walk as ``before``'s, now: from ``before``'s watch where its record is
    whole, else walked again."""
    watch = before.watch
    skip = before.skip | {os.path.realpath(e) for e in exclude}
    if watch is not None:
        changed = watch.changed()
        # a folder walked from moved or removed: what it held is named by no event
        if watch.complete and changed.isdisjoint(before.roots):
            return _from_changes(before, changed, skip, watch.gone)
    return take(before.roots, skip, before.limit, watch=False)


def _from_changes(before: Snapshot, changed: set[str], skip: set[str],
                  gone: set[str]) -> Snapshot:
    """``before`` with each path of ``changed`` looked at again: gone (with what it held),
    changed, or new; a folder made (or made again) since walked whole, as the walk would
    find it (nothing in it is watched), also one made again with the inode number of the
    one removed (a folder of ``gone``: its watch saw it go). The paths it looked at are
    the only ones where it can differ from ``before`` (:attr:`Snapshot.differs_only_at`)."""
    entries = dict(before.entries)
    looked_at: set[str] = set()
    walk_again: list[str] = []
    for path in sorted(changed):
        if path in skip or _under(path, skip):
            continue
        was = before.entries.get(path)
        looked_at.add(path)
        try:
            st = os.lstat(path)
        except OSError:
            entries.pop(path, None)
            if was is not None and stat.S_ISDIR(was[0]):
                looked_at.update(_drop_under(entries, path))
            continue
        sig = _signature(st)
        if was is None and not before.complete:
            continue  # beyond the limit, as the walk would leave it
        entries[path] = sig
        if stat.S_ISDIR(st.st_mode) and (was is None or not stat.S_ISDIR(was[0])
                                          or was[1:3] != sig[1:3] or path in gone):
            looked_at.update(_drop_under(entries, path))
            walk_again.append(path)
    if walk_again:
        had = set(entries)
        _walk(walk_again, skip, entries, before.limit if before.complete else 1 << 62)
        looked_at.update(entries.keys() - had)
    return Snapshot(entries=entries, roots=list(before.roots), complete=before.complete,
                    limit=before.limit, made_from=before, differs_only_at=looked_at)


def _under(path: str, folders: set[str]) -> bool:
    return any(path.startswith(f + "/") for f in folders)


def _drop_under(entries: dict[str, Signature], folder: str) -> list[str]:
    """What ``entries`` held under ``folder``, taken out of it."""
    inside = folder + "/"
    dropped = [p for p in entries if p.startswith(inside)]
    for p in dropped:
        del entries[p]
    return dropped


def differences(before: Snapshot, after: Snapshot,
                touched: dict[str, os.stat_result] | None = None) -> list[Difference]:
    """What differs between the two snapshots, and each of ``touched`` (a real file -> its
    stat when the run first would have changed it) that is not as it was. Where ``after``
    was made from ``before``'s record, only the paths it looked at are compared (the others
    it holds as ``before`` does)."""
    out: dict[str, Difference] = {}
    at = after.differs_only_at if after.made_from is before else None
    pairs = before.entries.items() if at is None else [
        (p, before.entries[p]) for p in at if p in before.entries]
    for path, sig in pairs:
        now = after.entries.get(path)
        if now is None:
            if after.complete or _gone(path):
                out[path] = Difference(path, "removed")
        elif now != sig and not (stat.S_ISDIR(sig[0]) and stat.S_ISDIR(now[0])):
            out[path] = Difference(path, "changed")
    if before.complete:
        made = after.entries.keys() if at is None else at.intersection(after.entries)
        for path in made - before.entries.keys():
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
