"""A process the script forks from dpprof's (a DataLoader's worker, which torch's
``terminate()`` stops with SIGTERM when it does not join in time) takes a stop signal as it
would without dpprof. It inherited dpprof's handler, which unwound dpprof's run in the child:
the child said "dpprof: interrupted (SIGTERM) ... no report written", removed the parent's
temporary files, and the parent's run then failed ("No such file or directory"); found
intermittently on ultralytics/yolov5 under ``dpprof run``. Now the child ends by the signal
(or by the handler the script gave it), and the run goes on to its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = '''\
import os, signal, time
import torch
import torch.nn as nn

pid = os.fork()
if pid == 0:  # a worker the script forks, stopped as torch's terminate() stops it
    if {own_handler}:
        signal.signal(signal.SIGTERM, lambda *args: os._exit(7))
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
    os._exit(0)
_, status = os.waitpid(pid, 0)
if os.WIFSIGNALED(status):
    print("child ended by signal", os.WTERMSIG(status))
else:
    print("child exited", os.WEXITSTATUS(status))
model = nn.DataParallel(nn.Linear(8, 8)).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    loss = model(torch.randn(16, 8).cuda()).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''


@pytest.mark.parametrize(("own_handler", "said"), [
    (False, "child ended by signal 15"),  # SIGTERM's default action
    (True, "child exited 7"),  # the script's handler, set in the child
])
def test_a_forked_child_takes_sigterm_as_without_dpprof(tmp_path: Path, own_handler: bool,
                                                         said: str) -> None:
    (tmp_path / "train.py").write_text(SCRIPT.format(own_handler=own_handler))
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, "-m", "dpprof", "run", "--gpus", "2",
                           "--no-alternatives", "-o", str(out), "--", "python", "train.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items()
                               if k != "CUDA_VISIBLE_DEVICES"})
    assert done.returncode == 0, done.stderr
    assert said in done.stdout, done.stdout
    assert "interrupted" not in done.stdout + done.stderr
    (ran,) = json.loads(out.read_text())["scenarios"]
    assert ran["status"] == "ok"
