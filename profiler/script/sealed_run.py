"""One run of the script, sealed from start to end (:class:`SealedRun`): the kernel overlay
where the process has its own mount namespace (:mod:`dpprof.script.namespace`), the Python
seal over a fresh overlay (:mod:`dpprof.script.seal`), and after the run: what it wrote, the
check that the user's files are as they were (:mod:`dpprof.script.census`), and a copy of its
writes where ``--keep-writes`` asks (``DIR/<run>/`` + the absolute path of each file, and
``DIR/<run>/writes.txt`` listing them, removals too)."""

from __future__ import annotations

import _thread
import atexit
import contextlib
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field

from dpprof.script import census, census_ahead, leftover_processes, namespace
from dpprof.script.census import Difference, Snapshot
from dpprof.script.overlay_changes import Change
from dpprof.script.real_fs import rmtree
from dpprof.script.seal import Seal, SealedWrite
from dpprof.script.shared_files import SharedFiles

__all__ = ["SealOutcome", "SealedRun", "finish_removals", "folders_of", "prepare_process",
           "take_census", "written_but_missing"]


@dataclass
class SealOutcome:
    """What the seal saw of one run."""

    writes: list[SealedWrite] = field(default_factory=list)
    # the user's files found not as they were after the run (the seal's check; none expected)
    differences: list[Difference] = field(default_factory=list)
    kernel: bool = False  # the kernel line held this run
    breach: str | None = None  # the line of a write the audit hook stopped
    subprocesses: list[str] = field(default_factory=list)  # commands the script started
    # the processes it started that still ran at its end, ended before the seal was lifted
    ended_processes: list[str] = field(default_factory=list)
    checked_entries: int = 0  # files and folders compared after the run
    checked_complete: bool = True  # all of them (not cut at the census' limit)
    kept: str | None = None  # where --keep-writes put them
    # the seal's own seconds in the run's thread: "before" the run (its set-up, the mounts
    # among it: "mount"), "after" it (what it wrote, the check: "check"; the overlays off
    # among it: "unmount"), in Python's file calls through it while the run was under way
    # ("calls": :mod:`dpprof.script.sealed_calls`), and in the audit hook's checks of the
    # events it watches ("hook"; the hook is called on each of ``hook_events`` audited events)
    seconds: dict[str, float] = field(default_factory=dict)
    hook_events: int = 0


def written_but_missing(error: BaseException, outcome: SealOutcome) -> str | None:
    """A file the run wrote that ``error`` (the script's, or one it was raised from) says
    was not there, where no kernel line held the run: the overlay that holds it is Python's
    alone, so code outside Python (a C or C++ library's own reader) looked for it on the
    real filesystem. None where the error names no such file."""
    if outcome.kernel:
        return None
    written = {w.path for w in outcome.writes if w.kind == "file"}
    folders = [w.path for w in outcome.writes if w.kind == "folder"]
    seen: set[int] = set()
    at: BaseException | None = error
    unnamed = False  # a native library's own "No such file or directory" with no path
    while at is not None and id(at) not in seen:
        seen.add(id(at))
        if isinstance(at, FileNotFoundError):
            named = [at.filename] if isinstance(at.filename, str) else []
            # a library's own message ("Failed to open local file '/x/y.arrow'")
            named += re.findall(r"'(/[^']+)'", str(at))
            for path in named:
                if os.path.realpath(path) in written:
                    return os.path.realpath(path)
        unnamed = unnamed or bool(_NO_SUCH_FILE.search(str(at)))
        at = at.__cause__ or at.__context__
    if unnamed and folders:
        # Rust's (HF tokenizers' Tokenizer.save) and C's own writers into a folder the run
        # made through Python, which holds it where they do not look
        return f"a file in {' or '.join(folders[-3:])}"
    return None


# the OS's words for ENOENT, as a library outside Python passes them on (Rust's io::Error:
# "No such file or directory (os error 2)")
_NO_SUCH_FILE = re.compile(r"No such file or directory|os error 2\b")


def prepare_process() -> None:
    """The process's own temporary folders made before any run, outside its seal: Python
    caches them for the process (``tempfile``'s, and ``multiprocessing``'s, where a
    DataLoader's workers bind the sockets that pass tensors), and one made inside a run's
    overlay would be gone for the next run (and a socket cannot be bound inside an overlay
    only Python sees). ``multiprocessing`` removes its folder when the process ends. And
    the process adopts the orphans among what the runs start (their subreaper)."""
    import multiprocessing.util

    tempfile.gettempdir()
    multiprocessing.util.get_temp_dir()
    # the processes a run starts stay dpprof's descendants however they detach, so that
    # those still running as it ends are found (dpprof.script.leftover_processes)
    leftover_processes.adopt_orphans()


