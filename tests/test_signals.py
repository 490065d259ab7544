"""SIGINT/SIGTERM: dpprof ends its children, removes its temporary files, writes the
scenarios already measured (marked partial) and exits 130/143, in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proctree import alive, descendants

PY = sys.executable



@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_during_the_ddp_ranks(tmp_path: Path, sig: int, code: int) -> None:
    out = tmp_path / "run.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [PY, "-m", "dpprof", "compare", "--backend", "cpu", "-w", "mlp", "-b", "8", "-g", "2",
         "-s", "single,ddp", "--no-fixes", "-o", str(out), "-q"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # our own process group: a signal for dpprof only
    )
    try:
        deadline = time.monotonic() + 120
        ranks: set[int] = set()
        while time.monotonic() < deadline and proc.poll() is None:
            ranks = {p for p in descendants(proc.pid) if "rank" in _cmdline(p) or
                     "multiprocessing" in _cmdline(p)}
            if len(ranks) >= 2:
                break
            time.sleep(0.1)
        assert len(ranks) >= 2, "the ddp ranks never started"
        time.sleep(1.0)  # the ranks are up and running
        everyone = descendants(proc.pid)
        if sig == signal.SIGINT:  # Ctrl-C: the terminal signals the whole process group
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("dpprof: interrupted"), err
    assert "Traceback" not in err
    deadline = time.monotonic() + 30  # a bound for a loaded machine: gone, or the test fails
    while (left := [p for p in everyone if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"children still running: {[_cmdline(p) for p in left]}"
    assert not list(tmp_path.rglob("*.tmp")), list(tmp_path.rglob("*"))
    data = json.loads(out.read_text())  # the scenario measured before the signal
    assert data["interrupted"] == signal.Signals(sig).name
    assert [s["name"] for s in data["scenarios"]] == ["single"]
    assert "Partial result" in data["comparison"]["verdict"]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_sigterm_during_the_final_write_leaves_no_temporary_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dpprof.cli.guard import install_signal_handlers
    from dpprof.errors import Interrupted
    from dpprof.saved_result import write_atomic

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    real_replace = os.replace

    def replace_after_sigterm(src: str, dst: str) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the report is being written
        time.sleep(0.5)
        real_replace(src, dst)

    try:
        install_signal_handlers()
        monkeypatch.setattr(os, "replace", replace_after_sigterm)
        with pytest.raises(Interrupted) as e:
            write_atomic(tmp_path / "run.json", "{}" * 100_000)
        assert e.value.exit_code == 143
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    assert list(tmp_path.iterdir()) == []


THIRD_SIGNAL_DURING_A_WRITE = """
import os, signal, sys
from dpprof.errors import install_stop_handlers, take_interrupt
from dpprof.saved_result import write_atomic

install_stop_handlers()
take_interrupt(signal.SIGINT)  # dpprof is stopping on a first Ctrl-C, writing what it measured
real_replace = os.replace

def replace(src, dst):  # two more Ctrl-C while the report is half written
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)
    real_replace(src, dst)

os.replace = replace
write_atomic(sys.argv[1], "{}" * 100_000)
"""


def test_a_third_ctrl_c_quits_at_once_and_leaves_no_half_written_report(tmp_path: Path) -> None:
    """The second Ctrl-C behind the first is held (the partial result is still written);
    the third quits with 130 and says it did not write it, and removes the report's
    temporary file rather than leave it beside the user's files."""
    done = subprocess.run([PY, "-c", THIRD_SIGNAL_DURING_A_WRITE, str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 130, done.stderr
    assert "SIGINT again: writing what was measured first" in done.stderr
    assert "SIGINT again: quit without writing the partial result" in done.stderr
    assert "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_tests_and_what_they_start_take_sigint_as_python_does() -> None:
    """However the suite was started (a background job of a script inherits SIGINT ignored:
    tests/conftest.py puts Python's handler back), a test process and the processes it
    starts raise KeyboardInterrupt on SIGINT, as from a terminal or CI."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    child = subprocess.run(
        [PY, "-S", "-c", "import signal; print(signal.getsignal(signal.SIGINT) is "
         "signal.default_int_handler)"], capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == "True", child.stderr
