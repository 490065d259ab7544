"""How the processes a run leaves running are found: from the kernel's lists of each
thread's children (``/proc/PID/task/TID/children``, a few small files: 0.05 ms where a scan
of every process's ``stat`` took 4 ms and made the seal's own time a command 88 ms instead of
~35 ms), and, on a kernel that keeps no such lists, by that scan. Checked on this machine's
/proc with a real child, and on a /proc written here as a kernel without the lists writes
it (a zombie is no living child; a grandchild is found below its parent)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dpprof.script import leftover_processes


def test_a_child_started_is_found_with_the_kernels_lists() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        # what else this process has (a test worker's other children come and go): not it
        before = leftover_processes.children() - {child.pid}
        assert leftover_processes.children() - before == {child.pid}
        assert leftover_processes.end_leftovers(before) == ["sleep 30"]
        assert child.wait(timeout=5) != 0  # ended by a signal
    finally:
        child.kill()
        child.wait()


def _stat(pid: int, name: str, state: str, parent: int) -> str:
    return f"{pid} ({name}) {state} {parent} 1 1 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0\n"


def test_without_the_kernels_lists_every_process_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    me = os.getpid()
    (tmp_path / "self" / "task" / str(me)).mkdir(parents=True)  # no "children" file
    for pid, name, state, parent in [(100, "sh", "S", me), (101, "sleep 3", "S", 100),
                                     (102, "done", "Z", me), (200, "other", "S", 1)]:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(_stat(pid, name, state, parent))
        (tmp_path / str(pid) / "task" / str(pid)).mkdir(parents=True)  # nor theirs
    monkeypatch.setattr(leftover_processes, "PROC", tmp_path)
    assert leftover_processes.children() == {100}  # the zombie 102 is no living child
    assert leftover_processes.descendants({100}) == {100, 101}
