"""An op whose output's shape depends on values the emulation does not have (the model's
outputs: a detector's boxes kept by their confidence) takes the shape the stand-ins give
(zeros: a mask selects nothing), counted and named at the script's line, and the run goes
on; a tensor of no elements has its values (none) known.

Found on ultralytics' YOLOv5 ``train.py``: its AMP check runs the model in fp32 and under
autocast, keeps the boxes above a confidence (``x[x[..., 4] > conf]``), and compares the
two; the boolean mask stopped the check with dpprof's error, which the check caught and
answered by turning mixed precision off: the emulation trained in fp32 where a GPU trains
under autocast."""

from __future__ import annotations

import textwrap
from pathlib import Path

from script_runs import run_printing

SCRIPT = """
    import torch
    from torch import nn


    def detections(model, image):
        out = model(image)  # boxes: x, y, w, h, confidence
        return out[out[..., 4] > 0.25]  # the boxes kept


    def check_amp(model):
        image = torch.rand(1, 3, 32, 32, device="cuda")
        with torch.no_grad():
            a = detections(model.eval(), image)
            with torch.autocast("cuda"):
                b = detections(model, image)
        model.train()
        try:
            return a.shape == b.shape and torch.allclose(a, b.float(), atol=0.1)
        except Exception:
            return False


    model = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.Flatten(2)).cuda()
    model = nn.Sequential(*model, nn.Unflatten(2, (32, 32)))
    amp = check_amp(model)
    print("amp", amp)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        with torch.autocast("cuda", enabled=amp):
            loss = model(torch.rand(8, 3, 32, 32, device="cuda")).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
"""


def test_a_mask_of_unknown_values_selects_nothing_counted_and_the_run_goes_on(
        tmp_path: Path) -> None:
    script = tmp_path / "detect.py"
    script.write_text(textwrap.dedent(SCRIPT))
    result, printed = run_printing(script)
    s = result.scenarios[0]
    assert s.status == "ok", s.message
    # both passes kept no box: equal shapes, and allclose over no element is True, as a
    # GPU's close outputs make it: mixed precision stays on
    assert "amp True" in printed
    counted = [n for n in s.notes if "stand-in" in n]
    assert counted and "shape x2" in counted[0] and "detect.py:8 (shape) x2" in counted[0], \
        counted
