"""The batch's rows, read at the model's call: the first tensor's, and of a batch given as
one mapping its largest tensor's. Ultralytics' collate sorts a batch's keys, so its labels
(``batch_idx``, ``bboxes``, ``cls``: one row a box) come before its images (``img``); the
run said "batch 24" for 8 images, and its samples a second three times too many."""

from __future__ import annotations

import textwrap
from pathlib import Path

from script_runs import run_printing

SCRIPT = """
    import torch
    from torch import nn


    class Detector(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)

        def forward(self, batch):
            return self.conv(batch["img"]).mean() + batch["bboxes"].sum() * 0


    model = Detector().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        boxes = 3 * 8  # three boxes in each of eight images
        batch = {"batch_idx": torch.arange(8).repeat_interleave(3).cuda(),
                 "bboxes": torch.rand(boxes, 4).cuda(), "cls": torch.zeros(boxes, 1).cuda(),
                 "img": torch.rand(8, 3, 32, 32).cuda()}
        model(batch).backward()
        optimizer.step()
        optimizer.zero_grad()
"""


def test_a_batch_given_as_one_mapping_has_its_largest_tensors_rows(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    result, _ = run_printing(script)
    (single,) = result.scenarios
    assert single.status == "ok", single.message
    assert result.batch == single.batch == 8