def take_census(script: str | None, keep_dir: str | None) -> Snapshot:
    """The user's files before the runs (:mod:`dpprof.script.census`): the working
    directory and the script's folder, the writes kept (``keep_dir``) left out; walked in
    full where no mount namespace holds the writes, the shallowest where one does (and there
    only the files with another link watched by their inode: :mod:`dpprof.script.census`).
    The census taken ahead as ``dpprof run`` started, where it is this one
    (:mod:`dpprof.script.census_ahead`)."""
    started = time.perf_counter()
    folders, exclude = folders_of(script), [keep_dir] if keep_dir else []
    snap = census_ahead.claim(folders, exclude)
    if snap is None:
        limit, every_inode = census_ahead.settings()
        snap = census.take(folders, exclude, limit, every_inode=every_inode)
        snap.waited_s = time.perf_counter() - started
    return snap


def folders_of(script: str | None) -> list[str]:
    """The folders the census walks: the working directory and the script's folder."""
    folders = [os.getcwd()]
    if script:
        folders.append(os.path.dirname(os.path.abspath(script)))
    return folders


# the removals of ended runs' overlays, under way in threads of their own: each holds its
# lock until it is done
_REMOVING: list[_thread.LockType] = []


def _remove_later(kernel: namespace.KernelOverlay | None, base: str) -> None:
    """A run's overlay (its stage, unmounted, or its folder) removed in a thread: nothing
    waits on it (the user's folders are back, or were never covered; the overlay is dpprof's
    private folder), and the next run's set-up, or the result's, goes on meanwhile. Joined
    by :func:`finish_removals`. A bare thread (``_thread``): ``Thread.start`` would wait
    until the new thread runs, on a loaded machine a wait of milliseconds."""
    def remove() -> None:
        try:
            if kernel is not None:
                kernel.close(chdir=False)
                return
            try:
                rmtree(base)
            except OSError:  # a folder the run made read-only: what can be removed
                shutil.rmtree(base, ignore_errors=True)
        finally:
            done.release()

    done = _thread.allocate_lock()
    done.acquire()
    try:
        _thread.start_new_thread(remove, ())
    except RuntimeError:  # no new threads (the interpreter is ending): removed here
        remove()
    _REMOVING.append(done)


def finish_removals() -> None:
    """Wait for the overlays of the runs that ended to be removed: before a seal goes on
    (their removal calls :mod:`os`, whose functions a seal replaces), and before ``dpprof
    run`` ends."""
    while _REMOVING:
        done = _REMOVING[0]
        done.acquire()
        done.release()
        _REMOVING.pop(0)


atexit.register(finish_removals)  # a process that ends before joining them (bare threads)


