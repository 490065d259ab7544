"""The census of the user's files (:mod:`dpprof.script.census`) taken ahead, while ``dpprof
run`` starts: in a thread of its own, begun before dpprof imports torch (a second or more in
which the process uses one core; ``scandir``, ``stat`` and the kernel's watches release the
GIL), and claimed by the first run.

It is the same census as one taken then (:func:`claim`): the same folders, limit and watches,
or it is not used; and whatever changed in those folders since it was taken (Python writing a
module's bytecode beside it, another process) is looked at again from the kernel's record of
changes the census keeps (:func:`dpprof.script.census.refresh`), so that it holds the state
just before the first run, as a census taken then would. Nothing of the script runs before
the claim, which waits for the thread: the census still precedes every run.

The folders are guessed from the command line (the working directory, and the folder of the
first ``.py`` file after ``--``); where the guess is not the folders the run asks for (a
module run as ``-m`` has none), the census is taken again at the claim, as before.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dpprof.script import census, namespace
from dpprof.script.census import Snapshot

__all__ = ["claim", "settings", "start", "start_for_command"]


@dataclass
class _Ahead:
    thread: threading.Thread
    # what the thread made: the snapshot, or what it raised
    made: dict[str, object]


_PENDING: list[_Ahead] = []


def settings() -> tuple[int, bool]:
    """(entry limit, each file watched by its inode) of the census for this process: the
    whole walk and every inode where no mount namespace holds the writes, the shallowest and
    only the files with another link where one does (:mod:`dpprof.script.census`)."""
    kernel = namespace.entered()
    return (census.LIMIT_UNDER_KERNEL if kernel else census.LIMIT), not kernel


def start(folders: Sequence[str]) -> None:
    """The census of ``folders`` begun in a thread (after :func:`namespace.enter`: a process
    entering its namespace must have one thread)."""
    limit, every_inode = settings()
    folders = list(folders)
    made: dict[str, object] = {}

    def take() -> None:
        try:
            made["snapshot"] = census.take(folders, (), limit, every_inode=every_inode)
        except BaseException as e:  # said again by the census taken at the claim
            made["error"] = e

    ahead = _Ahead(threading.Thread(target=take, name="dpprof-census", daemon=True), made)
    _PENDING[:] = [ahead]
    ahead.thread.start()


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
    None where there is none or it is not that one (take it now). Waits for the thread; the
    seconds waited are its :attr:`Snapshot.waited_s`."""
    if not _PENDING:
        return None
    started = time.perf_counter()
    ahead = _PENDING.pop()
    ahead.thread.join()
    snap = ahead.made.get("snapshot")
    if not isinstance(snap, Snapshot) or (snap.limit, snap.every_inode) != settings():
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
