"""What the script's process does as it ends is done as its run ends: its exit handlers
(``atexit.register``) run inside the seal, its daemonic children end, its objects are
released (an object that writes its file in ``__del__`` wrote into the user's folder once
dpprof dropped the run's modules, after the seal: "SEAL BROKEN").

A handler that writes a file (a log's last line, a summary, a metric read from the GPU)
ran at dpprof's own exit, after every seal was gone: it wrote into the user's folder while
the report said "the script wrote nothing ... your files are as they were". Now each run's
handlers run as that run ends, however it ends (the script returns, ``sys.exit``, an error,
dpprof's stop after ``--steps``), last registered first, on the virtual GPUs, errors printed
and ignored as Python's ``atexit`` does; ``os._exit`` runs none, as it runs none in a process.

Checked as a user runs it, ``dpprof run`` in a process of its own (the leak happened at that
process's exit): the folder is byte for byte as it was after dpprof exits, the report lists
the handlers' files, and ``--keep-writes`` shows what they wrote. A DataLoader's persistent
workers, left running by each run, outlived its overlay and failed at dpprof's exit
("FileNotFoundError: ... /tmp/pymp-.../listener-..." tracebacks after the report); now they
end with their run, as a process's daemonic children end with it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

HELPER = """
import atexit
import json

ORDER = []


def remember(name):
    ORDER.append(name)


@atexit.register
def order_last():  # registered first: runs last, and writes the order the others ran in
    with open("exit/order.json", "w") as f:
        json.dump(ORDER, f)
"""

SCRIPT = """
import atexit
import os
import pathlib
import sys

import torch
from torch import nn

import helper


def summary(path, *, text):
    helper.remember("summary")
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(path).write_text(text)


def broken():
    helper.remember("broken")
    raise ValueError("a handler's own error")


atexit.register(summary, "exit/summary.txt", text="done\\n")
atexit.register(broken)


@atexit.register
def peak():
    helper.remember("peak")
    with open("exit/peak.json", "w") as f:
        json.dump(torch.cuda.max_memory_allocated(0), f)


import json

