"""A script that validates between its optimizer steps: ``dpprof run``'s predicted step time
is the training step's, the validation left out of it and its time given apart; a model
called without gradients as part of the step (a teacher, a GAN's generator) stays in it.

Found on clovaai's deep-text-recognition-benchmark ``train.py``, which validates after its
first step: the validation fell in the first measured step and made the mean step 2.3x the
training step's (1,264 ms against 540 ms, DataParallel over 4 GPUs)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from dpprof.result import ScenarioResult
from dpprof.script.session import ScriptConfig, parse_command, run_command

TRAIN = """
    import torch
    import torch.nn as nn

    model = nn.DataParallel(nn.Sequential(nn.Linear(512, 2048), nn.ReLU(),
                                          nn.Linear(2048, 512)).cuda())
    teacher = nn.Linear(512, 512).cuda().eval()  # not stepped by the optimizer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(256, 512, device="cuda")
        {in_step}
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == {validate_after}:
            model.eval()
            with torch.no_grad():
                for _ in range(20):
                    print(model(torch.randn(16384, 512, device="cuda")).sum().item())
            model.train()
"""


def _run(tmp_path: Path, name: str, in_step: str = "", validate_after: int = -1
         ) -> ScenarioResult:
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(TRAIN.format(in_step=in_step,
                                                   validate_after=validate_after)))
    result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(script)], 4)),
                            alternatives=False)
    s = result.scenarios[0]
    assert s.status == "ok", s.message
    assert s.predicted_step_time_s is not None
    return s


def test_validation_between_steps_is_left_out_of_the_step_time(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = _run(tmp_path, "plain")
    # validating after the warm-up step: the validation runs inside the first measured step
    validating = _run(tmp_path, "validating", validate_after=0)
    assert plain.predicted_step_time_s is not None
    assert validating.predicted_step_time_s == pytest.approx(plain.predicted_step_time_s,
                                                             rel=1e-6)
    note = next(n for n in validating.notes if n.startswith("step time: the training step's"))
    assert "eval mode without gradients" in note
    assert not any(n.startswith("step time: the training step's") for n in plain.notes)
    # its memory still counts, under the phase it ran in: the validation's 16384-row batch
    # is cuda:0's peak, higher than the training step's
    assert validating.devices[0].peak_phase == "evaluation (step 2)"
    assert validating.devices[0].peak_allocated_bytes > plain.devices[0].peak_allocated_bytes
    capsys.readouterr()


@pytest.mark.parametrize("in_step", [
    # a teacher in eval mode under no_grad: not the model the optimizer steps
    "with torch.no_grad():\n            x = teacher(x)",
    # the trained model itself under no_grad but in train mode (a GAN's generator)
    "with torch.no_grad():\n            x = model(x)",
])
def test_a_model_called_without_gradients_inside_the_step_stays_in_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], in_step: str) -> None:
    plain = _run(tmp_path, "plain")
    more = _run(tmp_path, "more", in_step=in_step)
    assert plain.predicted_step_time_s is not None and more.predicted_step_time_s is not None
    assert more.predicted_step_time_s > plain.predicted_step_time_s
    assert not any(n.startswith("step time: the training step's") for n in more.notes)
    capsys.readouterr()
