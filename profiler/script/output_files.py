"""The files dpprof's own output goes to: where the user sent it, not files of theirs to keep.

``dpprof run -- python train.py > log.txt`` (or ``nohup``'s ``nohup.out``) in the working
folder: the script's prints go to that file as they would on the GPU, and dpprof's lines too.
``dpprof run ... | tee log.txt``: the process reading dpprof's output writes it. The check
after each run (:mod:`dpprof.script.census`) leaves these files out; they are found from the
kernel's view of this process (``/proc``), where it has one: the regular files behind its
standard output and errors, and the files open for writing in each other process of the same
user that holds the reading end of a pipe they write into.
"""

from __future__ import annotations

import os
import stat

__all__ = ["note_output_readers", "output_files"]

_STREAMS = (1, 2)
# the files the readers of this process's output pipes wrote, noted before the process left
# the user namespace in which it can read theirs (:func:`note_output_readers`)
_NOTED: set[str] = set()


def note_output_readers() -> None:
    """Note now the files written by the processes that read this one's output through a
    pipe (:func:`output_files` gives them after): in a user namespace of its own, another
    process's ``/proc`` entries are no longer this one's to read."""
    _NOTED.update(_written_by_readers_of(_output_pipes()))


def _output_pipes() -> set[str]:
    pipes = set()
    for fd in _STREAMS:
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                pipes.add(os.readlink(f"/proc/self/fd/{fd}"))  # "pipe:[inode]"
        except OSError:
            continue
    return pipes


def output_files() -> set[str]:
    """The real paths of the files this process's output and errors end in (see the
    module); empty where there is no ``/proc``."""
    out: set[str] = set()
    for fd in _STREAMS:
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                out.add(os.path.realpath(os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:  # closed, or no /proc: no file known
            continue
    return out | _written_by_readers_of(_output_pipes()) | _NOTED


def _written_by_readers_of(pipes: set[str]) -> set[str]:
    """The regular files open for writing in the other processes that hold one of
    ``pipes`` open (a reader such as ``tee``: the writer is this process or its parent)."""
    me = os.getpid()
    out: set[str] = set()
    if not pipes:
        return out
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me]
    except OSError:
        return out
    for pid in pids:
        fds = f"/proc/{pid}/fd"
        try:
            links = {fd: os.readlink(f"{fds}/{fd}") for fd in os.listdir(fds)}
        except OSError:  # gone, or another user's
            continue
        if not pipes.intersection(links.values()):
            continue
        for fd, target in links.items():
            if target.startswith("/") and _open_for_writing(pid, fd):
                out.add(os.path.realpath(target))
    return out


def _open_for_writing(pid: int, fd: str) -> bool:
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}") as info:
            flags = next((int(line.split()[1], 8) for line in info
                          if line.startswith("flags:")), 0)
    except (OSError, ValueError):
        return False
    return flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
