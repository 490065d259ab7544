"""The samples a second of a script that accumulates gradients count every batch of its
step: the optimizer steps once every ``accumulate`` batches, and the step predicted runs
them all. Ultralytics steps once every 64 images (its nominal batch): at a batch of 8 the
run said 19 samples a second where the step it predicted trains 64 images (154)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from script_runs import run_printing

SCRIPT = """
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(40):
        loss = model(torch.randn(8, 32).cuda()).square().mean() / ACCUMULATE
        loss.backward()
        if (i + 1) % ACCUMULATE == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


@pytest.mark.parametrize("accumulate", [1, 4])
def test_a_steps_samples_are_its_batches(tmp_path: Path, accumulate: int) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT).replace("ACCUMULATE", str(accumulate)))
    result, _ = run_printing(script)
    (single,) = result.scenarios
    assert single.status == "ok", single.message
    assert single.batch == 8
    step_s, per_s = single.predicted_step_time_s, single.predicted_samples_per_s
    assert step_s and per_s
    assert per_s * step_s == pytest.approx(8 * accumulate)
