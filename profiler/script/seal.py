"""The seal: a run of the script writes nothing into the user's filesystem.

Every run (as written, each alternative, each rung) gets a fresh private
:class:`~dpprof.script.overlay.Overlay`, and while it runs:

* **Python's file calls go through it.** ``open`` / ``io.open``, and the :mod:`os` functions
  that name a path (``open``, ``stat``, ``listdir``, ``scandir``, ``remove``, ``rename``,
  ``replace``, ``mkdir``, ``rmdir``, ``truncate``, ``symlink``, ``link``, ``chmod``, ``utime``,
  ``chdir``, the ``xattr`` calls...) read the view and write into the overlay, wherever the
  path points (the working directory, an absolute path, ``~/.cache``, ``/tmp``). What is
  built on them follows: :mod:`os.path`, :mod:`pathlib`, :mod:`shutil` (its ``rmtree`` by
  path), :mod:`tempfile`, :mod:`glob`, :mod:`gzip`, NumPy, Pillow, ``logging``. A module
  that bound one of them by name before the run (``from os import replace``; ``tarfile``'s
  ``bltn_open``) has that name patched too. Reads of files the run did not write are the real
  files, untouched.
* **Code that opens a path outside Python** (safetensors' Rust writer and ``safe_open``,
  h5py, sqlite3, OpenCV) is handed the overlay's path at the call
  (:data:`OUTSIDE_PYTHON`; a module the script imports later is patched as it loads).
* **A second line** for what bypasses both: where the process has its own mount namespace
  (:mod:`dpprof.script.namespace`) the kernel overlays the working directory, the script's
  folder, the home folder and the temporary folders, so any writer (C, Rust, a subprocess)
  writes into the run's overlay there (those trees then pass through this module); without it,
  an audit hook stops the run at a write that reached a real path around this module
  (:class:`SealBreach`), naming the path.
* **Logging services get no stand-in values**: wandb and SwanLab disabled, Comet, Neptune and
  ClearML offline, MLflow into a local store (in the overlay), by their environment variables.
* Python writes no bytecode beside the user's modules (``sys.dont_write_bytecode``).

After the run, :meth:`Seal.writes` lists what the run left in its overlay, and
:mod:`dpprof.script.census` checks that the user's files are as they were.
"""

from __future__ import annotations

import builtins
import errno
import functools
import io
import os
import shutil
import stat
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from dpprof.emulator.patcher import Patcher
from dpprof.script import overlay as ov
from dpprof.script.import_hook import ImportHook
from dpprof.script.overlay import Overlay
from dpprof.script.shared_files import Seeded

__all__ = ["LOGGING_SERVICES", "OUTSIDE_PYTHON", "STAND_IN_MAGIC", "Seal", "SealBreach",
           "SealedWrite", "active", "patch_bound_names"]

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

# Code that opens the path it is given outside Python: (module, name, position of the
# path, its keyword, what the call does with the file: "r" reads it, else as
# Seal.write_path's ``how``; "h5py": as h5py.File's mode says)
OUTSIDE_PYTHON: tuple[tuple[str, str, int, str, str], ...] = (
    ("safetensors", "serialize_file", 1, "filename", "w"),
    ("safetensors", "safe_open", 0, "filename", "r"),
    ("sqlite3", "connect", 0, "database", "a"),
    ("cv2", "imwrite", 0, "filename", "w"),
    ("cv2", "imread", 0, "filename", "r"),
    ("h5py", "File", 0, "name", "h5py"),
)

_WRITE_MODE = frozenset("wax+")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# paths no run writes into a file of the user's through (devices, the kernel's own files);
# /dev/shm holds files and is sealed as any folder
_PASS_PREFIXES = ("/proc/", "/sys/", "/dev/")
_SEALED_DEV = "/dev/shm/"

