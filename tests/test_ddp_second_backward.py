"""A GAN that computes its generator's and its discriminator's losses in one forward and
calls backward() on each (NVIDIA's pix2pixHD under DataParallel): under torch's DDP the
second backward's autograd hooks are ignored (reducer.cpp's ``expect_autograd_hooks_`` is
cleared by ``finalize_backward`` until the next forward), so it runs, its later gradients
never all-reduced. dpprof's emulated rank counted them as a new backward and raised "Expected
to have finished reduction in the prior iteration" at the next forward; then, measured with
``find_unused_parameters=True`` (where torch raises "Trying to backward through the graph a
second time"), the report blamed "tensors made for the whole batch's rows"."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dpprof.script.ddp_run import LATE_GRADIENTS
from dpprof.script.session import ScriptConfig, parse_command, run_command

GAN = """
import torch
from torch import nn


class GD(nn.Module):
    def __init__(self):
        super().__init__()
        self.G = nn.Linear(256, 256)
        self.D = nn.Linear(256, 1){unused}

    def forward(self, x):
        fake = self.G(x)
        loss_g = self.D(fake).mean()
        loss_d = self.D(fake.detach()).mean() + self.D(x).mean()
        return [loss_g, loss_d]


def train_step(model, x, opt_g, opt_d):
    loss_g, loss_d = [loss.mean() for loss in model(x)]  # the replicas' means
    opt_g.zero_grad()
    loss_g.backward()
    opt_g.step()
    opt_d.zero_grad()
    loss_d.backward()
    opt_d.step()

"""

DATA_PARALLEL = GAN + """
model = nn.DataParallel(GD()).cuda()
opt_g = torch.optim.Adam(model.module.G.parameters())
opt_d = torch.optim.Adam(model.module.D.parameters())
for step in range(5):
    train_step(model, torch.randn(64, 256).cuda(), opt_g, opt_d)
"""

# torch's own DDP, one gloo rank on the CPU, the same program: what it raises, if anything
REAL_DDP = GAN + """
import os
import sys

import torch.distributed as dist

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
model = nn.parallel.DistributedDataParallel(GD(), find_unused_parameters=sys.argv[2] == "1")
opt_g = torch.optim.Adam(model.module.G.parameters())
opt_d = torch.optim.Adam(model.module.D.parameters())
try:
    for step in range(3):
        train_step(model, torch.randn(32, 256), opt_g, opt_d)
    print("RAN")
except RuntimeError as e:
    print("RAISED", str(e).splitlines()[0])
dist.destroy_process_group()
"""


def _torch_ddp(tmp_path: Path, find_unused: bool) -> str:
    script = tmp_path / "real_ddp.py"
    script.write_text(REAL_DDP.format(unused=""))
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "store"),
                        "1" if find_unused else "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-1]


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unused: str = "") -> Any:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gan.py").write_text(DATA_PARALLEL.format(unused=unused))
    result, main = run_command(ScriptConfig(launch=parse_command(["python", "gan.py"], 2),
                                            gpus=2, steps=3))
    assert main.exit_status == 0, main.script_traceback
    return result


def test_a_second_backward_over_one_forward_runs_under_ddp_as_torch_runs_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _torch_ddp(tmp_path, find_unused=False) == "RAN"
    result = _run(tmp_path, monkeypatch)
    (ddp,) = [s for s in result.scenarios if s.name == "ddp"]
    assert ddp.status == "ok", ddp.message
    assert LATE_GRADIENTS in ddp.notes
    # measured as torch runs it: no find_unused_parameters retry
    assert not any("find_unused_parameters=True" in n for n in result.notes), result.notes


def test_a_failure_that_is_not_about_the_batch_s_rows_is_not_blamed_on_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a parameter no loss uses, DDP needs find_unused_parameters=True, under which
    torch's own DDP raises at the second backward (its _DDPSink node, shared by both losses,
    ran its backward once): the report names the line, and does not say the share of the
    batch broke it."""
    raised = _torch_ddp(tmp_path, find_unused=True)
    assert raised.startswith("RAISED Trying to backward through the graph a second time")
    result = _run(tmp_path, monkeypatch, unused="\n        self.spare = nn.Linear(4, 4)")
    (ddp,) = [s for s in result.scenarios if s.name == "ddp"]
    assert ddp.status == "error"
    assert "Trying to backward through the graph a second time" in ddp.message
    line = DATA_PARALLEL.format(unused="\n        self.spare = nn.Linear(4, 4)").splitlines(
        ).index("    loss_d.backward()") + 1
    notes = " ".join(result.notes) + " ".join(ddp.notes)
    assert (f"with each rank on its own GPU the script raised at gan.py:{line} "
            "(loss_d.backward()), where as written it did not") in notes, notes
    assert "whole batch's rows" not in notes
