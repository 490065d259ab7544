"""An optimizer whose step calls another's (torch's ZeroRedundancyOptimizer, a Lookahead
wrapper built on ``torch.optim.Optimizer``) makes one step of the script: ``--steps`` counts
the outermost, as it counts a plain optimizer's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from script_runs import run_script

# the same loop with a plain optimizer, or wrapped by one that steps it
LOOP = """
import torch, torch.nn as nn

class Wrapped(torch.optim.Optimizer):
    def __init__(self, inner):
        self.inner = inner
        super().__init__(inner.param_groups, {{}})

    def step(self, closure=None):
        return self.inner.step(closure)

model = nn.Linear(64, 64).cuda()
opt = torch.optim.Adam(model.parameters())
opt = {wrap}
for i in range(10):
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
    print("stepped", i)
"""


@pytest.mark.parametrize("wrap", ["opt", "Wrapped(opt)"])
def test_a_wrapped_optimizers_step_is_one_step(in_script_folder: Path,
                                               capsys: pytest.CaptureFixture[str],
                                               wrap: str) -> None:
    s = run_script(in_script_folder, LOOP.format(wrap=wrap))
    assert s.status == "ok", s.message
    stepped = [line for line in capsys.readouterr().out.splitlines()
               if line.startswith("stepped")]
    # --steps 3 (the default): the script is stopped in its third step, after two
    assert stepped == ["stepped 0", "stepped 1"]
    assert any("stopped after 3 optimizer step(s)" in n for n in s.notes)


# DDP over two ranks with Adam, or with ZeroRedundancyOptimizer sharding Adam's state
DDP_ADAM = """
import os, torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("nccl")
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
model = DDP(nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 2048)).cuda(),
            device_ids=[rank])
opt = {make}
for _ in range(3):
    model(torch.randn(16, 2048, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
"""
ADAM = "torch.optim.Adam(model.parameters())"
ZERO = "ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam)"


def test_zero_redundancy_shards_adams_state_over_the_ranks(
        in_script_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ZeroRedundancyOptimizer (ZeRO-1) runs under dpprof: each of two ranks keeps Adam's
    state for half the parameters (one of the two equal layers), so a rank's peak is lower
    by a quarter of Adam's state at least (its two moments are twice the parameters)."""
    from dpprof.script.session import ScriptConfig, parse_command, run_command

    tmp_path = in_script_folder
    for module in [m for m in sys.modules if m.startswith("torch.distributed.optim")]:
        monkeypatch.delitem(sys.modules, module)  # imported (and scripted) in the run
    peaks = {}
    for name, make in (("adam", ADAM), ("zero", ZERO)):
        script = tmp_path / f"{name}.py"
        script.write_text(DDP_ADAM.format(make=make))
        result, main = run_command(ScriptConfig(
            launch=parse_command(["torchrun", "--nproc-per-node", "2", str(script)], 2),
            gpus=2, ranks="none"), alternatives=False)
        assert main.exit_status == 0, main.script_traceback
        peaks[name] = result.scenarios[0].devices[0].peak_allocated_bytes
    params = 2 * (2048 * 2048 + 2048) * 4
    adam_state = 2 * params
    assert peaks["adam"] - peaks["zero"] >= adam_state // 4, peaks


# a framework that logs the exception its loop ends with, then raises it on (ignite's
# Engine: "Engine run is terminating due to exception: %s")
LOGGED = """
import torch, torch.nn as nn

model = nn.Linear(64, 64).cuda()
{make}
try:
    for i in range(10):
        model(torch.randn(8, 64, device="cuda")).sum().backward()
        {step}
except BaseException as e:
    print(f"terminating due to exception: {{e}}")
    raise
"""


@pytest.mark.parametrize(("make", "step", "words"), [
    ("opt = torch.optim.Adam(model.parameters())", "opt.step()", "3 optimizer steps"),
    ("lr = 0.1", "[p.data.add_(p.grad, alpha=-lr) for p in model.parameters()]",
     "3 backward passes"),
])
def test_the_stop_says_what_it_is_where_the_script_logs_it(
        in_script_folder: Path, capsys: pytest.CaptureFixture[str], make: str, step: str,
        words: str) -> None:
    s = run_script(in_script_folder, LOGGED.format(make=make, step=step))
    assert s.status == "ok", s.message
    logged = [line for line in capsys.readouterr().out.splitlines()
              if line.startswith("terminating due to exception")]
    assert logged == [f"terminating due to exception: dpprof stops the script here: {words} "
                      "measured (--steps)"]
