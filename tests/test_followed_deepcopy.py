"""``copy.deepcopy`` of a model on a virtual GPU keeps the small values the emulation
follows, in the original and in the copy, as a model EMA, a teacher or a checkpoint's copy
makes one. torch deep-copies a CUDA tensor through its storage (a new storage, every byte
copied, the view's geometry set on it); the emulation lost the original's values at that
``set_`` and the copy had none.

Found on ultralytics' YOLOv5 ``train.py`` under DataParallel: its AMP check deep-copies the
model, after which the anchors (a buffer of 18 floats) read back as stand-in zeros, and the
loss, which keeps the targets that fit the anchors by a boolean mask, stopped with "indexing
with a boolean mask makes a tensor whose shape depends on the values"."""

from __future__ import annotations

import textwrap
from pathlib import Path

from script_runs import printed_on_the_host, run_printing

SCRIPT = """
    import copy

    import torch
    from torch import nn

    dev = "cuda"


    class Detect(nn.Module):
        def __init__(self):
            super().__init__()
            anchors = torch.tensor([[10, 13, 16, 30, 33, 23], [30, 61, 62, 45, 59, 119]])
            self.register_buffer("anchors", anchors.float().view(2, -1, 2) / 8)
            self.conv = nn.Conv2d(4, 6, 1)

        def forward(self, x):
            return self.conv(x)


    torch.manual_seed(0)
    model = Detect().to(dev)
    ema = copy.deepcopy(model).eval()  # the EMA's copy, before the training
    pair = [model.anchors, model.anchors[1]]  # a view deep-copied with its base
    copied = copy.deepcopy(pair)
    print("views share a storage", copied[1].untyped_storage().data_ptr()
          == copied[0].untyped_storage().data_ptr())
    print("view", copied[1].tolist())
    print("original", model.anchors.view(-1).tolist())
    print("copy", ema.anchors.view(-1).tolist())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    targets = torch.tensor([[0.2, 0.3, 1.5, 2.0], [0.5, 0.5, 9.0, 4.0], [0.7, 0.1, 0.3, 0.2]])
    for _ in range(2):
        out = model(torch.randn(2, 4, 8, 8, device=dev))
        t = targets.to(dev)
        r = t[None, :, 2:4] / ema.anchors.view(-1, 2)[:, None]  # YOLOv5's ratio of sizes
        fits = torch.max(r, 1 / r).max(2)[0] < 4.0
        kept = t.repeat(6, 1, 1)[fits]  # the targets each anchor trains on
        print("kept", kept.shape[0])
        (out.mean() + kept.sum() * 0).backward()
        optimizer.step()
        optimizer.zero_grad()
"""


def test_deep_copies_keep_the_values_followed_in_the_original_and_the_copy(
        tmp_path: Path) -> None:
    source = textwrap.dedent(SCRIPT)
    script = tmp_path / "ema.py"
    script.write_text(source)
    expected = printed_on_the_host(tmp_path, source)
    result, printed = run_printing(script, steps=2)
    s = result.scenarios[0]
    assert s.status == "ok", s.message
    assert printed == expected
    assert "views share a storage True" in printed
    assert "kept 8" in printed
    assert not any("stand-in" in n for n in s.notes), s.notes
