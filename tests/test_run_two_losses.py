"""Two losses on the same DataParallel outputs (mixup's ``lam * criterion(out, y_a) + (1 - lam)
* criterion(out, y_b)``, as facebookresearch/mixup-cifar10 writes it): the loss-inside-forward
alternative computes both inside forward on each replica's outputs, with one forward a step.
It ran a second forward for the second loss (twice the activations), or, where the script
also reads the outputs, computed the second loss on cuda:0; its figures are held here to the
same script with the fix written by hand, run as written."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpprof.result import ScenarioResult
from dpprof.script.session import ScriptConfig, parse_command, run_command

COMMON = """
import torch
from torch import nn

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 8192)).cuda()
criterion = nn.CrossEntropyLoss()
"""

# the script as people write it: the loss on the gathered outputs, through a helper
AS_WRITTEN = COMMON + """
model = nn.DataParallel(net)
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def mixup_criterion(criterion, pred, y_a, y_b, lam):
    return lam * criterion(pred, y_a) + (1 - lam) * criterion(pred, y_b)


for step in range(4):
    x = torch.randn(256, 512).cuda()
    y = torch.randint(0, 8192, (256,)).cuda()
    index = torch.randperm(256).cuda()
    lam = 0.7
    mixed = lam * x + (1 - lam) * x[index]
    y_a, y_b = y, y[index]
    out = model(mixed)
    loss = mixup_criterion(criterion, out, y_a, y_b, lam)
    {accuracy}
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

# the fix written by hand: both losses inside forward, each replica's
BY_HAND = COMMON + """

class MixupLoss(nn.Module):
    def __init__(self, model, criterion):
        super().__init__()
        self.model, self.criterion = model, criterion

    def forward(self, x, y_a, y_b, lam):
        out = self.model(x)
        loss = lam * self.criterion(out, y_a) + (1 - lam) * self.criterion(out, y_b)
        return {returned}


model = nn.DataParallel(MixupLoss(net, criterion))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    x = torch.randn(256, 512).cuda()
    y = torch.randint(0, 8192, (256,)).cuda()
    index = torch.randperm(256).cuda()
    lam = 0.7
    mixed = lam * x + (1 - lam) * x[index]
    y_a, y_b = y, y[index]
    {call}
    {accuracy}
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

ACCURACY = "correct = out.argmax(1).eq(y_a).sum()"
SLACK_BYTES = 64 * 1024  # the per-replica scalars each way returns and gathers


def _scenarios(folder: Path, name: str, source: str, alternatives: bool
               ) -> dict[str, ScenarioResult]:
    script = folder / name
    script.write_text(source)
    result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(script)], 2)),
                            alternatives=alternatives)
    return {s.name: s for s in result.scenarios}


@pytest.mark.parametrize("reads_outputs", [False, True], ids=["loss-only", "accuracy-too"])
def test_two_losses_on_the_outputs_move_inside_forward_as_the_hand_written_fix(
        tmp_path: Path, reads_outputs: bool) -> None:
    accuracy = ACCURACY if reads_outputs else ""
    ran = _scenarios(tmp_path, "mixup.py", AS_WRITTEN.format(accuracy=accuracy), True)
    call = ("loss, out = model(mixed, y_a, y_b, lam)\n    loss = loss.mean()" if reads_outputs
            else "loss = model(mixed, y_a, y_b, lam).mean()")
    returned = "loss, out" if reads_outputs else "loss"
    fixed = _scenarios(tmp_path, "fixed.py",
                       BY_HAND.format(returned=returned, call=call, accuracy=accuracy), False)
    alt = ran["dp-loss-forward"]
    by_hand = next(iter(fixed.values()))
    assert alt.status == by_hand.status == "ok", (alt.message, by_hand.message)
    for moved, written in zip(alt.devices, by_hand.devices, strict=True):
        assert abs(moved.peak_allocated_bytes - written.peak_allocated_bytes) <= SLACK_BYTES, (
            moved.index, moved.peak_allocated_bytes, written.peak_allocated_bytes)
    if not reads_outputs:  # and lower on cuda:0 than the losses over the whole batch there
        primary = ran["dp-loss-primary"].devices[0].peak_allocated_bytes
        assert alt.devices[0].peak_allocated_bytes < primary


EVALUATED = COMMON + """
model = nn.DataParallel(net)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    for k in range({evaluations}):  # an evaluation left under grad: losses, no backward
        xv = torch.randn(256, 512).cuda()
        yv = torch.randint(0, 8192, (256,)).cuda()
        out = model(xv)
        seen = criterion(out, yv) + criterion(out, yv.flip(0))
    x = torch.randn(256, 512).cuda()
    y = torch.randint(0, 8192, (256,)).cuda()
    loss = criterion(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_outputs_held_for_a_second_loss_go_with_the_next_forward(tmp_path: Path) -> None:
    """A loop that computes losses without a backward (an evaluation under grad) lets each
    iteration's outputs go, as the fixed code does: the peak is the same after one such
    iteration as after four (the held outputs piled up until the next backward)."""
    peaks = []
    for evaluations in (1, 4):
        ran = _scenarios(tmp_path, f"eval{evaluations}.py",
                         EVALUATED.format(evaluations=evaluations), True)
        peaks.append([d.peak_allocated_bytes for d in ran["dp-loss-forward"].devices])
    assert peaks[0] == peaks[1]
