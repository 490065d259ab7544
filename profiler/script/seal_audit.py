"""The seal's second line where the process has no mount namespace: an audit hook that stops
the run at a write that reached a real path around Python's file calls (``_io.FileIO``,
``posix.open``, ``os.rename`` of a name bound before the seal...), before it happens, naming
the path (:class:`SealBreach`); and notes the subprocesses the script starts.
"""

from __future__ import annotations

import os
import stat
import sys
import time
from typing import TYPE_CHECKING, Any

from dpprof.script.real_fs import REAL_CALLS, lstat_or_none
from dpprof.script.sealed_calls import WRITE_FLAGS, WRITE_MODE, active

if TYPE_CHECKING:
    from dpprof.script.seal import Seal

__all__ = ["WHERE_NAMESPACES", "SealBreach", "events_seen", "install_audit_hook"]


# what to do where the machine gives dpprof no mount namespace (the kernel line)
WHERE_NAMESPACES = ("run it where unprivileged user namespaces are allowed (sysctl "
                    "kernel.unprivileged_userns_clone=1, or "
                    "kernel.apparmor_restrict_unprivileged_userns=0)")


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
                f"write reached your file; {WHERE_NAMESPACES}")


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
# audited events the hook was called on (the seal's timers: what the hook costs a run)
_SEEN = [0]


def install_audit_hook(kernel_line: bool) -> None:
    """The audit hook, once per process (Python cannot remove one). It costs every audited
    event a call (``id()`` is one), so it is added only for a run with no kernel line."""
    global _HOOKED
    if _HOOKED or kernel_line:
        return
    _HOOKED = True
    sys.addaudithook(_audit)


def events_seen() -> int:
    """How many audited events the hook was called on so far."""
    return _SEEN[0]


def _audit(event: str, args: tuple[Any, ...]) -> None:
    # the events it does not watch return at once (the hook sees every audited event)
    _SEEN[0] += 1
    if event in _AUDITED:
        seal = active()
        if seal is not None and not seal.kernel_trees:
            started = time.perf_counter()
            try:
                _on_event(seal, event, args)
            finally:
                seal.lines.hook_s += time.perf_counter() - started


def _on_event(seal: Seal, event: str, args: tuple[Any, ...]) -> None:
    """What ``event`` means for the run under ``seal``: a write around its Python line
    stopped, a subprocess noted."""
    if event == "open":
        path, mode, flags = args
        if isinstance(path, int) or not (
                (isinstance(flags, int) and flags & WRITE_FLAGS)
                or (isinstance(mode, str) and not WRITE_MODE.isdisjoint(mode))):
            return
        _check(seal, path, "opened for writing", folder_ok=True)
    elif event in _PATH_EVENTS:
        for i in _PATH_EVENTS[event]:
            if i < len(args):
                _check(seal, args[i], event)
    elif event == "sqlite3.connect":
        db = args[0]
        if isinstance(db, (str, bytes, os.PathLike)) and os.fsdecode(db) not in (
                ":memory:", ""):
            _check(seal, db, "sqlite3.connect")
    elif event in ("subprocess.Popen", "os.system", "os.posix_spawn", "os.exec",
                   "os.spawn"):
        what = args[1] if event == "subprocess.Popen" and len(args) > 1 else args[0]
        text = " ".join(map(str, what)) if isinstance(what, (list, tuple)) else str(what)
        if len(seal.lines.subprocesses) < 20:
            seal.lines.subprocesses.append(text[:200])

def _check(seal: Seal, path: Any, how: str, folder_ok: bool = False) -> None:
    """Stop the run where ``path`` is a real file of the user's (``folder_ok``: a
    folder is not: ``open(folder, opener=...)`` is how tempfile names its own)."""
    if isinstance(path, int):
        return
    try:
        s = os.fsdecode(os.fspath(path))
    except TypeError:
        return
    a = os.path.normpath(s if s.startswith("/") else os.path.join(REAL_CALLS["getcwd"](), s))
    if seal.removed_copies and (a + "/").startswith(seal.removed_copies + "/"):
        return
    if seal.overlay.in_root(a) or a == seal.clock or seal.passes(a) or seal.in_kernel_tree(a):
        return
    st = lstat_or_none(a)  # a FIFO, a socket, a device: not a file of the user's
    if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)
                               or stat.S_ISLNK(st.st_mode)):
        return
    if folder_ok and ((st is not None and stat.S_ISDIR(st.st_mode))
                      or seal.overlay.is_dir(seal.overlay.canonical(a))):
        return
    seal.breach = SealBreach(a, how)
    raise seal.breach
