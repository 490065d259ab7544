"""The loss inside forward in a mixed-precision loop, as the AMP recipes write it: the
forward and the loss under ``torch.autocast("cuda")``, the loss divided for gradient
accumulation, the backward through a ``GradScaler``; the loss a module of torch's, a
function of torch's bound before the loop (``criterion = F.cross_entropy``) or one written in
it. Inside autocast, cross-entropy is emulated op by op (as ATen's composite runs it on a GPU:
log-probabilities in float16, ``nll_loss`` in float32), whichever way it is reached: the
``dp-loss-forward`` alternative peaks on every GPU as the same loop with the fix written by
hand, to the byte (the loss before its division for accumulation is freed as the fixed code
frees it), and with real numbers prints the losses the script prints as written."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_run_loss_forms import assert_moved_as_by_hand

from dpprof.script.session import ScriptConfig, parse_command

HEAD = """
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
B, D, C = 96, 64, 512
net = nn.Sequential(nn.Linear(D, 256), nn.ReLU(), nn.Linear(256, C)).cuda()
criterion = {criterion}
accum = 2
"""

# the loop, as the AMP recipe writes it, around the step's forward and loss ({step})
LOOP = """
model = nn.DataParallel({model})
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cuda")
for step in range(4):
    x = torch.randn(B, D).cuda()
    y = torch.randint(0, C, (B,)).cuda()
    with torch.autocast("cuda", dtype={{dtype}}):
{step}
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
"""

AS_WRITTEN = HEAD + LOOP.format(model="net", step="""\
        out = model(x)
        loss = {loss}
    print("loss", repr(loss.item()))""")

BY_HAND = HEAD + """

class WithLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        out = self.model(x)
        return {loss}

""" + LOOP.format(model="WithLoss(net)", step="        loss = model(x, y).mean()")

# the criterion, and the loss the loop computes with it from the outputs ``out``
LOSSES = {
    "module": ("nn.CrossEntropyLoss()", "criterion(out, y)"),
    "module_accumulated": ("nn.CrossEntropyLoss()", "criterion(out, y) / accum"),
    "functional_accumulated": ("F.cross_entropy", "criterion(out, y) / accum"),
    "smoothed": ("nn.CrossEntropyLoss(label_smoothing=0.1)", "criterion(out, y)"),
    "functional_written": ("None", "F.cross_entropy(out, y, label_smoothing=0.1) / accum"),
}


def _config(script: Path) -> ScriptConfig:
    return ScriptConfig(launch=parse_command(["python", str(script)], 2), steps=3)


@pytest.mark.parametrize(("loss", "dtype"), [
    ("module", "torch.float16"), ("module_accumulated", "torch.float16"),
    ("module_accumulated", "torch.bfloat16"), ("functional_accumulated", "torch.float16"),
    ("functional_accumulated", "torch.bfloat16"), ("smoothed", "torch.bfloat16"),
    ("functional_written", "torch.float16")])
def test_an_amp_loops_loss_moves_inside_forward_as_written_by_hand(
        tmp_path: Path, loss: str, dtype: str) -> None:
    criterion, computed = LOSSES[loss]
    script = tmp_path / "train.py"
    script.write_text(AS_WRITTEN.format(criterion=criterion, loss=computed, dtype=dtype))
    fixed = tmp_path / "fixed.py"
    fixed.write_text(BY_HAND.format(criterion=criterion,
                                    loss=computed,
                                    dtype=dtype))
    assert_moved_as_by_hand(_config(script), _config(fixed), slack_bytes=0)