class SealedRun:
    """One run sealed (see the module); ``with SealedRun(...) as seal:`` around the run,
    then :attr:`outcome`.

    ``name``: the run's (its folder under ``keep_dir``); ``script``: its file (None for
    ``python -m``); ``before``: the census taken before the runs (None: taken here);
    ``publish_to``: rank 0's run, whose files later ranks see there; ``seed_from``: a later
    rank's run, shown rank 0's files (:mod:`dpprof.script.shared_files`)."""

    def __init__(self, name: str, script: str | None, keep_dir: str | None = None,
                 before: Snapshot | None = None, publish_to: SharedFiles | None = None,
                 seed_from: SharedFiles | None = None) -> None:
        self.name = name
        self.publish_to = publish_to
        self.seed_from = seed_from
        self.script = script
        self.keep_dir = os.path.abspath(keep_dir) if keep_dir else None
        self.before = before
        self.outcome = SealOutcome()
        self._kernel: namespace.KernelOverlay | None = None
        self._base = ""  # private: the overlay's root and the clock file
        self._root = ""
        self._seal: Seal | None = None
        self._cwd = ""
        self._children: set[int] = set()  # the processes running as the run began

    def __enter__(self) -> Seal:
        started = time.perf_counter()
        finish_removals()  # before this seal patches the os functions they call
        self._cwd = os.getcwd()
        prepare_process()
        if self.before is None:
            self.before = take_census(self.script, self.keep_dir)
        trees: list[str] = []
        if namespace.entered():
            folders = namespace.sealed_folders([
                *folders_of(self.script), os.path.expanduser("~"), tempfile.gettempdir(),
                "/tmp", "/var/tmp"])
            kernel = namespace.KernelOverlay(folders)
            try:
                mounting = time.perf_counter()
                kernel.mount()
                self.outcome.seconds["mount"] = time.perf_counter() - mounting
                self._kernel, trees, self._base = kernel, folders, kernel.stage
            except OSError:  # this run keeps the Python line and the check after it
                pass
        if not self._base:
            self._base = tempfile.mkdtemp(prefix="dpprof-writes-")
            census.watch_every_inode(self.before)  # no kernel line holds this run
        self._root = os.path.join(self._base, "py")
        if not os.path.isdir(self._root):
            os.mkdir(self._root, 0o700)
        seal = self._seal = Seal(self._root, trees, clock=os.path.join(self._base, "clock"))
        self.outcome.kernel = bool(trees)
        if self.publish_to is not None:
            seal.removed_copies = os.path.join(self._base, "removed")
            if self._kernel is not None:  # what code outside Python removes, held
                self.publish_to.watch(self._kernel.uppers(), os.path.join(self._base, "held"))
        if self.seed_from is not None:
            def upper_of(c: str) -> str:
                # a tree the kernel overlays: written through its overlay (its upper layer)
                return c if seal.in_kernel_tree(c) else seal.overlay.upper(c)

            self.seed_from.seed_into(upper_of, seal.seeded)
            if seal.seeded.files:
                seal.overlay.dirty = True
        self._children = leftover_processes.children()  # dpprof's own (the census')
        entered = seal.__enter__()
        self.outcome.seconds["before"] = time.perf_counter() - started
        return entered

    def _excluded(self) -> list[str]:
        shared = [s.folder for s in (self.publish_to, self.seed_from) if s is not None]
        return [p for p in (self.keep_dir, self._base, *shared) if p]

    def __exit__(self, *exc: object) -> None:
        assert self._seal is not None
        seal, out = self._seal, self.outcome
        started = time.perf_counter()
        if self.publish_to is not None:
            self.publish_to.unwatch()
        try:
            seal.__exit__(*exc)
            # while the overlays still hold what they write (dpprof.script.leftover_processes;
            # its reads of /proc are dpprof's own, past Python's seal)
            out.ended_processes = leftover_processes.end_leftovers(self._children)
            kernel_changes: list[Change] = []
            if self._kernel is not None:
                unmounting = time.perf_counter()
                self._kernel.unmount_trees()
                out.seconds["unmount"] = time.perf_counter() - unmounting
                kernel_changes = self._kernel.changes()
            out.writes = seal.writes(kernel_changes)
            out.subprocesses = list(seal.lines.subprocesses)
            out.breach = seal.breach.line() if seal.breach is not None else None
            if self.publish_to is not None:  # the real folders show again: kept outside
                self.publish_to.publish(seal.removed_copies,
                                        [*seal.overlay.changes(), *kernel_changes])
            with contextlib.suppress(OSError):
                os.chdir(self._cwd)  # the next run starts where this one did
            if self.keep_dir:
                out.kept = self._keep(out.writes, [*seal.overlay.changes(), *kernel_changes])
        finally:
            _remove_later(self._kernel, self._base)
        assert self.before is not None
        checking = time.perf_counter()
        after = census.again(self.before, self._excluded())
        out.differences = census.differences(self.before, after, seal.overlay.touched_real)
        out.checked_entries = len(self.before.entries) + len(seal.overlay.touched_real)
        out.checked_complete = self.before.complete
        done = time.perf_counter()
        out.seconds["check"] = done - checking
        out.seconds["after"] = done - started
        out.seconds["calls"] = seal.lines.calls_s
        out.seconds["hook"] = seal.lines.hook_s
        out.hook_events = seal.lines.hook_events

    def _keep(self, writes: list[SealedWrite], changes: list[Change]) -> str:
        """The run's writes copied under ``keep_dir/<name>``, with a list of them."""
        assert self.keep_dir is not None
        dest = os.path.join(self.keep_dir, self.name)
        os.makedirs(dest, exist_ok=True)
        where = {c.path: c.concrete for c in changes if c.concrete}
        lines = []
        for w in writes:
            flag = " emulated values" if w.emulated_values else ""
            lines.append(f"{w.kind}\t{w.size_bytes}\t{w.path}{flag}")
            target = os.path.join(dest, w.path.lstrip("/"))
            if w.kind == "folder":
                os.makedirs(target, exist_ok=True)
            elif w.kind in ("file", "link") and w.path in where:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                if w.kind == "link":
                    with contextlib.suppress(FileExistsError):
                        os.symlink(os.readlink(where[w.path]), target)
                else:
                    shutil.copyfile(where[w.path], target)
        with open(os.path.join(dest, "writes.txt"), "w") as f:
            f.write("\n".join(lines) + ("\n" if lines else ""))
        return dest