# the functions as they were before any seal patched them
_ORIG_OPEN = io.open
_ORIG: dict[str, Any] = {name: getattr(os, name) for name in (
    "open", "stat", "lstat", "access", "listdir", "scandir", "remove", "unlink", "rename",
    "replace", "mkdir", "rmdir", "truncate", "symlink", "link", "readlink", "chmod", "chown",
    "lchown", "utime", "chdir", "getcwd", "getcwdb", "mkfifo", "mknod", "setxattr",
    "removexattr", "getxattr", "listxattr") if hasattr(os, name)}


class SealBreach(BaseException):
    """A write reached a real path around the seal (no mount namespace to catch it): the
    run stops there, before the write happens. A BaseException, as ``StopScript``: the
    script's ``except Exception`` does not swallow it."""

    def __init__(self, path: str, how: str) -> None:
        super().__init__(path, how)
        self.path = path
        self.how = how

    def line(self) -> str:
        return (f"the script wrote to {self.path} ({self.how}) around the seal, which this "
                "machine has no mount namespace to catch: dpprof stopped the run before the "
                "write reached your file; run it where unprivileged user namespaces are "
                "allowed (sysctl kernel.unprivileged_userns_clone=1, or "
                "kernel.apparmor_restrict_unprivileged_userns=0)")


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


_ACTIVE: Seal | None = None


def active() -> Seal | None:
    """The seal of the run now under way, if any."""
    return _ACTIVE


def _fd_path(fd: int) -> str:
    return str(_ORIG["readlink"](f"/proc/self/fd/{fd}"))


