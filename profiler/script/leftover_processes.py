"""The processes a run started that still run when it ends, ended before its seal is lifted.

A process the script starts (``subprocess.Popen`` of an upload, a shell's background job, a
``multiprocessing.Process`` it would stop at its end, which dpprof's stop after ``--steps``
skipped) is not waited for by a process's end, and so outlived its run: the run's overlays
were lifted under it, and its later writes went into the user's folders after the report said
the script wrote nothing (a ``sleep 3; echo late > /path/late.txt`` did). Such processes are
the run's: they are ended as it ends, while its overlays still hold what they write (SIGTERM,
then SIGKILL to what remains a second later), each with the processes it started, and the
report names their commands. Found from ``/proc`` (the children of dpprof's process started
since the run began, and theirs); where there is no ``/proc``, nothing is found. A process
that detaches (a shell's ``cmd &``, whose shell exits at once; a double fork) would be no
child of dpprof's: dpprof's process is made their subreaper (``PR_SET_CHILD_SUBREAPER``), so
an orphan of the run's is adopted by it, not by init, and found.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import sys
import time
from pathlib import Path

__all__ = ["adopt_orphans", "children", "descendants", "end_leftovers"]

PROC = Path("/proc")
GRACE_S = 1.0  # between SIGTERM and SIGKILL


PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


@functools.cache
def adopt_orphans() -> bool:
    """Make this process the subreaper of its descendants (Linux), once: an orphan among
    them is re-parented to it, not to init. Whether it is (False: not Linux, or refused)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid``; None where it is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
    return fields[0], int(fields[1])


def _living(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        stat = _stat(pid)
        if stat is not None and stat[0] not in ("Z", "X"):
            out.add(pid)
    return out


def _parents() -> dict[int, int]:
    """Every process's parent pid (empty where there is no /proc): the slow way, where the
    kernel keeps no list of a process's children."""
    out = {}
    with contextlib.suppress(OSError):
        for entry in PROC.iterdir():
            if entry.name.isdigit():
                stat = _stat(int(entry.name))
                if stat is not None:
                    out[int(entry.name)] = stat[1]
    return out


def _children_of(pid: int | str) -> set[int] | None:
    """The children of ``pid`` ("self": this process) from the kernel's list of each of its
    threads' (``/proc/PID/task/TID/children``, a few files), None where it keeps none."""
    try:
        tasks = list((PROC / str(pid) / "task").iterdir())
    except OSError:
        return set() if pid != "self" else None
    out: set[int] = set()
    for task in tasks:
        try:
            out.update(int(c) for c in (task / "children").read_text().split())
        except FileNotFoundError:
            return None  # a kernel without the lists (CONFIG_PROC_CHILDREN)
        except OSError:
            continue  # a thread that ended meanwhile
    return out


def children() -> set[int]:
    """The living child processes of this process now."""
    listed = _children_of("self")
    if listed is None:
        me = os.getpid()
        listed = {pid for pid, parent in _parents().items() if parent == me}
    return _living(listed)


def descendants(pids: set[int]) -> set[int]:
    """``pids`` and every process below them, found before any is ended (an orphan's parent
    changes)."""
    tree, todo = set(pids), list(pids)
    parents: dict[int, int] | None = None
    while todo:
        pid = todo.pop()
        below = _children_of(pid)
        if below is None:
            parents = parents if parents is not None else _parents()
            below = {child for child, parent in parents.items() if parent == pid}
        for child in below - tree:
            tree.add(child)
            todo.append(child)
    return tree


def _command(pid: int) -> str:
    """The process's command; a process forked from this one (``multiprocessing``'s) has
    dpprof's own, and is named so."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
        if raw == (PROC / "self" / "cmdline").read_bytes():
            return f"a process the script forked (pid {pid})"
    except OSError:
        return f"pid {pid}"
    return " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part)[:200]


def _pythons_own() -> set[int]:
    """Python's own helper processes, which serve the process for its life: the
    ``multiprocessing`` resource tracker and fork server (started by a run when it first
    needs them, and by no other; none where their module was never imported)."""
    tracker = sys.modules.get("multiprocessing.resource_tracker")
    server = sys.modules.get("multiprocessing.forkserver")
    pids = (getattr(getattr(tracker, "_resource_tracker", None), "_pid", None),
            getattr(getattr(server, "_forkserver", None), "_forkserver_pid", None))
    return {pid for pid in pids if isinstance(pid, int)}


def end_leftovers(before: set[int]) -> list[str]:
    """End the child processes not in ``before`` that still run, with their descendants
    (Python's own helpers left running); their commands (the children's), in the order
    found."""
    started = children() - before
    if started:
        started -= _pythons_own()
    if not started:
        return []
    commands = [_command(pid) for pid in sorted(started)]
    tree = descendants(started)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _living(tree):
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + GRACE_S
        while _living(tree) and time.monotonic() < deadline:
            time.sleep(0.01)
        if not _living(tree):
            break
    return commands
