"""A custom op whose output's shape depends on values, as torchvision's ``nms`` is: its fake
(Meta) kernel asks for a data-dependent size, which meta tensors refuse ("this operator may
return an output Tensor with data-dependent shape"). On a virtual GPU it takes the shape its
host kernel gives over the values followed, else over the stand-ins, counted; a detector's
AMP check or post-processing goes on as on a GPU."""

from __future__ import annotations

import torch

from dpprof.emulator.virtual_cuda import VirtualCuda

_LIB = torch.library.Library("dpprof_test_boxes", "DEF")
_LIB.define("keep(Tensor scores, float threshold) -> Tensor")


@torch.library.impl(_LIB, "keep", "CPU")
def _keep_cpu(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    return torch.nonzero(scores > threshold).flatten()


@torch.library.register_fake("dpprof_test_boxes::keep")
def _keep_fake(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    count = torch.library.get_ctx().new_dynamic_size()
    return scores.new_empty(count, dtype=torch.long)


def test_a_custom_op_of_a_data_dependent_shape_takes_the_values_or_the_stand_ins() -> None:
    keep = torch.ops.dpprof_test_boxes.keep
    with VirtualCuda(1) as vc:
        known = torch.tensor([0.1, 0.9, 0.7, 0.2]).cuda()  # host data: followed
        kept = keep(known, 0.5)
        assert kept.tolist() == [1, 2] and kept.device == torch.device("cuda", 0)
        assert vc.rt.stand_ins.total == 0
        scores = torch.rand(100, device="cuda")  # drawn on the GPU: not followed
        assert keep(scores, 0.5).shape == (0,)  # zeros keep nothing
        assert vc.rt.stand_ins.counts == {"shape": 1}
