"""The seal: a run of the script writes nothing into the user's filesystem.

Every run (as written, each alternative, each rung) gets a fresh private
:class:`~dpprof.script.overlay.Overlay`, and while it runs:

* **Python's file calls go through it** (:mod:`dpprof.script.sealed_calls`). ``open`` /
  ``io.open``, and the :mod:`os` functions that name a path (``open``, ``stat``,
  ``listdir``, ``scandir``, ``remove``, ``rename``, ``replace``, ``mkdir``, ``rmdir``,
  ``truncate``, ``symlink``, ``link``, ``chmod``, ``utime``, ``chdir``, the ``xattr``
  calls...) read the view and write into the overlay, wherever the
  path points (the working directory, an absolute path, ``~/.cache``, ``/tmp``). What is
  built on them follows: :mod:`os.path`, :mod:`pathlib`, :mod:`shutil` (its ``rmtree`` by
  path), :mod:`tempfile`, :mod:`glob`, :mod:`gzip`, NumPy, Pillow, ``logging``. A module
  that bound one of them by name before the run (``from os import replace``; ``tarfile``'s
  ``bltn_open``) has that name patched too. Reads of files the run did not write are the real
  files, untouched.
* **Code that opens a path outside Python** (safetensors' Rust writer and ``safe_open``,
  h5py, sqlite3, OpenCV) is handed the overlay's path at the call
  (:mod:`dpprof.script.outside_python`; a module the script imports later is patched as it
  loads).
* **A second line** for what bypasses both: where the process has its own mount namespace
  (:mod:`dpprof.script.namespace`) the kernel overlays the working directory, the script's
  folder, the home folder and the temporary folders, so any writer (C, Rust, a subprocess)
  writes into the run's overlay there (those trees then pass through the Python line); without
  it, an audit hook stops the run at a write that reached a real path around the Python line
  (:mod:`dpprof.script.seal_audit`), naming the path.
* **Logging services get no stand-in values**: wandb and SwanLab disabled, Comet, Neptune and
  ClearML offline, MLflow into a local store (in the overlay), by their environment variables.
* Python writes no bytecode beside the user's modules (``sys.dont_write_bytecode``).

After the run, :meth:`Seal.writes` lists what the run left in its overlay, and
:mod:`dpprof.script.census` checks that the user's files are as they were.
"""

from __future__ import annotations

import builtins
import functools
import io
import os
import shutil
import stat
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dpprof.emulator.patcher import Patcher
from dpprof.script.bound_names import patch_bound_names, patch_held_openers
from dpprof.script.import_hook import ImportHook
from dpprof.script.outside_python import OUTSIDE_PYTHON, patch_loaded, patch_outside
from dpprof.script.overlay import Overlay
from dpprof.script.overlay_changes import Change
from dpprof.script.real_fs import REAL_CALLS, REAL_OPEN, as_given, fd_path, lstat_or_none, makedirs
from dpprof.script.seal_audit import SealBreach, events_seen, install_audit_hook
from dpprof.script.sealed_calls import (
    OS_WRAPPERS,
    WRITE_FLAGS,
    WRITE_MODE,
    active,
    make_active,
    sealed_open,
)
from dpprof.script.shared_files import Seeded

__all__ = ["LOGGING_SERVICES", "STAND_IN_MAGIC", "Seal", "SealBreach", "SealedWrite", "active"]

# the first bytes of a file that stands for a checkpoint of emulated tensors
# (:mod:`dpprof.script.effects`): it is listed as holding emulated values wherever it moves
STAND_IN_MAGIC = b"DPPROF-EMULATED\n"

# Logging services: no stand-in values reach them; what they keep locally goes into the
# overlay. name -> (variable, value); ``{cwd}`` is the working directory.
LOGGING_SERVICES: dict[str, tuple[str, str]] = {
    "wandb": ("WANDB_MODE", "disabled"),
    "wandb (transformers)": ("WANDB_DISABLED", "true"),
    "SwanLab": ("SWANLAB_MODE", "disabled"),
    "Comet": ("COMET_START_ONLINE", "0"),
    "Comet (older clients)": ("COMET_MODE", "offline"),
    "Neptune": ("NEPTUNE_MODE", "offline"),
    "ClearML": ("CLEARML_OFFLINE_MODE", "1"),
    "MLflow": ("MLFLOW_TRACKING_URI", "file://{cwd}/mlruns"),
}

# paths no run writes into a file of the user's through (devices, the kernel's own files);
# /dev/shm holds files and is sealed as any folder
_PASS_PREFIXES = ("/proc/", "/sys/", "/dev/")
_SEALED_DEV = "/dev/shm/"