def _like(given: Any, concrete: str) -> Any:
    """``concrete`` as the kind of path the script gave (bytes stay bytes)."""
    return os.fsencode(concrete) if isinstance(given, bytes) else concrete


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
        # rank 0's run, where later ranks run (dpprof.script.shared_files): a private folder
        # that keeps, by canonical path, each file the run removes or renames away
        self.removed_copies = ""
        # a later rank's run: rank 0's files laid into its overlays (not its writes)
        self.seeded = Seeded()

    # ---- activation ------------------------------------------------------------------

    def __enter__(self) -> Seal:
        global _ACTIVE
        self._previous, _ACTIVE = _ACTIVE, self
        _install_audit_hook()
        p = self._patcher.patch
        p(builtins, "open", _open)
        p(io, "open", _open)
        for name, wrapper in _OS_WRAPPERS.items():
            if name in _ORIG:
                p(os, name, wrapper)
        # rmtree by path, through the patched os (its descriptor-relative walk would not be)
        p(shutil, "_use_fd_functions", False)
        wrappers: dict[int, Any] = {id(_ORIG_OPEN): _open}
        wrappers.update({id(_ORIG[n]): w for n, w in _OS_WRAPPERS.items() if n in _ORIG})
        for module, name, pos, kw, how in OUTSIDE_PYTHON:
            loaded = sys.modules.get(module)
            if loaded is not None:
                _patch_outside(self._patcher, loaded, name, pos, kw, how, wrappers)
        patch_bound_names(self._patcher, wrappers)
        self._held_openers = _patch_held_openers(wrappers)
        self._finder = ImportHook({m for m, *_ in OUTSIDE_PYTHON},
                                  functools.partial(_patch_loaded, self._patcher))
        sys.meta_path.insert(0, self._finder)
        sys.dont_write_bytecode = True
        cwd = self.overlay.from_upper(_ORIG["getcwd"]())
        for var, value in LOGGING_SERVICES.values():
            self._saved_env[var] = os.environ.get(var)
            os.environ[var] = value.format(cwd=cwd)
        return self

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
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
        cwd = _ORIG["getcwd"]()
        if self.overlay.in_root(cwd):  # the script changed into a folder only the run made
            _ORIG["chdir"](self._nearest_real(self.overlay.from_upper(cwd)))
        _ACTIVE = self._previous

    def _nearest_real(self, c: str) -> str:
        while not os.path.isdir(c):
            c = os.path.dirname(c)
        return c

    # ---- paths -----------------------------------------------------------------------

    def canon(self, p: Any, dir_fd: int | None = None, *, write: bool) -> str | None:
        """The canonical path the overlay holds ``p`` under, or None where the call passes
        through untouched: a file descriptor, a device or the kernel's files, a tree the
        kernel line seals, or a read before the run wrote or removed anything."""
        if isinstance(p, int) or (not write and not self.overlay.dirty):
            return None
        try:
            s = os.fsdecode(os.fspath(p))
        except TypeError:
            return None
        if dir_fd is not None and not s.startswith("/"):
            s = os.path.join(_fd_path(dir_fd), s)
        a = self.overlay.absolute(s)
        if (a.startswith(_PASS_PREFIXES) or a in ("/dev", "/proc", "/sys")) \
                and not a.startswith(_SEALED_DEV):
            return None
        c = self.overlay.canonical(a)
        if self.in_kernel_tree(c):
            return None
        return c

    def keep_before_removal(self, p: Any, dir_fd: int | None) -> None:
        """Where :attr:`removed_copies` is set: a copy of the file ``p`` names (as the view
        has it) kept there before the run removes it or renames it away."""
        if not self.removed_copies or isinstance(p, int):
            return
        try:
            s = os.fsdecode(os.fspath(p))
            if dir_fd is not None and not s.startswith("/"):
                s = os.path.join(_fd_path(dir_fd), s)
            c = self.overlay.canonical(self.overlay.absolute(s))
            at = self.canon(c, write=False)
            concrete = c if at is None else self.overlay.for_read(at, p, follow_symlinks=False)
            st = ov.lstat_or_none(concrete)
            if st is None or not stat.S_ISREG(st.st_mode):
                return
            dst = self.removed_copies + c
            _real_makedirs(os.path.dirname(dst))
            with _ORIG_OPEN(concrete, "rb") as a, _ORIG_OPEN(dst, "wb") as b:
                shutil.copyfileobj(a, b)
            _ORIG["utime"](dst, ns=(st.st_atime_ns, st.st_mtime_ns))
        except (OSError, ValueError, TypeError):  # the removal itself says what is wrong
            return

    def in_kernel_tree(self, c: str) -> bool:
        """Whether the kernel line seals the canonical path ``c`` (it passes through here)."""
        if not self.kernel_trees:
            return False
        return c in self.kernel_trees or c.startswith(self._kernel_prefixes) \
            or "/" in self.kernel_trees

    def open_path(self, file: Any, mode: str) -> Any:
        """Where ``open(file, mode)`` opens."""
        write = not _WRITE_MODE.isdisjoint(mode)
        c = self.canon(file, write=write)
        if c is None:
            return file
        if write:
            concrete = self.overlay.for_write(
                c, file, create="w" in mode or "a" in mode or "x" in mode,
                truncate="w" in mode, exclusive="x" in mode)
        else:
            concrete = self.overlay.for_read(c, file)
        return _like(file, concrete)

    def open_flags_path(self, path: Any, flags: int, dir_fd: int | None) -> Any:
        """Where ``os.open(path, flags)`` opens (None: as given)."""
        write = bool(flags & _WRITE_FLAGS)
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
        return _like(path, concrete)

    def read_path(self, p: Any) -> Any:
        """The concrete path that holds ``p`` for reading (as given where it passes)."""
        c = self.canon(p, write=False)
        return p if c is None else _like(p, self.overlay.for_read(c, p))

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
        return _like(p, concrete)

    # ---- the audit hook: writes around the Python line ----------------------------------

    def audit(self, event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int) or not (
                    (isinstance(flags, int) and flags & _WRITE_FLAGS)
                    or (isinstance(mode, str) and not _WRITE_MODE.isdisjoint(mode))):
                return
            self._check(path, "opened for writing", folder_ok=True)
        elif event in _PATH_EVENTS:
            for i in _PATH_EVENTS[event]:
                if i < len(args):
                    self._check(args[i], event)
        elif event == "sqlite3.connect":
            db = args[0]
            if isinstance(db, (str, bytes, os.PathLike)) and os.fsdecode(db) not in (
                    ":memory:", ""):
                self._check(db, "sqlite3.connect")
        elif event in ("subprocess.Popen", "os.system", "os.posix_spawn", "os.exec",
                       "os.spawn"):
            what = args[1] if event == "subprocess.Popen" and len(args) > 1 else args[0]
            text = " ".join(map(str, what)) if isinstance(what, (list, tuple)) else str(what)
            if len(self.lines.subprocesses) < 20:
                self.lines.subprocesses.append(text[:200])

    def _check(self, path: Any, how: str, folder_ok: bool = False) -> None:
        """Stop the run where ``path`` is a real file of the user's (``folder_ok``: a
        folder is not: ``open(folder, opener=...)`` is how tempfile names its own)."""
        if isinstance(path, int):
            return
        try:
            s = os.fsdecode(os.fspath(path))
        except TypeError:
            return
        a = os.path.normpath(s if s.startswith("/") else os.path.join(_ORIG["getcwd"](), s))
        if self.removed_copies and (a + "/").startswith(self.removed_copies + "/"):
            return
        if self.overlay.in_root(a) or a == self.clock or (
                a.startswith(_PASS_PREFIXES) and not a.startswith(_SEALED_DEV)):
            return
        if self.in_kernel_tree(a):
            return
        st = ov.lstat_or_none(a)  # a FIFO, a socket, a device: not a file of the user's
        if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)
                                   or stat.S_ISLNK(st.st_mode)):
            return
        if folder_ok and ((st is not None and stat.S_ISDIR(st.st_mode))
                          or self.overlay.is_dir(self.overlay.canonical(a))):
            return
        self.breach = SealBreach(a, how)
        raise self.breach

    def note_stand_in(self) -> None:
        """The run read a value from an emulated tensor: the first time, the moment as the
        filesystem stamps files (its clock is coarser than ``time.time_ns``: a file written
        right after would look older)."""
        if self.stand_ins_since_ns is not None:
            return
        with _ORIG_OPEN(self.clock, "wb"):
            pass
        self.stand_ins_since_ns = int(_ORIG["stat"](self.clock).st_mtime_ns)

    # ---- what the run left -------------------------------------------------------------

    def writes(self, kernel: Sequence[ov.Change] = ()) -> list[SealedWrite]:
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

    def _stand_in_file(self, ch: ov.Change) -> bool:
        """Whether the file begins with :data:`STAND_IN_MAGIC` (gzip'd too)."""
        concrete = ch.concrete or self.overlay.upper(ch.path)
        try:
            with _ORIG_OPEN(concrete, "rb") as f:
                head = f.read(len(STAND_IN_MAGIC))
            if head.startswith(b"\x1f\x8b"):
                import gzip

                with gzip.GzipFile(fileobj=_ORIG_OPEN(concrete, "rb")) as g:
                    head = g.read(len(STAND_IN_MAGIC))
        except (OSError, EOFError):
            return False
        return head == STAND_IN_MAGIC


