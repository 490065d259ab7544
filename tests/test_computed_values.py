"""Under --compute a rank with sharded parameters computes with its own shards in every
slot (dpprof.script.computed_values): its losses are not the GPUs', and the run says so. The
same model trained by one plain process is the reference: every rank of a real FSDP2 run
with the same batch prints its losses; DDP, whose ranks hold whole parameters, does too
and gets no note."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dpprof.script.session import ScriptConfig, parse_command, run_command

SCRIPT = """
import os, torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
distributed = "LOCAL_RANK" in os.environ
if distributed:
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
device = "cuda" if distributed else "cpu"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(device)
if distributed and os.environ.get("WRAP") == "fsdp":
    fully_shard(model)
elif distributed:
    model = DDP(model, device_ids=[int(os.environ["LOCAL_RANK"])])
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).to(device)
for step in range(3):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if not distributed or dist.get_rank() == 0:
        print("loss", step, round(loss.item(), 5))
"""

NOTE = "the numbers the script computes with --compute"


def _losses(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("loss")]


@pytest.mark.parametrize("wrap", ["fsdp", "ddp"])
def test_a_compute_run_with_sharded_parameters_says_its_numbers_are_not_the_gpus(
        wrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    plain = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr[-2000:]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("WRAP", wrap)
    result, _ = run_command(ScriptConfig(
        launch=parse_command(["torchrun", "--nproc-per-node", "2", "train.py"], 2), gpus=2,
        compute=True, steps=5), alternatives=False)
    (scenario,) = result.scenarios
    assert scenario.status == "ok", scenario.message
    printed = _losses(capsys.readouterr().out)
    noted = any(NOTE in note for note in scenario.notes)
    if wrap == "fsdp":
        # rank 0's shard in every slot: not the model one process trains
        assert scenario.name == "fsdp2" and printed != _losses(plain.stdout)
        assert noted
    else:
        assert printed == _losses(plain.stdout) and not noted