# id(a real function) -> the function the seal puts in its place (names bound to one before
# the run are patched too); the real ones never change: built once
_WRAPPER_OF: dict[int, Any] = {id(REAL_OPEN): sealed_open, **{
    id(REAL_CALLS[n]): w for n, w in OS_WRAPPERS.items() if n in REAL_CALLS}}


@dataclass
class SealedWrite:
    """One thing a run left in its overlay, as the report lists it."""

    path: str  # canonical
    kind: str  # "file" | "folder" | "link" | "removed"
    size_bytes: int = 0
    emulated_values: bool = False
    replaced: bool = False  # in place of a file of the user's (which is untouched)


@dataclass
class _Lines:
    """What the seal saw besides the writes: subprocesses (outside the Python line)."""

    subprocesses: list[str] = field(default_factory=list)
    # seconds in Python's file calls through the seal (:mod:`dpprof.script.sealed_calls`)
    calls_s: float = 0.0
    # the audit hook's cost: seconds in its checks of the events it watches, and the audited
    # events it was called on while the run was under way
    hook_s: float = 0.0
    hook_events: int = 0


def _as_the_descriptor_walk(islink: Callable[..., bool]) -> Callable[..., bool]:
    """shutil's check of rmtree's path on its walk by path, made to fail as its walk by
    descriptor does (the one plain Python takes on Linux): that one opens the path,
    following a link, before it refuses a link, so a link whose target is gone is
    FileNotFoundError there, not "Cannot call rmtree on a symbolic link"."""
    def checked(path: Any, *args: Any) -> bool:
        if not islink(path, *args):
            return False
        if isinstance(path, (str, bytes, os.PathLike)):
            os.stat(path)  # through the seal: the view's target, or FileNotFoundError
        return True

    return checked


