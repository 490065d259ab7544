"""The filesystem the ranks share: rank 0's run is sealed into an overlay of its own, so a
later rank's run (:mod:`dpprof.script.rank_runs`) would not see what rank 0 wrote, as every
rank does on a machine whose ranks share a filesystem (the checkpoint rank 0 saves, waits
at a barrier for, and every rank loads).

Rank 0's run has ended before any other rank's starts, so a later rank is shown, at each
path, the last content rank 0's run wrote there, even where rank 0 removed or renamed it
afterwards (it did so after the barrier the others read it behind): :meth:`SharedFiles.publish`
keeps rank 0's files, and :meth:`SharedFiles.seed_into` lays them into a later rank's overlay
before its run. Reads then see its own writes first, then rank 0's, then the real files;
its writes go into its own overlay, and the seeded files are not listed as its writes.

A file rank 0's run removes is kept however it goes: through Python (the seal keeps a copy
of each file the run removes or renames away, before it goes), or outside Python, where
the kernel's overlay holds the run's files (``subprocess.run(["rm", ...])``, ``unlink``
called through ``ctypes``): :meth:`SharedFiles.watch` holds a hard link to each file in
the overlay's upper layers before every subprocess starts and every ``ctypes`` call (the
audit events by which code outside Python is reached), so the file's last content stays
when its name goes. (A C extension that writes and removes a file with no such event
between is not seen.) Where the Python line alone seals the run, code outside Python does
not see the overlay's files, so cannot remove them.

The folder is dpprof's own (a temporary one, removed at :meth:`SharedFiles.close`); the
user's files are never touched."""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from dpprof.script.overlay_changes import Change
from dpprof.script.real_fs import REAL_CALLS, lstat_or_none, makedirs

# the audit events before which code outside Python may remove a file of the run's
_OUTSIDE_PYTHON_EVENTS = frozenset({
    "subprocess.Popen", "os.system", "os.posix_spawn", "os.exec", "os.spawn", "os.fork",
    "ctypes.call_function"})
# the SharedFiles whose watch is on (rank 0's run); the audit hook, once added, stays
_WATCHING: list[SharedFiles] = []
_HOOKED: list[bool] = []

__all__ = ["Seeded", "SharedFiles"]


