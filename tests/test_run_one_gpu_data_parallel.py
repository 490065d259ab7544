"""DataParallel on one GPU (``device_ids=[k]``, one GPU seen, or a batch of one row): it
splits and gathers nothing, so the loss inside forward and DDP have nothing to remove. The
run says so, once, with what would spread the batch, and measures no alternatives (before,
the answer read "uses a single GPU at this batch size; DDP balances all 1 GPUs" beside a DDP
run that could only cost memory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpprof.result import RunResult
from dpprof.script.session import ScriptConfig, parse_command, run_command

SCRIPT = """
import torch
from torch import nn

B = {rows}
net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 512)).cuda({gpu})
model = nn.DataParallel(net{device_ids})
criterion = nn.CrossEntropyLoss()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    x = torch.randn(B, 64).cuda({gpu})
    y = torch.randint(0, 512, (B,)).cuda({gpu})
    loss = criterion(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _run(tmp_path: Path, gpus: int, rows: int = 96, gpu: int | None = None) -> RunResult:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(
        rows=rows, gpu="" if gpu is None else gpu,
        device_ids="" if gpu is None else f", device_ids=[{gpu}]"))
    result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(script)], gpus),
                                         gpus=gpus, steps=3))
    return result


def _one_gpu_note(result: RunResult) -> str:
    (note,) = [n for n in result.notes if n.startswith("no alternatives")]
    return note


@pytest.mark.parametrize("gpu", [0, 2])
def test_device_ids_of_one_gpu_run_no_alternatives_and_say_why(tmp_path: Path,
                                                                gpu: int) -> None:
    result = _run(tmp_path, gpus=4, gpu=gpu)
    assert [s.name for s in result.scenarios] == ["dp-loss-primary"]
    (used,) = [d.index for d in result.scenarios[0].devices if d.used]
    assert used == gpu
    note = _one_gpu_note(result)
    assert f"DataParallel ran on one GPU, cuda:{gpu}" in note
    assert "device_ids=None" in note
    assert result.comparison.verdict.startswith(
        f"Under dp-loss-primary DataParallel runs on one GPU, cuda:{gpu}, peaking at")
    assert "all 1 GPUs" not in result.comparison.verdict and "batch" not in result.comparison.verdict


def test_one_gpu_seen_points_to_gpus(tmp_path: Path) -> None:
    result = _run(tmp_path, gpus=1)
    assert [s.name for s in result.scenarios] == ["dp-loss-primary"]
    assert "--gpus N" in _one_gpu_note(result)


def test_a_batch_of_one_row_is_named_as_the_reason(tmp_path: Path) -> None:
    result = _run(tmp_path, gpus=4, rows=1)
    assert "batch of one row" in _one_gpu_note(result)
    assert "(a batch of 1 row splits no further)" in result.comparison.verdict


def test_two_gpus_are_both(tmp_path: Path) -> None:
    """With two GPUs the alternatives run, and the answer counts them in words."""
    result = _run(tmp_path, gpus=2)
    assert {"dp-loss-forward", "ddp"} <= {s.name for s in result.scenarios}
    assert not [n for n in result.notes if n.startswith("no alternatives")]
    assert "DDP balances both GPUs" in result.comparison.verdict