class Seal:
    """The seal of one run; a context manager (see the module).

    ``root``: an empty private folder for the overlay; ``kernel_trees``: the folders the
    kernel line seals for this run (their paths pass through); ``clock``: a private file
    (outside ``root``) whose modification time marks the run's first value read from an
    emulated tensor (:meth:`note_stand_in`), on the clock files are stamped by."""

    def __init__(self, root: str, kernel_trees: Sequence[str] = (), clock: str = "") -> None:
        self.overlay = Overlay(root)
        self.kernel_trees = tuple(t.rstrip("/") or "/" for t in kernel_trees)
        self._kernel_prefixes = tuple(t + "/" for t in self.kernel_trees if t != "/")
        self.clock = clock or self.overlay.root + ".clock"
        self.stand_ins_since_ns: int | None = None
        self.lines = _Lines()
        self.breach: SealBreach | None = None
        self._patcher = Patcher()
        self._previous: Seal | None = None
        self._finder: ImportHook | None = None
        self._saved_env: dict[str, str | None] = {}
        self._held_openers: list[tuple[dict[Any, Any], Any, Any]] = []
        self._bytecode = sys.dont_write_bytecode
        self._events_before = 0
        # a path as opened (absolute, or the working directory and it) -> the run's own file
        # it led to, while the overlay is at ``_own_generation`` (:meth:`open_path`)
        self._own_files: dict[str, str] = {}
        self._own_generation = 0
        # rank 0's run, where later ranks run (dpprof.script.shared_files): a private folder
        # that keeps, by canonical path, each file the run removes or renames away
        self.removed_copies = ""
        # a later rank's run: rank 0's files laid into its overlays (not its writes)
        self.seeded = Seeded()

    # ---- activation ------------------------------------------------------------------

    def __enter__(self) -> Seal:
        self._previous = make_active(self)
        p = self._patcher.patch
        p(builtins, "open", sealed_open)
        p(io, "open", sealed_open)
        for name, wrapper in OS_WRAPPERS.items():
            if name in REAL_CALLS:
                p(os, name, wrapper)
        # rmtree by path, through the patched os (its descriptor-relative walk would not be)
        p(shutil, "_use_fd_functions", False)
        if hasattr(shutil, "_rmtree_islink"):
            p(shutil, "_rmtree_islink", _as_the_descriptor_walk(shutil._rmtree_islink))
        wrappers = dict(_WRAPPER_OF)
        for module, name, pos, kw, how in OUTSIDE_PYTHON:
            loaded = sys.modules.get(module)
            if loaded is not None:
                patch_outside(self._patcher, loaded, name, pos, kw, how, wrappers)
        patch_bound_names(self._patcher, wrappers)
        self._held_openers = patch_held_openers(wrappers)
        self._finder = ImportHook({m for m, *_ in OUTSIDE_PYTHON},
                                  functools.partial(patch_loaded, self._patcher))
        sys.meta_path.insert(0, self._finder)
        sys.dont_write_bytecode = True
        cwd = self.overlay.from_upper(REAL_CALLS["getcwd"]())
        for var, value in LOGGING_SERVICES.values():
            self._saved_env[var] = os.environ.get(var)
            os.environ[var] = value.format(cwd=cwd)
        # last, before the run: the scan of every module for names bound above calls id()
        # on each value, an audited event (a run's first scan reads thousands of modules)
        install_audit_hook(kernel_line=bool(self.kernel_trees))
        self._events_before = events_seen()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._finder is not None and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        for table, key, original in reversed(self._held_openers):
            table[key] = original
        self._patcher.restore()
        sys.dont_write_bytecode = self._bytecode
        for var, value in self._saved_env.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        cwd = REAL_CALLS["getcwd"]()
        if self.overlay.in_root(cwd):  # the script changed into a folder only the run made
            REAL_CALLS["chdir"](self._nearest_real(self.overlay.from_upper(cwd)))
        make_active(self._previous)
        self.lines.hook_events = events_seen() - self._events_before

    def _nearest_real(self, c: str) -> str:
        while not os.path.isdir(c):
            c = os.path.dirname(c)
        return c

    # ---- paths -----------------------------------------------------------------------

    def canon(self, p: Any, dir_fd: int | None = None, *, write: bool) -> str | None:
        """The canonical path the overlay holds ``p`` under, or None where the call passes
        through untouched: a file descriptor, a device or the kernel's files, a tree the
        kernel line seals, or a read before the run wrote or removed anything."""
        if type(p) is str:  # the common case first: a path as a string
            if not write and not self.overlay.dirty:
                return None
            s = p
        else:
            if isinstance(p, int) or (not write and not self.overlay.dirty):
                return None
            try:
                s = os.fsdecode(os.fspath(p))
            except TypeError:
                return None
        if dir_fd is not None and not s.startswith("/"):
            s = os.path.join(fd_path(dir_fd), s)
        a = self.overlay.absolute(s)
        if self.passes(a):
            return None
        c = self.overlay.resolved(a)
        if self.in_kernel_tree(c):
            return None
        return c

    @staticmethod
    def passes(a: str) -> bool:
        """Whether the absolute path ``a`` is a device or the kernel's files (a call there
        passes through: no run writes into a file of the user's through it)."""
        return (a.startswith(_PASS_PREFIXES) or a in ("/dev", "/proc", "/sys")) \
            and not a.startswith(_SEALED_DEV)

    def keep_before_removal(self, p: Any, dir_fd: int | None) -> None:
        """Where :attr:`removed_copies` is set: a copy of the file ``p`` names (as the view
        has it) kept there before the run removes it or renames it away."""
        if not self.removed_copies or isinstance(p, int):
            return
        try:
            s = os.fsdecode(os.fspath(p))
            if dir_fd is not None and not s.startswith("/"):
                s = os.path.join(fd_path(dir_fd), s)
            c = self.overlay.canonical(self.overlay.absolute(s))
            at = self.canon(c, write=False)
            concrete = c if at is None else self.overlay.for_read(at, p, follow_symlinks=False)
            st = lstat_or_none(concrete)
            if st is None or not stat.S_ISREG(st.st_mode):
                return
            dst = self.removed_copies + c
            makedirs(os.path.dirname(dst))
            with REAL_OPEN(concrete, "rb") as a, REAL_OPEN(dst, "wb") as b:
                shutil.copyfileobj(a, b)
            REAL_CALLS["utime"](dst, ns=(st.st_atime_ns, st.st_mtime_ns))
        except (OSError, ValueError, TypeError):  # the removal itself says what is wrong
            return

    def in_kernel_tree(self, c: str) -> bool:
        """Whether the kernel line seals the canonical path ``c`` (it passes through here)."""
        if not self.kernel_trees:
            return False
        return c in self.kernel_trees or c.startswith(self._kernel_prefixes) \
            or "/" in self.kernel_trees

    def open_path(self, file: Any, mode: str) -> Any:
        """Where ``open(file, mode)`` opens. A path the run opened before that led to a file
        of its own in the overlay (a checkpoint or a log written at every step) leads there
        again while the view is as it was (no link, removal or rename since:
        :attr:`Overlay.generation`) and the file is still a file: one look at it."""
        key = ""
        if type(file) is str and "x" not in mode and self.overlay.dirty:
            key = file if file.startswith("/") else f"{REAL_CALLS['getcwd']()}\0{file}"
            own = self._own_files.get(key)
            if own is not None and self._own_generation == self.overlay.generation:
                st = lstat_or_none(own)
                if st is not None and stat.S_ISREG(st.st_mode):
                    return own
        write = not WRITE_MODE.isdisjoint(mode)
        c = self.canon(file, write=write)
        if c is None:
            return file
        if write:
            concrete = self.overlay.for_write(
                c, file, create="w" in mode or "a" in mode or "x" in mode,
                truncate="w" in mode, exclusive="x" in mode)
        else:
            concrete = self.overlay.for_read(c, file)
        if key and self.overlay.in_root(concrete):
            if self._own_generation != self.overlay.generation:
                self._own_files.clear()
                self._own_generation = self.overlay.generation
            if len(self._own_files) < 10_000:
                self._own_files[key] = concrete
        return as_given(file, concrete)

    def open_flags_path(self, path: Any, flags: int, dir_fd: int | None) -> Any:
        """Where ``os.open(path, flags)`` opens (None: as given)."""
        write = bool(flags & WRITE_FLAGS)
        c = self.canon(path, dir_fd, write=write)
        if c is None:
            return None
        if write:
            concrete = self.overlay.for_write(
                c, path, create=bool(flags & os.O_CREAT), truncate=bool(flags & os.O_TRUNC),
                exclusive=bool(flags & os.O_CREAT and flags & os.O_EXCL),
                follow_symlinks=not flags & getattr(os, "O_NOFOLLOW", 0))
        else:
            concrete = self.overlay.for_read(
                c, path, follow_symlinks=not flags & getattr(os, "O_NOFOLLOW", 0))
        return as_given(path, concrete)

    def read_path(self, p: Any) -> Any:
        """The concrete path that holds ``p`` for reading (as given where it passes)."""
        c = self.canon(p, write=False)
        return p if c is None else as_given(p, self.overlay.for_read(c, p))

    def write_path(self, p: Any, how: str) -> Any:
        """The concrete path to hand to a writer that opens ``p`` itself: ``how`` "w" (it
        writes the file anew), "a" (it keeps and changes what the file holds, or creates
        it), "r+" (the same, the file must exist), "x" (it creates it, failing where it
        exists)."""
        c = self.canon(p, write=True)
        if c is None:
            return p
        concrete = self.overlay.for_write(c, p, create=how != "r+", truncate=how == "w",
                                          exclusive=how == "x")
        return as_given(p, concrete)

    def note_stand_in(self) -> None:
        """The run read a value from an emulated tensor: the first time, the moment as the
        filesystem stamps files (its clock is coarser than ``time.time_ns``: a file written
        right after would look older)."""
        if self.stand_ins_since_ns is not None:
            return
        with REAL_OPEN(self.clock, "wb"):
            pass
        self.stand_ins_since_ns = int(REAL_CALLS["stat"](self.clock).st_mtime_ns)

    # ---- what the run left -------------------------------------------------------------

    def writes(self, kernel: Sequence[Change] = ()) -> list[SealedWrite]:
        """What the run wrote, made or removed (the Python line's and ``kernel``'s, the
        kernel line's), each with whether it holds emulated values: a stand-in checkpoint
        (:data:`STAND_IN_MAGIC`), or written after the run read a value from an emulated
        tensor."""
        since = self.stand_ins_since_ns
        out = []
        for ch in [*self.overlay.changes(), *kernel]:
            if self.seeded.holds(ch):
                continue
            emulated = False
            if ch.kind == "file":
                emulated = (since is not None and ch.mtime_ns >= since) or \
                    self._stand_in_file(ch)
            out.append(SealedWrite(ch.path, ch.kind, ch.size_bytes, emulated, ch.replaced))
        out.sort(key=lambda w: w.path)
        return out

    def _stand_in_file(self, ch: Change) -> bool:
        """Whether the file begins with :data:`STAND_IN_MAGIC` (gzip'd too)."""
        concrete = ch.concrete or self.overlay.upper(ch.path)
        try:
            with REAL_OPEN(concrete, "rb") as f:
                head = f.read(len(STAND_IN_MAGIC))
            if head.startswith(b"\x1f\x8b"):
                import gzip

                with gzip.GzipFile(fileobj=REAL_OPEN(concrete, "rb")) as g:
                    head = g.read(len(STAND_IN_MAGIC))
        except (OSError, EOFError):
            return False
        return head == STAND_IN_MAGIC
