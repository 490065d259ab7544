"""What the seal holds of the machine after a run: its folder watch's inotify instance is
let go when ``run_command`` returns, not when the garbage collector gets to it (each is one
of the user's ``fs.inotify.max_user_instances``, 128 by default: a process that runs many
scripts, as a test worker does, ran out, and the seal's record was then not whole)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from dpprof.script.session import ScriptConfig, parse_command, run_command

SCRIPT = """
import torch
from torch import nn

model = nn.Linear(4, 2).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    loss = model(torch.randn(8, 4).cuda()).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _inotify_instances() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += "inotify" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
    return count


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's")
def test_a_run_lets_its_folder_watch_go(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cfg = ScriptConfig(launch=parse_command(["python", str(script)], 1), steps=2)
    before = _inotify_instances()
    results = [run_command(cfg) for _ in range(3)]  # held: nothing is collected meanwhile
    assert all(r.seal is not None for r, _ in results)
    # the close runs on a thread of its own (the kernel's grace period is not waited on)
    deadline = time.monotonic() + 10.0
    while _inotify_instances() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _inotify_instances() == before