class Seeded:
    """What was laid into one run's overlay: files (path -> size and modification time,
    as laid) and the folders made for them, by canonical path."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[int, int]] = {}
        self.folders: set[str] = set()

    def holds(self, ch: Change) -> bool:
        """Whether ``ch`` is what was laid, unchanged by the run (not the run's write)."""
        if ch.kind == "folder":
            return ch.path in self.folders
        return ch.kind == "file" and self.files.get(ch.path) == (ch.size_bytes, ch.mtime_ns)


class SharedFiles:
    """Rank 0's files, kept for the later ranks' runs (see the module)."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="dpprof-shared-")
        # rank 0's run under the kernel's overlay: (upper layer, the folder it overlays),
        # and the folder of hard links to their files, by canonical path
        self._uppers: list[tuple[str, str]] = []
        self._held = ""

    def watch(self, uppers: Sequence[tuple[str, str]], held: str) -> None:
        """Rank 0's run: until :meth:`unwatch`, before code outside Python runs, hold a
        link to each file in the ``uppers`` (upper layer, the folder it overlays) under
        ``held`` (a folder of the same filesystem), by canonical path."""
        self._uppers, self._held = list(uppers), held
        if not _HOOKED:
            sys.addaudithook(_audit)
            _HOOKED.append(True)
        _WATCHING.append(self)

    def unwatch(self) -> None:
        if self in _WATCHING:
            _WATCHING.remove(self)

    def hold(self) -> None:
        """A link to each file now in the upper layers (one already held for another
        file at that path replaced)."""
        for upper, folder in self._uppers:
            for up, rel in _files_under(upper, ""):
                dst = self._held + os.path.join(folder, rel)
                st, had = lstat_or_none(up), lstat_or_none(dst)
                if st is None or (had is not None and had.st_ino == st.st_ino):
                    continue
                try:
                    if had is not None:
                        REAL_CALLS["unlink"](dst)
                    makedirs(os.path.dirname(dst))
                    REAL_CALLS["link"](up, dst)
                except OSError:  # not held: as if removed through Python, unkept
                    continue

    def publish(self, removed: str, changes: Iterable[Change]) -> None:
        """Keep rank 0's files: at each path, of those it removed or renamed away (copies
        under ``removed`` by canonical path) and those held (:meth:`watch`), the later;
        then those its overlays hold at its end (``changes``), the last of all."""
        self.unwatch()
        latest: dict[str, tuple[int, str]] = {}
        for top in (self._held, removed):
            for concrete, rel in _files_under(top, "") if top else ():
                st = lstat_or_none(concrete)
                c = "/" + rel
                if st is not None and (c not in latest or st.st_mtime_ns > latest[c][0]):
                    latest[c] = (st.st_mtime_ns, concrete)
        for c, (_, concrete) in sorted(latest.items()):
            self._put(concrete, self.folder + c)
        for ch in changes:
            if ch.kind == "file" and ch.concrete:
                self._put(ch.concrete, self.folder + ch.path)

    def _put(self, src: str, dst: str) -> None:
        try:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if os.path.isdir(dst) and not os.path.islink(dst):
                shutil.rmtree(dst)
            shutil.copy2(src, dst)
        except OSError:  # a file that cannot be kept is not shown to the later ranks
            pass

    def paths(self) -> list[str]:
        """The canonical paths of the files kept."""
        out = []
        for top, _, names in os.walk(self.folder):
            for name in names:
                p = os.path.join(top, name)
                if stat.S_ISREG(os.lstat(p).st_mode):
                    out.append(p[len(self.folder):])
        return sorted(out)

    def seed_into(self, upper_of: Callable[[str], str | None], seeded: Seeded) -> None:
        """Lay the files kept into a run's overlay: ``upper_of`` names where the file at a
        canonical path goes (None: not this overlay's); what was laid added to
        ``seeded``."""
        for c in self.paths():
            dst = upper_of(c)
            if dst is None:
                continue
            made = _missing_folders(os.path.dirname(dst), os.path.dirname(c))
            try:
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.copy2(self.folder + c, dst)
            except OSError:
                continue
            st = os.lstat(dst)
            seeded.files[c] = (st.st_size, st.st_mtime_ns)
            seeded.folders.update(made)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    # every audited event comes here: those it does not watch return at once
    if event in _OUTSIDE_PYTHON_EVENTS and _WATCHING:
        _WATCHING[-1].hold()


def _files_under(top: str, rel: str) -> list[tuple[str, str]]:
    """The regular files under ``top`` (their path, and it relative to ``top``), read with
    the real calls (the seal patches :mod:`os` while a run is on)."""
    out: list[tuple[str, str]] = []
    try:
        entries = list(REAL_CALLS["scandir"](os.path.join(top, rel) if rel else top))
    except OSError:
        return out
    for e in entries:
        r = os.path.join(rel, e.name) if rel else e.name
        st = lstat_or_none(e.path)
        if st is None:
            continue
        if stat.S_ISDIR(st.st_mode):
            out.extend(_files_under(top, r))
        elif stat.S_ISREG(st.st_mode):
            out.append((e.path, r))
    return out


def _missing_folders(upper_dir: str, c_dir: str) -> list[str]:
    """The canonical folders, down to ``c_dir``, whose overlay folder (down to
    ``upper_dir``) does not exist yet and that have no real folder either (made new)."""
    out = []
    while not os.path.lexists(upper_dir) and c_dir not in ("/", ""):
        if not os.path.isdir(c_dir):
            out.append(c_dir)
        upper_dir, c_dir = os.path.dirname(upper_dir), os.path.dirname(c_dir)
    return out
