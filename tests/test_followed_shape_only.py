"""A tensor made like another (``new_full``, ``new_zeros``, ``zeros_like``, ``full_like``)
holds values known on a virtual GPU even where the other's are not (an activation, a
parameter): the op reads its shape, dtype and layout, never its values.

Found on Ultralytics' YOLOv8 loss: its stride tensor is ``feats[0].new_full((h * w, 1),
stride)`` of the head's output, so the anchors scaled by it, and the assigner's candidate
mask built from them and the labels, read as stand-ins; the mask selected nothing."""

from __future__ import annotations

import torch
from torch import nn

from dpprof.emulator.virtual_cuda import VirtualCuda


def test_tensors_made_like_an_activation_or_a_parameter_have_known_values() -> None:
    with VirtualCuda(1) as vc:
        feats = nn.Conv2d(3, 4, 1).cuda()(torch.randn(2, 3, 5, 5, device="cuda"))
        weight = nn.Linear(3, 2).cuda().weight
        made = [feats.new_full((3, 1), 8.0, dtype=torch.float16), feats.new_zeros(2),
                weight.new_ones(3), torch.zeros_like(weight), torch.full_like(feats[0, 0], 2.5),
                torch.ones_like(feats.permute(0, 2, 3, 1))]
        got = [(m.device, m.shape, m.tolist()) for m in made]
        assert vc.rt.stand_ins.total == 0
    assert [g[2] for g in got] == [[[8.0]] * 3, [0.0, 0.0], [1.0] * 3, [[0.0] * 3] * 2,
                                   [[2.5] * 5] * 5, torch.ones(2, 5, 5, 4).tolist()]
    assert all(device == torch.device("cuda", 0) for device, _, _ in got)
