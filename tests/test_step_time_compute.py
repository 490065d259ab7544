"""``dpprof run --compute`` predicts the step from the ops the run made, as over meta tensors:
over CPU tensors the ops on virtual GPUs took a faster path that logged none of them, so the
prediction was made of DataParallel's collectives alone (a Hugging Face wav2vec2 step
predicted at 0.6 ms, its GPUs' compute 0; over meta 14 ms) or not made at all."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from dpprof.result import ScenarioResult
from dpprof.script.session import ScriptConfig, parse_command, run_command

SCRIPT = """
    import torch, torch.nn as nn
    model = nn.DataParallel(nn.Sequential(nn.Linear(256, 1024), nn.ReLU(),
                                          nn.Linear(1024, 256)).cuda())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x = torch.randn(64, 256, device="cuda")
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
"""


def _run(tmp_path: Path, compute: bool) -> ScenarioResult:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(script)], 2),
                                         gpus=2, compute=compute), alternatives=False)
    s = result.scenarios[0]
    assert s.status == "ok", s.message
    return s


def test_a_compute_run_predicts_the_step_from_its_ops(tmp_path: Path) -> None:
    meta, cpu = _run(tmp_path, False), _run(tmp_path, True)
    assert meta.predicted_step_time_s and cpu.predicted_step_time_s
    # the same matmuls on each GPU; over CPU tensors DataParallel's scatter, broadcast and
    # reduce also run their copies and concatenations as ops (a few per step)
    for m, c in zip(meta.devices, cpu.devices, strict=True):
        assert c.predicted_busy_s["compute"] == pytest.approx(m.predicted_busy_s["compute"],
                                                              rel=0.15)
    assert cpu.predicted_step_time_s == pytest.approx(meta.predicted_step_time_s, rel=0.25)