model = nn.DataParallel(nn.Linear(64, 64).cuda())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range({steps}):
    loss = model(torch.randn(32, 64).cuda()).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
{ending}
"""

# the ending -> (its code after the loop, the loop's steps: 2 end before --steps 3)
ENDINGS = {
    "returns": ("", 2),
    "sys.exit(0)": ("sys.exit(0)", 2),
    "sys.exit(3)": ("sys.exit(3)", 2),
    "raises": ("raise RuntimeError('the script fails')", 2),
    "stopped after --steps": ("", 100),
    "os._exit": ("os._exit(0)", 2),
}
HANDLER_FILES = ["exit/order.json", "exit/peak.json", "exit/summary.txt"]


def _dpprof_run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m dpprof run ARGS`` as a user runs it, in a process of its own (with the
    kernel's mount namespace where the machine gives one, as by default)."""
    env = {k: v for k, v in os.environ.items() if k != "DPPROF_NO_NAMESPACE"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run([sys.executable, "-m", "dpprof", "run", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_process_end_run_in_the_run_and_never_touch_the_users_folder(
        tmp_path: Path, ending: str) -> None:
    work = tmp_path / "work"
    work.mkdir()
    code, steps = ENDINGS[ending]
    (work / "helper.py").write_text(textwrap.dedent(HELPER))
    (work / "train.py").write_text(SCRIPT.format(steps=steps, ending=code))
    (work / "exit").mkdir()
    (work / "exit" / "summary.txt").write_text("the user's own summary\n")
    before = _hashes(work)
    done = _dpprof_run(["--gpus", "2", "--steps", "3", "--no-alternatives", "--keep-writes",
                        str(tmp_path / "kept"), "-o", str(tmp_path / "r.json"), "--", "python",
                        "train.py"], work)
    assert _hashes(work) == before, done.stderr[-3000:]  # after dpprof's own exit
    # the script's own status, as dpprof ends with it
    assert done.returncode == {"raises": 1, "sys.exit(3)": 3}.get(ending, 0), done.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    written = sorted(w["path"] for w in result["writes"] if w["kind"] == "file")
    kept = tmp_path / "kept" / "as-written" / str(work).lstrip("/")
    if ending == "os._exit":  # a process that ends so runs no handler
        assert written == [] and "atexit callback" not in done.stderr
        return
    assert written == HANDLER_FILES
    # last registered first; the error printed, ignored, the handlers after it run
    assert json.loads((kept / "exit" / "order.json").read_text()) == [
        "peak", "broken", "summary"]
    assert (kept / "exit" / "summary.txt").read_text() == "done\n"
    assert "Exception ignored in atexit callback" in done.stderr
    assert ("ValueError: a handler's own error" in done.stderr
            and "During handling" not in done.stderr)
    # on the virtual GPUs: the run's own peak, read as the run ended (max_memory_allocated:
    # the tensors and the cuBLAS workspaces)
    peak = json.loads((kept / "exit" / "peak.json").read_text())
    (scenario,) = result["scenarios"]
    device = scenario["devices"][0]
    assert peak == device["peak_allocated_bytes"] + device["workspace_bytes"] > 0


def test_each_run_runs_its_own_handlers(tmp_path: Path) -> None:
    """The script runs once more for each alternative: its handlers run at the end of each,
    once each, as in a process of their own."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "helper.py").write_text(textwrap.dedent(HELPER))
    (work / "train.py").write_text(SCRIPT.format(steps=4, ending=""))
    (work / "exit").mkdir()
    before = _hashes(work)
    done = _dpprof_run(["--gpus", "2", "--steps", "3", "--keep-writes", str(tmp_path / "kept"),
                        "-o", str(tmp_path / "r.json"), "--", "python", "train.py"], work)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _hashes(work) == before
    runs = sorted(p.name for p in (tmp_path / "kept").iterdir() if p.is_dir())
    assert "as-written" in runs and "ddp" in runs
    for run in runs:
        kept = tmp_path / "kept" / run / str(work).lstrip("/")
        assert json.loads((kept / "exit" / "order.json").read_text()) == [
            "peak", "broken", "summary"], run


PERSISTENT = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

data = TensorDataset(torch.randn(1024, 64), torch.randint(0, 10, (1024,)))
loader = DataLoader(data, batch_size=128, num_workers=2, persistent_workers=True,
                    pin_memory=True)
model = nn.DataParallel(nn.Linear(64, 10).cuda())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x.cuda()), y.cuda())
        opt.zero_grad()
        loss.backward()
        opt.step()
print("trained")
"""


def test_persistent_workers_end_with_their_run(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(PERSISTENT)
    done = _dpprof_run(["--gpus", "2", "--steps", "3", "-o", str(tmp_path / "r.json"), "--",
                        "python", "train.py"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert [s["status"] for s in result["scenarios"]] == ["ok"] * 3
    assert result["seal"]["ended_processes"] == []  # they ended as the run did, not after


LOGGER = """
class Logger:  # writes its lines when collected, as loggers copied between repositories do
    def __init__(self, path):
        self.path, self.lines = path, []

    def log(self, line):
        self.lines.append(line)

    def __del__(self):
        with open(self.path, "w") as f:
            f.write("\\n".join(self.lines) + "\\n")
"""

COLLECTED = """
import torch
from torch import nn

from logger import Logger

{where}


def train(logger, steps):
    model = nn.DataParallel(nn.Linear(64, 64).cuda())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        loss = model(torch.randn(32, 64).cuda()).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        logger.log(f"step {{step}}")
    {end}


{call}
"""
# where the logger lives -> (code at the module's top, the end of train(), the call)
HOLDERS = {
    "a global of the script": ("LOGGER = Logger('log.txt')", "", "train(LOGGER, 2)"),
    "a global of its own module": ("import logger\nlogger.LOG = Logger('log.txt')", "",
                                   "train(logger.LOG, 2)"),
    "a local, the run stopped after --steps": (
        "", "", "def main():\n    log = Logger('log.txt')\n    train(log, 100)\n\n\nmain()"),
    "a local, the script raised": (
        "", "raise RuntimeError('the script fails')",
        "def main():\n    log = Logger('log.txt')\n    train(log, 2)\n\n\nmain()"),
}


@pytest.mark.parametrize("holder", sorted(HOLDERS))
def test_objects_collected_as_the_run_ends_write_inside_it(tmp_path: Path, holder: str) -> None:
    top, end, call = HOLDERS[holder]
    (tmp_path / "logger.py").write_text(LOGGER)
    (tmp_path / "train.py").write_text(COLLECTED.format(where=top, end=end, call=call))
    before = _hashes(tmp_path)
    done = _dpprof_run(["--gpus", "2", "--steps", "3", "--no-alternatives", "--keep-writes",
                        str(tmp_path.parent / "kept"), "-o", str(tmp_path.parent / "r.json"),
                        "--", "python", "train.py"], tmp_path)
    assert _hashes(tmp_path) == before, done.stderr[-3000:]
    assert "SEAL BROKEN" not in done.stderr + done.stdout
    result = json.loads((tmp_path.parent / "r.json").read_text())
    assert [w["path"] for w in result["writes"]] == ["log.txt"], done.stderr[-3000:]
    kept = tmp_path.parent / "kept" / "as-written" / str(tmp_path).lstrip("/")
    assert (kept / "log.txt").read_text() == "step 0\nstep 1\n"


OUTLIVING = """
import multiprocessing
import os
import subprocess
import sys

import torch
from torch import nn

LATE = os.path.abspath("late.txt")


def write_late(seconds=2):
    import time
    time.sleep(seconds)
    with open(LATE, "w") as f:
        f.write("late")


{start}
model = nn.DataParallel(nn.Linear(64, 64).cuda())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    loss = model(torch.randn(32, 64).cuda()).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
STARTS = {
    "subprocess.Popen": ("subprocess.Popen(['sh', '-c', 'sleep 2; echo late > ' + LATE])",
                         "sh -c sleep 2; echo late > "),
    "a shell's background job": ("os.system('(sleep 2; echo late > ' + LATE + ') &')",
                                 "sh -c (sleep 2; echo late > "),
    # a non-daemonic child is joined as the run ends, as Python's exit joins it: one that
    # runs past the while its run waits for it (a consumer waiting for work the stopped
    # script never sends) ends with the run
    "multiprocessing.Process": (
        "if __name__ == '__main__':\n"
        "    multiprocessing.Process(target=write_late, args=(60,)).start()",
        "a process the script forked"),
}


@pytest.mark.parametrize("start", sorted(STARTS))
def test_processes_that_outlive_their_run_end_with_it(tmp_path: Path, start: str) -> None:
    """A process the script starts and leaves running outlived its run: its write, after
    the run's overlays were lifted, went into the user's folder. Now it ends with its run
    (a process's end does not wait for it), and the report names it."""
    code, named = STARTS[start]
    (tmp_path / "train.py").write_text(OUTLIVING.format(start=code))
    before = _hashes(tmp_path)
    done = _dpprof_run(["--gpus", "2", "--steps", "3", "--no-alternatives", "-o",
                        str(tmp_path.parent / "r.json"), "--", "python", "train.py"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    time.sleep(3)  # past the write it would have made
    assert _hashes(tmp_path) == before
    ended = json.loads((tmp_path.parent / "r.json").read_text())["seal"]["ended_processes"]
    assert len(ended) >= 1 and any(named in e for e in ended), ended


def test_a_process_the_script_leaves_to_finish_is_joined_inside_its_run(tmp_path: Path) -> None:
    """A non-daemonic ``multiprocessing.Process`` the script starts and never joins (a
    checkpoint written in a process of its own): Python's exit waits for it, and so does
    the end of its run: its write is the run's, inside the run's overlay, and it is no
    process the run left behind. It used to be ended with the run, its file never
    written."""
    (tmp_path / "train.py").write_text(OUTLIVING.format(
        start="if __name__ == '__main__':\n"
              "    multiprocessing.Process(target=write_late, args=(0.5,)).start()"))
    before = _hashes(tmp_path)
    done = _dpprof_run(["--gpus", "2", "--steps", "3", "--no-alternatives", "--keep-writes",
                        str(tmp_path.parent / "kept"), "-o", str(tmp_path.parent / "r.json"),
                        "--", "python", "train.py"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _hashes(tmp_path) == before
    result = json.loads((tmp_path.parent / "r.json").read_text())
    assert result["seal"]["ended_processes"] == []
    assert [w["path"] for w in result["writes"]] == ["late.txt"]
    kept = tmp_path.parent / "kept" / "as-written" / str(tmp_path).lstrip("/")
    assert (kept / "late.txt").read_text() == "late"


def test_pythons_own_helper_processes_serve_on(tmp_path: Path) -> None:
    """multiprocessing's resource tracker, started by a run that first needs it (shared
    memory, a semaphore), serves the process for its life: it is not the run's to end, nor
    named as the script's (KAIR's DDP path started it, and the report named it)."""
    (tmp_path / "train.py").write_text(OUTLIVING.format(
        start="from multiprocessing import shared_memory\n"
              "block = shared_memory.SharedMemory(create=True, size=64)\n"
              "block.close()\nblock.unlink()"))
    done = _dpprof_run(["--gpus", "2", "--steps", "3", "-o", str(tmp_path.parent / "r.json"),
                        "--", "python", "train.py"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path.parent / "r.json").read_text())
    assert result["seal"]["ended_processes"] == []
    assert "resource_tracker" not in done.stderr + done.stdout