# ---- the patched functions ----------------------------------------------------------
# Each consults the seal active when it is called (a name bound during one run and called
# after it calls the original).


def _real_makedirs(d: str) -> None:
    """``d`` and the folders above it made, through the real functions."""
    if ov.lstat_or_none(d) is not None:
        return
    _real_makedirs(os.path.dirname(d))
    _ORIG["mkdir"](d, 0o700)


def _open(file: Any, *args: Any, **kwargs: Any) -> Any:
    seal = _ACTIVE
    # an opener decides what the path means (tempfile's ignores it and calls os.open, the
    # seal's, on a name of its own)
    if seal is None or isinstance(file, int) or kwargs.get("opener") is not None \
            or (len(args) >= 7 and args[6] is not None):
        return _ORIG_OPEN(file, *args, **kwargs)
    mode = args[0] if args else kwargs.get("mode", "r")
    return _ORIG_OPEN(seal.open_path(file, mode), *args, **kwargs)


def _os_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
    seal = _ACTIVE
    concrete = seal.open_flags_path(path, flags, dir_fd) if seal is not None else None
    if concrete is None:
        return int(_ORIG["open"](path, flags, mode, dir_fd=dir_fd))
    return int(_ORIG["open"](concrete, flags, mode))


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
        return _ORIG["stat"](path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
    return at[0].stat(at[1], follow_symlinks, path)


def _lstat(path: Any, *, dir_fd: int | None = None) -> Any:
    at = _sealed(path, dir_fd, write=False)
    if at is None:
        return _ORIG["lstat"](path, dir_fd=dir_fd)
    return at[0].stat(at[1], False, path)


def _access(path: Any, mode: int, *, dir_fd: int | None = None, effective_ids: bool = False,
            follow_symlinks: bool = True) -> bool:
    at = _sealed(path, dir_fd, write=False)
    if at is None:
        return bool(_ORIG["access"](path, mode, dir_fd=dir_fd, effective_ids=effective_ids,
                                    follow_symlinks=follow_symlinks))
    try:
        concrete = at[0].for_read(at[1], path, follow_symlinks)
    except OSError:
        return False
    return bool(_ORIG["access"](concrete, mode, effective_ids=effective_ids,
                                follow_symlinks=follow_symlinks))


def _listdir(path: Any = None) -> list[Any]:
    given = "." if path is None else path
    at = _sealed(given, write=False)
    if at is None or not at[0].touches(at[1]):
        return list(_ORIG["listdir"](given))
    names = at[0].listdir(at[1], given)
    return [os.fsencode(n) for n in names] if isinstance(given, bytes) else names


def _scandir(path: Any = None) -> Any:
    given = "." if path is None else path
    at = _sealed(given, write=False)
    if at is None or not at[0].touches(at[1]):
        return _ORIG["scandir"](given)
    return at[0].scandir(at[0].follow(at[1]), given)


def _remover(name: str) -> Callable[..., None]:
    def remove(path: Any, *, dir_fd: int | None = None) -> None:
        if _ACTIVE is not None:
            _ACTIVE.keep_before_removal(path, dir_fd)
        at = _sealed(path, dir_fd, write=True)
        if at is None:
            _ORIG[name](path, dir_fd=dir_fd)
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
            _ORIG[name](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
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
    with _open(src, "rb") as a, _open(dst, "wb") as b:
        shutil.copyfileobj(a, b)
    _os_remove(src)


def _mkdir(path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
    at = _sealed(path, dir_fd, write=True)
    if at is None:
        _ORIG["mkdir"](path, mode, dir_fd=dir_fd)
    else:
        at[0].mkdir(at[1], mode, path)


def _rmdir(path: Any, *, dir_fd: int | None = None) -> None:
    at = _sealed(path, dir_fd, write=True)
    if at is None:
        _ORIG["rmdir"](path, dir_fd=dir_fd)
    else:
        at[0].rmdir(at[1], path)


def _truncate(path: Any, length: int) -> None:
    at = _sealed(path, write=True)
    if at is None:
        _ORIG["truncate"](path, length)
    else:
        _ORIG["truncate"](at[0].for_write(at[1], path, create=False, truncate=False,
                                          exclusive=False), length)


def _symlink(src: Any, dst: Any, target_is_directory: bool = False, *,
             dir_fd: int | None = None) -> None:
    at = _sealed(dst, dir_fd, write=True)
    if at is None:
        _ORIG["symlink"](src, dst, target_is_directory, dir_fd=dir_fd)
    else:
        at[0].symlink(os.fsdecode(src), at[1], dst)


def _link(src: Any, dst: Any, *, src_dir_fd: int | None = None,
          dst_dir_fd: int | None = None, follow_symlinks: bool = True) -> None:
    s = _sealed(src, src_dir_fd, write=True)
    d = _sealed(dst, dst_dir_fd, write=True)
    if s is None and d is None:
        _ORIG["link"](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd,
                      follow_symlinks=follow_symlinks)
    elif s is None or d is None:
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), src, None, dst)
    else:
        s[0].link(s[1], d[1], src, dst)


def _readlink(path: Any, *, dir_fd: int | None = None) -> Any:
    at = _sealed(path, dir_fd, write=False)
    if at is None:
        return _ORIG["readlink"](path, dir_fd=dir_fd)
    return _like(path, at[0].readlink(at[1], path))


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
            return _ORIG[name](path, *args, **kwargs)
        concrete = at[0].materialize(at[1], path, follow_symlinks)
        return _ORIG[name](_like(path, concrete), *args, **kwargs)

    change.__name__ = name
    return change


def _lchown(path: Any, uid: int, gid: int) -> None:
    _metadata("chown")(path, uid, gid, follow_symlinks=False)


def _reader(name: str) -> Callable[..., Any]:
    """A call that reads a path (getxattr, listxattr): from the view."""
    def read(path: Any = None, *args: Any, **kwargs: Any) -> Any:
        at = _sealed(path, write=False) if path is not None else None
        if at is None:
            return _ORIG[name](*(() if path is None else (path,)), *args, **kwargs)
        concrete = at[0].for_read(at[1], path, kwargs.get("follow_symlinks", True))
        return _ORIG[name](_like(path, concrete), *args, **kwargs)

    read.__name__ = name
    return read


def _maker(name: str) -> Callable[..., None]:
    """mkfifo / mknod: the node made in the overlay."""
    def make(path: Any, *args: Any, dir_fd: int | None = None) -> None:
        at = _sealed(path, dir_fd, write=True)
        if at is None:
            _ORIG[name](path, *args, dir_fd=dir_fd)
        else:
            _ORIG[name](at[0].for_write(at[1], path, create=True, truncate=True,
                                        exclusive=True), *args)

    make.__name__ = name
    return make


def _chdir(path: Any) -> None:
    at = _sealed(path, write=False)
    if at is None:
        _ORIG["chdir"](path)
        return
    overlay, c = at[0], at[0].follow(at[1])
    st = overlay.lstat_in_view(c)
    if st is None:
        raise overlay.missing(c, path)
    if not stat.S_ISDIR(st.st_mode):
        raise ov.os_error(errno.ENOTDIR, path)
    # a folder that exists for real is entered for real (reads of it stay real; the
    # overlay's files in it are found by path), one only the run made in the overlay
    real = ov.lstat_or_none(c)
    inside = overlay.where(c) == ov.GONE or real is None or c in overlay.opaque
    _ORIG["chdir"](overlay.upper(c) if inside else c)


def _getcwd() -> str:
    seal = _ACTIVE
    cwd = str(_ORIG["getcwd"]())
    return seal.overlay.from_upper(cwd) if seal is not None else cwd


def _getcwdb() -> bytes:
    return os.fsencode(_getcwd())


_os_remove = _remover("remove")

_OS_WRAPPERS: dict[str, Callable[..., Any]] = {
    "open": _os_open, "stat": _stat, "lstat": _lstat, "access": _access,
    "listdir": _listdir, "scandir": _scandir, "remove": _os_remove,
    "unlink": _remover("unlink"), "rename": _renamer("rename"),
    "replace": _renamer("replace"), "mkdir": _mkdir, "rmdir": _rmdir,
    "truncate": _truncate, "symlink": _symlink, "link": _link, "readlink": _readlink,
    "chmod": _metadata("chmod"), "chown": _metadata("chown"), "lchown": _lchown,
    "utime": _metadata("utime"), "setxattr": _metadata("setxattr"),
    "removexattr": _metadata("removexattr"), "getxattr": _reader("getxattr"),
    "listxattr": _reader("listxattr"), "mkfifo": _maker("mkfifo"),
    "mknod": _maker("mknod"), "chdir": _chdir, "getcwd": _getcwd, "getcwdb": _getcwdb,
}

# audit events that change a path, and which of their arguments are paths
_PATH_EVENTS: dict[str, tuple[int, ...]] = {
    "os.rename": (0, 1), "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,),
    "os.chmod": (0,), "os.chown": (0,), "os.utime": (0,), "os.truncate": (0,),
    "os.symlink": (1,), "os.link": (1,), "os.setxattr": (0,), "os.removexattr": (0,),
    "os.chflags": (0,), "os.lchflags": (0,),
}
_AUDITED = frozenset({"open", "sqlite3.connect", "subprocess.Popen", "os.system",
                      "os.posix_spawn", "os.exec", "os.spawn", *_PATH_EVENTS})
_HOOKED = False


def _install_audit_hook() -> None:
    """The audit hook, once per process (Python cannot remove one). It costs every audited
    event a call (``id()`` is one), so it is added only when a run has no kernel line."""
    global _HOOKED
    if _HOOKED or _kernel_line_on():
        return
    _HOOKED = True
    sys.addaudithook(_audit)


def _kernel_line_on() -> bool:
    seal = _ACTIVE
    return seal is not None and bool(seal.kernel_trees)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event in _AUDITED:
        seal = _ACTIVE
        if seal is not None and not seal.kernel_trees:
            seal.audit(event, args)


# ---- code that opens paths outside Python ---------------------------------------------


def _mapped(pos: int, kw: str, how: str, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    seal = _ACTIVE
    if seal is None:
        return args, kwargs
    if kw in kwargs:
        given = kwargs[kw]
    elif pos < len(args):
        given = args[pos]
    else:
        return args, kwargs
    if not isinstance(given, (str, bytes, os.PathLike)):
        return args, kwargs
    if how == "h5py":
        mode = kwargs.get("mode", args[pos + 1] if len(args) > pos + 1 else "r")
        how = {"r": "r", "r+": "r+", "w": "w", "w-": "x", "x": "x", "a": "a"}.get(mode, "r")
    if how == "a" and os.fsdecode(os.fspath(given)) in (":memory:", ""):
        return args, kwargs
    concrete = seal.read_path(given) if how == "r" else seal.write_path(given, how)
    if kw in kwargs:
        return args, {**kwargs, kw: concrete}
    return (*args[:pos], concrete, *args[pos + 1:]), kwargs


# id(original) -> (the original, its wrapper): one wrapper per original for every run (a
# new one each run would make every module be read again for names bound to it)
_OUTSIDE_WRAPPERS: dict[int, tuple[Any, Any]] = {}


def _patch_outside(patcher: Patcher, module: ModuleType, name: str, pos: int, kw: str,
                   how: str, wrappers: dict[int, Any] | None = None) -> None:
    original = getattr(module, name, None)
    if original is None:
        return
    known = _OUTSIDE_WRAPPERS.get(id(original))
    if known is not None and known[0] is original:
        wrapper = known[1]
    else:
        wrapper = _outside_wrapper(original, name, pos, kw, how)
        _OUTSIDE_WRAPPERS[id(original)] = (original, wrapper)
    patcher.patch(module, name, wrapper)
    if wrappers is not None:
        wrappers[id(original)] = wrapper


def _outside_wrapper(original: Any, name: str, pos: int, kw: str, how: str) -> Any:
    """``original`` (a function, or h5py's File class) with its path argument handed the
    overlay's path while a run is under way."""
    if isinstance(original, type) and how == "h5py":
        class Sealed(original):  # type: ignore[valid-type, misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                args, kwargs = _mapped(pos, kw, how, args, kwargs)
                super().__init__(*args, **kwargs)

        Sealed.__name__ = Sealed.__qualname__ = original.__name__
        Sealed.__module__ = original.__module__
        return Sealed

    def call(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _mapped(pos, kw, how, args, kwargs)
        return original(*args, **kwargs)

    call.__name__ = getattr(original, "__name__", name)
    call.__doc__ = getattr(original, "__doc__", None)
    return call


def _patch_loaded(patcher: Patcher, module: ModuleType) -> None:
    """Patch a module of :data:`OUTSIDE_PYTHON` the script imports during the run, as it
    loads."""
    if _ACTIVE is None:
        return
    wrappers: dict[int, Any] = {}
    for name, attr, pos, kw, how in OUTSIDE_PYTHON:
        if name == module.__name__:
            _patch_outside(patcher, module, attr, pos, kw, how, wrappers)
    # its submodules loaded with it bound the originals by name (safetensors.torch)
    patch_bound_names(patcher, wrappers, only=module.__name__)


# ---- names bound before a run ----------------------------------------------------------

# tables that hold Python's ``open`` as a value, made at import: (module, object, attribute)
# NumPy's loadtxt / genfromtxt open through numpy.lib._datasource._file_openers
_OPENER_TABLES = (("numpy.lib._datasource", "_file_openers", "_file_openers"),)


def _patch_held_openers(wrappers: dict[int, Any]) -> list[tuple[dict[Any, Any], Any, Any]]:
    """Each entry of :data:`_OPENER_TABLES` that holds an original, set to its wrapper;
    (table, key, original) of each, to put back."""
    done = []
    for module_name, obj_name, attr in _OPENER_TABLES:
        table = getattr(getattr(sys.modules.get(module_name), obj_name, None), attr, None)
        if not isinstance(table, dict):
            continue
        for key, value in list(table.items()):
            wrapper = wrappers.get(id(value))
            if wrapper is not None:
                done.append((table, key, value))
                table[key] = wrapper
    return done


# the ids of the originals -> the module's name in sys.modules -> (the module, its names
# bound to one of them); by name, not id(): id() is an audited event, and the audit hook
# (where there is no kernel line) would be called for each of thousands of modules a run
_BOUND: dict[frozenset[int], dict[str, tuple[Any, list[str]]]] = {}
_NOT_SCANNED = ("os", "posix", "nt", "io", "_io", "builtins", "dpprof", "importlib",
                "_frozen_importlib", "_frozen_importlib_external")


def patch_bound_names(patcher: Patcher, wrappers: dict[int, Any], only: str = "") -> None:
    """Every module that holds one of the originals of ``wrappers`` (by id) under a name of
    its own has that name patched to the wrapper. A module is read once per set of
    originals (names are bound at import): thousands of modules would otherwise cost each
    run tens of milliseconds. ``only``: that package's modules alone."""
    wanted = frozenset(wrappers)
    found = _BOUND.setdefault(wanted, {})
    for key, module in list(sys.modules.items()):
        seen = found.get(key)
        if seen is None or seen[0] is not module:
            mod_name = getattr(module, "__name__", "")
            names = getattr(module, "__dict__", None)
            hits = [] if (not isinstance(mod_name, str) or not isinstance(names, dict)
                          or mod_name.split(".")[0] in _NOT_SCANNED) else [
                attr for attr, value in list(names.items())
                if id(value) in wanted and not attr.startswith("__")]
            seen = found[key] = (module, hits)
        if not seen[1] or (only and not (module.__name__ == only
                                         or module.__name__.startswith(only + "."))):
            continue
        names = module.__dict__
        for attr in seen[1]:
            wrapper = wrappers.get(id(names.get(attr)))
            if wrapper is not None:
                patcher.patch(module, attr, wrapper)
