"""DDP's broadcast of the module's parameters and buffers (at its construction, and of the
buffers before each forward) keeps the values the emulation follows in the buffers: torch
flattens them into buckets (``cat``), broadcasts each and copies it back into the module's
tensors. A bucket of a real model is far too large to follow; the small buffers' values
inside it are kept as pieces, for the copy back.

Found on ultralytics' YOLOv5 ``train.py`` (7M parameters): its DDP alternative stopped
where the loss keeps the targets that fit the anchors (a buffer) by a boolean mask, "no DDP
alternative"."""

from __future__ import annotations

import textwrap
from pathlib import Path

from script_runs import run_printing

SCRIPT = """
    import torch
    from torch import nn


    class Detect(nn.Module):
        def __init__(self):
            super().__init__()
            anchors = torch.tensor([[10, 13, 16, 30, 33, 23], [30, 61, 62, 45, 59, 119]])
            self.register_buffer("anchors", anchors.float().view(2, -1, 2) / 8)
            self.conv = nn.Conv2d(4, 6, 1)
            self.big = nn.Linear(1024, 1024)  # 4 MiB: the bucket is not followed whole
            # 70 KiB of buffers, all known: the buffers' own bucket (DDP broadcasts it
            # before each forward) is not followed whole either
            self.stats = nn.BatchNorm1d(9000, affine=False)

        def forward(self, x):
            return self.conv(x)


    model = Detect().cuda()
    parallel = nn.DataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    targets = torch.tensor([[0.2, 0.3, 1.5, 2.0], [0.5, 0.5, 9.0, 4.0], [0.7, 0.1, 0.3, 0.2]])
    for _ in range(3):
        x = torch.randn(8, 4, 8, 8)
        out = parallel(x.cuda())
        t = targets.cuda()
        r = t[None, :, 2:4] / model.anchors.view(-1, 2)[:, None]  # YOLOv5's ratio of sizes
        fits = torch.max(r, 1 / r).max(2)[0] < 4.0
        kept = t.repeat(6, 1, 1)[fits]  # the targets each anchor trains on
        print("kept", kept.shape[0])
        (out.mean() + kept.sum() * 0).backward()
        optimizer.step()
        optimizer.zero_grad()
"""


def test_ddps_broadcast_of_a_large_module_keeps_its_buffers_values(tmp_path: Path) -> None:
    script = tmp_path / "detect.py"
    script.write_text(textwrap.dedent(SCRIPT))
    result, printed = run_printing(script, gpus=2)
    by_name = {s.name: s for s in result.scenarios}
    assert "ddp" in by_name, result.notes
    for s in result.scenarios:
        assert s.status == "ok", (s.name, s.message)
        assert not any("stand-in" in n for n in s.notes), s.notes
    assert printed.count("kept 8\n") == 3
