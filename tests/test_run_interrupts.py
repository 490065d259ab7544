"""A stop is a stop: real SIGINT and SIGTERM sent to a real ``dpprof run`` at each moment of
its work (starting up, the script's first step, an alternative, a hang in the script or in
its DataLoader workers, writing the reports, a second Ctrl-C) end it with 130 / 143, one
line and no traceback, and write what was measured, marked interrupted and naming the run
it stopped in; a run cut short is never reported as measured nor used by the verdict.

The script tells the test where it is through a pipe it inherits (``os.write`` on a file
descriptor: no file, no output the run keeps to itself), so every signal lands where it is
meant to, however loaded the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from proctree import alive, descendants

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")

# DataParallel with the loss on the gathered outputs: an as-written run, then two
# alternatives (the loss inside forward, DDP); every step slow enough to be signalled in
DP_SCRIPT = """
    import os, time
    import torch
    import torch.nn as nn

    MARK = int(os.environ["MARK_FD"])
    model = nn.DataParallel(nn.Linear(64, 64).cuda())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.MSELoss()
    os.write(MARK, b"start\\n")
    for step in range(10):
        loss = loss_fn(model(torch.randn(32, 64).cuda()), torch.randn(32, 64).cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
        os.write(MARK, b"step\\n")
        {hang}
"""

# a DataLoader whose workers hang after the first batches: the main process waits on them
WORKERS_SCRIPT = """
    import os, time
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader, Dataset

    MARK = int(os.environ["MARK_FD"])

    class Slow(Dataset):
        def __len__(self):
            return 1000
        def __getitem__(self, i):
            if i >= 64:
                time.sleep(3600)  # the worker hangs
            return torch.randn(8), torch.randn(8)

    model = nn.Linear(8, 8).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    os.write(MARK, b"start\\n")
    for x, y in DataLoader(Slow(), batch_size=16, num_workers=2):
        (model(x.cuda()) - y.cuda()).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        os.write(MARK, b"step\\n")
"""


# a script that takes the stop signals itself: Ctrl-C finishes the step and ends the loop,
# SIGTERM exits 0 at once (what a training loop with a graceful stop does)
OWN_HANDLERS_SCRIPT = """
    import os, signal, sys, time
    import torch
    import torch.nn as nn

    MARK = int(os.environ["MARK_FD"])
    stop = False

    def finish_the_step(signum, frame):
        global stop
        stop = True
        os.write(MARK, b"own handler\\n")

    plain = signal.signal(signal.SIGINT, finish_the_step) is signal.default_int_handler
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    if plain and signal.getsignal(signal.SIGINT) is finish_the_step:
        os.write(MARK, b"handlers as in plain Python\\n")
    model = nn.DataParallel(nn.Linear(64, 64).cuda())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    os.write(MARK, b"start\\n")
    for step in range(10):
        model(torch.randn(32, 64).cuda()).sum().backward()
        opt.step()
        opt.zero_grad()
        os.write(MARK, b"step\\n")
        time.sleep(1)
        if stop:
            break
"""

# one GPU, forced onto the ladder (--ladder): the script as written, then a run per rung
ONE_GPU_SCRIPT = """
    import os, time
    import torch
    import torch.nn as nn

    MARK = int(os.environ["MARK_FD"])
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    os.write(MARK, b"start\\n")
    for step in range(10):
        model(torch.randn(32, 64).cuda()).sum().backward()
        opt.step()
        opt.zero_grad()
        os.write(MARK, b"step\\n")
        time.sleep(0.3)
"""

class Run:
    """``dpprof run -o r.json ... -- python train.py`` in its own session, with the script's
    marks read from a pipe."""

    def __init__(self, tmp_path: Path, source: str, *options: str) -> None:
        (tmp_path / "train.py").write_text(textwrap.dedent(source))
        self.read_fd, write_fd = os.pipe()
        self.marks: list[str] = []
        self._buffer = b""
        env = dict(os.environ, MARK_FD=str(write_fd), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dpprof", "run", "-o", "r.json", *options, "--",
             "python", "train.py"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            pass_fds=(write_fd,), start_new_session=True)
        os.close(write_fd)
        self.tmp_path = tmp_path
        self.children: set[int] = set()

    def wait_for(self, mark: str, count: int = 1, timeout: float = 240) -> None:
        """Until the script has written ``mark`` ``count`` times in all."""
        deadline = time.monotonic() + timeout
        while self.marks.count(mark) < count:
            left = deadline - time.monotonic()
            assert left > 0 and self.proc.poll() is None, (
                f"no {mark!r} x{count}: {self.marks}, {self.proc.poll()}")
            self._read_marks(min(left, 1.0))

    def _read_marks(self, timeout: float) -> None:
        while select.select([self.read_fd], [], [], timeout)[0]:
            chunk = os.read(self.read_fd, 4096)
            if not chunk:  # every writer has closed it
                return
            self._buffer += chunk
            *lines, rest = self._buffer.split(b"\n")
            self._buffer = rest
            self.marks += [ln.decode() for ln in lines]
            timeout = 0

    def signal(self, sig: int) -> None:
        self.children |= descendants(self.proc.pid)
        if sig == signal.SIGINT:  # Ctrl-C: the terminal signals the whole process group
            os.killpg(self.proc.pid, sig)
        else:
            os.kill(self.proc.pid, sig)

    def finish(self, timeout: float = 240) -> tuple[int, str, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
            self._read_marks(0)  # what it wrote last
        finally:
            os.close(self.read_fd)
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode, out, err

    def saved(self) -> dict:
        return json.loads((self.tmp_path / "r.json").read_text())

    def children_left(self) -> list[int]:
        deadline = time.monotonic() + 30  # a bound for a loaded machine
        while (left := [p for p in self.children if alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left


CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
SIGNALS = pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM],
                                  ids=["SIGINT", "SIGTERM"])


def _one_clean_line(err: str, code: int) -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("dpprof: running")
             and not ln.startswith("(meta tensors")]
    assert len(lines) == 1 and lines[0].startswith("dpprof: interrupted ("), err
    return lines[0]


@SIGNALS
def test_while_starting_up(sig: int, tmp_path: Path) -> None:
    """In its first 0.3 s dpprof is still importing: no traceback, its status, no report."""
    run = Run(tmp_path, DP_SCRIPT.format(hang=""))
    time.sleep(0.3)
    run.signal(sig)
    code, _, err = run.finish()
    assert code == CODES[sig], err
    line = _one_clean_line(err, code)
    assert "before anything was measured" in line
    assert not (tmp_path / "r.json").exists()


@SIGNALS
def test_in_the_scripts_first_step(sig: int, tmp_path: Path) -> None:
    run = Run(tmp_path, DP_SCRIPT.format(hang="time.sleep(2)"))
    run.wait_for("start")
    run.signal(sig)
    code, _, err = run.finish()
    assert code == CODES[sig], err
    line = _one_clean_line(err, code)
    assert "during the script as written; wrote what was measured before it" in line
    saved = run.saved()
    assert saved["interrupted"] == signal.Signals(sig).name
    assert saved["config"]["interrupted_in"] == "the script as written"
    assert len(saved["scenarios"]) == 1  # the script as written, before its first forward
    assert saved["scenarios"][0]["devices"][0]["peak_allocated_bytes"] > 0  # the model
    assert saved["comparison"]["verdict"].startswith(
        f"Partial result: interrupted by {signal.Signals(sig).name} during the script as written")


@SIGNALS
def test_during_an_alternative(sig: int, tmp_path: Path) -> None:
    """The alternative cut short is an error in the result, not a measurement: no fix from it,
    the verdict not drawn from it, and the alternatives after it not run."""
    run = Run(tmp_path, DP_SCRIPT.format(hang="time.sleep(0.3)"))
    run.wait_for("step", 3)  # the script as written: its three steps
    run.wait_for("start", 2)  # the first alternative (the loss inside forward) has begun
    run.wait_for("step", 4)
    run.signal(sig)
    code, _, err = run.finish()
    assert code == CODES[sig], err
    line = _one_clean_line(err, code)
    assert "during the loss-in-forward alternative; wrote what was measured" in line
    saved = run.saved()
    assert saved["config"]["interrupted_in"] == "the loss-in-forward alternative"
    as_written, cut = saved["scenarios"]
    assert as_written["name"] == "dp-loss-primary" and as_written["status"] == "ok"
    assert cut["status"] == "error" and "cut short" in cut["message"]
    assert not [f for f in saved["fixes"] if f["name"] in ("loss-in-forward", "ddp")]
    verdict = saved["comparison"]["verdict"]
    assert verdict.startswith(f"Partial result: interrupted by {signal.Signals(sig).name} "
                              "during the loss-in-forward alternative")
    assert "inside forward" not in verdict.split(".", 1)[1]


@pytest.mark.parametrize("apart_s", [0.05, 0.7])
def test_a_second_ctrl_c_still_writes_the_partial_result(apart_s: float, tmp_path: Path) -> None:
    """A second Ctrl-C close behind the first (while dpprof stops, or once it has) neither
    loses the partial result nor prints an empty "could not write the partial result: "."""
    run = Run(tmp_path, DP_SCRIPT.format(hang="time.sleep(0.3)"))
    run.wait_for("step", 3)
    run.wait_for("start", 2)
    run.signal(signal.SIGINT)
    time.sleep(apart_s)
    with contextlib.suppress(ProcessLookupError):  # it may have finished by then
        run.signal(signal.SIGINT)
    code, _, err = run.finish()
    assert code == 130, err
    assert "Traceback" not in err and "could not write" not in err
    assert "wrote what was measured before it, marked partial: r.json" in err
    assert run.saved()["interrupted"] == "SIGINT"


@SIGNALS
def test_a_script_that_hangs(sig: int, tmp_path: Path) -> None:
    run = Run(tmp_path, DP_SCRIPT.format(hang="time.sleep(3600)"))
    run.wait_for("step")
    run.signal(sig)
    code, _, err = run.finish(timeout=120)
    assert code == CODES[sig], err
    _one_clean_line(err, code)
    assert run.saved()["config"]["interrupted_in"] == "the script as written"


@SIGNALS
def test_dataloader_workers_that_hang(sig: int, tmp_path: Path) -> None:
    run = Run(tmp_path, WORKERS_SCRIPT, "--steps", "10")
    run.wait_for("step", 2)  # the workers have served their first batches, then hang
    time.sleep(0.5)
    run.signal(sig)
    code, _, err = run.finish(timeout=120)
    assert code == CODES[sig], err
    _one_clean_line(err, code)
    saved = run.saved()
    assert saved["interrupted"] == signal.Signals(sig).name
    assert saved["scenarios"][0]["devices"][0]["peak_allocated_bytes"] > 0
    assert not run.children_left()


@SIGNALS
def test_while_writing_the_reports(sig: int, tmp_path: Path) -> None:
    """Ten HTML reports take seconds to write: a signal after the first is written leaves
    every one of them written, holding the whole result marked interrupted."""
    outputs = [f"r{k}.html" for k in range(10)]
    run = Run(tmp_path, DP_SCRIPT.format(hang=""), "--no-alternatives",
              *[a for o in outputs for a in ("-o", o)])
    deadline = time.monotonic() + 240
    while not (tmp_path / "r.json").exists() and not (tmp_path / outputs[0]).exists():
        assert time.monotonic() < deadline and run.proc.poll() is None
        time.sleep(0.02)
    run.signal(sig)
    code, _, err = run.finish()
    assert code == CODES[sig], err
    line = _one_clean_line(err, code)
    assert "during the writing of the reports; wrote what was measured before it" in line
    saved = run.saved()
    assert saved["config"]["interrupted_in"] == "the writing of the reports"
    assert saved["scenarios"][0]["status"] == "ok"
    for o in outputs:
        assert "interrupted" in (tmp_path / o).read_text()


@SIGNALS
def test_a_script_that_takes_the_signal_itself(sig: int, tmp_path: Path) -> None:
    """Its own handler runs, as on a GPU (Ctrl-C: the loop ends after the step; SIGTERM:
    sys.exit(0)), and the run still ends interrupted: not measured as a whole run, no
    alternative run after it with the script's handler left in place."""
    run = Run(tmp_path, OWN_HANDLERS_SCRIPT)
    run.wait_for("step")
    run.signal(sig)
    code, _, err = run.finish()
    assert code == CODES[sig], err
    line = _one_clean_line(err, code)
    assert "during the script as written; wrote what was measured before it" in line
    assert "handlers as in plain Python" in run.marks
    if sig == signal.SIGINT:
        assert "own handler" in run.marks
    saved = run.saved()
    assert saved["interrupted"] == signal.Signals(sig).name
    assert [s["name"] for s in saved["scenarios"]] == ["dp-loss-primary"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_during_a_rung_of_the_ladder(sig: int, tmp_path: Path) -> None:
    """The rung cut short is not measured (a note says so), no rung after it runs, and the
    result is the script as written's, marked interrupted in that rung."""
    run = Run(tmp_path, ONE_GPU_SCRIPT, "--ladder")
    run.wait_for("step", 3)  # the script as written
    run.wait_for("start", 2)  # the first rung has begun
    run.wait_for("step", 4)
    run.signal(sig)
    code, _, err = run.finish()
    assert code == CODES[sig], err
    line = _one_clean_line(err, code)
    saved = run.saved()
    during = saved["config"]["interrupted_in"]
    assert during.startswith("the ladder's rung "), during
    assert f"during {during}; wrote what was measured before it" in line
    assert [s["name"] for s in saved["scenarios"]] == ["single"]
    assert saved["scenarios"][0]["status"] == "ok"
    rung = during.removeprefix("the ladder's rung ")
    assert any(n.startswith(f"ladder: {rung} interrupted by {signal.Signals(sig).name}")
               for n in saved["notes"]), saved["notes"]
    assert saved["fixes"] == []  # no rung measured whole
