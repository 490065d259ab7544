"""The census of the user's files (:mod:`dpprof.script.census`) taken ahead, while ``dpprof
run`` starts: begun before dpprof imports torch (a second or more in which the process uses
one core), and claimed by the first run.

It is taken in a child process where this one can fork safely (one thread: the console
script, before torch starts any): the walk's thousands of ``stat`` calls and the kernel's
watches then run on another core, and take nothing from the import (in a thread they
competed with it for the GIL: 5,000 files took 0.95 s there, and the command 10 % longer).
The watches are made in the kernel's record the parent made before the fork (one inotify
instance, shared by the two processes' descriptors): the child hands back the snapshot and
which watch is which path (:meth:`FolderWatch.marks`), and exits; the parent reads the
record. Elsewhere (a process with threads: tests, a library call) it is taken in a thread.

It is the same census as one taken then (:func:`claim`): the same folders, limit and watches,
or it is not used; and whatever changed in those folders since it was taken (Python writing a
module's bytecode beside it, another process) is looked at again from the kernel's record of
changes the census keeps (:func:`dpprof.script.census.refresh`), so that it holds the state
just before the first run, as a census taken then would. Nothing of the script runs before
the claim, which waits for the census: the census still precedes every run.

The folders are guessed from the command line (the working directory, and the folder of the
first ``.py`` file after ``--``); where the guess is not the folders the run asks for (a
module run as ``-m`` has none), the census is taken again at the claim, as before.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dpprof.script import census, namespace
from dpprof.script.census import Snapshot
from dpprof.script.folder_watch import FolderWatch

__all__ = ["claim", "settings", "start", "start_for_command"]


class _InThread:
    """A census taken in a thread of this process."""

    def __init__(self, folders: list[str], limit: int, every_inode: bool) -> None:
        self._snapshot: Snapshot | None = None
        self._thread = threading.Thread(target=self._take, args=(folders, limit, every_inode),
                                        name="dpprof-census", daemon=True)
        self._thread.start()

    def _take(self, folders: list[str], limit: int, every_inode: bool) -> None:
        # an error is said again by the census taken at the claim
        with contextlib.suppress(BaseException):
            self._snapshot = census.take(folders, (), limit, every_inode=every_inode)

    def wait(self) -> Snapshot | None:
        """The snapshot, once taken (None where the census failed)."""
        self._thread.join()
        return self._snapshot


@dataclass
class _InChild:
    """A census taken by a child process: its pid, the pipe its result comes through, the
    record it watches into."""

    pid: int
    pipe: int
    watch: FolderWatch

    def wait(self) -> Snapshot | None:
        """The snapshot, once the child is done (None where it failed or was stopped: the
        claim takes the census again)."""
        with os.fdopen(self.pipe, "rb") as result:
            data = result.read()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        if not data:
            return None
        snap, marks = pickle.loads(data)
        self.watch.adopt(marks)
        snap.watch = self.watch
        return snap  # type: ignore[no-any-return]


_PENDING: list[_InThread | _InChild] = []


def settings() -> tuple[int, bool]:
    """(entry limit, each file watched by its inode) of the census for this process: the
    whole walk and every inode where no mount namespace holds the writes, the shallowest and
    only the files with another link where one does (:mod:`dpprof.script.census`)."""
    kernel = namespace.entered()
    return (census.LIMIT_UNDER_KERNEL if kernel else census.LIMIT), not kernel


def start(folders: Sequence[str]) -> None:
    """The census of ``folders`` begun in a child process, or in a thread where this
    process has threads (after :func:`namespace.enter`: a process entering its namespace
    must have one thread)."""
    limit, every_inode = settings()
    folders = list(folders)
    if hasattr(os, "fork") and threading.active_count() == 1:
        forked = _in_child(folders, limit, every_inode)
        if forked is not None:
            _PENDING[:] = [forked]
            return
    _PENDING[:] = [_InThread(folders, limit, every_inode)]


def _in_child(folders: list[str], limit: int, every_inode: bool) -> _InChild | None:
    """The census taken by a child into a record made here (see the module); None where
    no child could be made."""
    watch = FolderWatch()
    read_end, write_end = os.pipe()
    # a stop signal until the child has its own handlers is held (the parent's say
    # "interrupted", which the child must not say again), and then delivered
    stops = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    held = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    try:
        pid = os.fork()
    except OSError:  # no new process (a limit of processes): the thread takes it
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        os.close(read_end)
        os.close(write_end)
        return None
    if pid == 0:  # the child: the census, handed back; nothing else of dpprof's runs here
        try:
            os.close(read_end)
            for sig in stops:
                signal.signal(sig, signal.SIG_DFL)  # a Ctrl-C ends it quietly
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
            snap = census.take(folders, (), limit, watch=watch, every_inode=every_inode)
            snap.watch = None
            with os.fdopen(write_end, "wb") as out:
                out.write(pickle.dumps((snap, watch.marks()), pickle.HIGHEST_PROTOCOL))
        finally:
            os._exit(0)
    signal.pthread_sigmask(signal.SIG_SETMASK, held)
    os.close(write_end)
    return _InChild(pid=pid, pipe=read_end, watch=watch)


def start_for_command(argv: Sequence[str]) -> None:
    """:func:`start` for ``dpprof run ... -- COMMAND``'s folders, as guessed from ``argv``
    (see the module)."""
    folders = [os.getcwd()]
    command = list(argv)[list(argv).index("--") + 1:] if "--" in argv else []
    script = next((a for a in command if a.endswith(".py") and not a.startswith("-")), None)
    if script is not None:
        folders.append(os.path.dirname(os.path.abspath(script)))
    start(folders)


def claim(folders: Iterable[str], exclude: Iterable[str]) -> Snapshot | None:
    """The census taken ahead, where it is the one :func:`census.take` would take now of
    ``folders`` without ``exclude`` (with this process's :func:`settings`), made current;
    None where there is none or it is not that one (take it now). Waits for the census; the
    seconds waited are its :attr:`Snapshot.waited_s`."""
    if not _PENDING:
        return None
    started = time.perf_counter()
    snap = _PENDING.pop().wait()
    if snap is None or (snap.limit, snap.every_inode) != settings():
        return None
    skip = census.skipped(exclude)
    if census.roots_of(folders, skip) != snap.roots:
        return None
    # left out now, not then: usable only where the census noted nothing there
    more = skip - snap.skip
    if any(p in more or any(p.startswith(m + "/") for m in more) for p in snap.entries):
        return None
    snap.skip |= more
    if not census.refresh(snap):
        return None
    snap.waited_s = time.perf_counter() - started
    return snap
