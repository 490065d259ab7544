"""The filesystem the ranks share: rank 0's run is sealed into an overlay of its own, so a
later rank's run (:mod:`dpprof.script.rank_runs`) would not see what rank 0 wrote, as every
rank does on a machine whose ranks share a filesystem (the checkpoint rank 0 saves, waits
at a barrier for, and every rank loads).

Rank 0's run has ended before any other rank's starts, so a later rank is shown, at each
path, the last content rank 0's run wrote there, even where rank 0 removed or renamed it
afterwards (it did so after the barrier the others read it behind): :meth:`SharedFiles.publish`
keeps rank 0's files (the seal keeps a copy of each file the run removes or renames away,
before it goes), and :meth:`SharedFiles.seed_into` lays them into a later rank's overlay
before its run. Reads then see its own writes first, then rank 0's, then the real files;
its writes go into its own overlay, and the seeded files are not listed as its writes.
The folder is dpprof's own (a temporary one, removed at :meth:`SharedFiles.close`); the
user's files are never touched."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable

from dpprof.script.overlay import Change

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

    def publish(self, removed: str, changes: Iterable[Change]) -> None:
        """Keep rank 0's files: those it removed or renamed away (copies under ``removed``
        by canonical path), then those its overlays hold at its end (``changes``; later
        content at a path wins)."""
        if os.path.isdir(removed):
            shutil.copytree(removed, self.folder, symlinks=True, dirs_exist_ok=True)
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


def _missing_folders(upper_dir: str, c_dir: str) -> list[str]:
    """The canonical folders, down to ``c_dir``, whose overlay folder (down to
    ``upper_dir``) does not exist yet and that have no real folder either (made new)."""
    out = []
    while not os.path.lexists(upper_dir) and c_dir not in ("/", ""):
        if not os.path.isdir(c_dir):
            out.append(c_dir)
        upper_dir, c_dir = os.path.dirname(upper_dir), os.path.dirname(c_dir)
    return out
