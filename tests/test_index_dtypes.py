"""Integer class targets and indices: the emulated GPU takes the dtypes CUDA takes.

Over meta tensors torch runs its Python meta kernels and decompositions, whose dtype rules
are not CUDA's (``nll_loss``'s decomposition refuses uint8 targets, which CUDA accepts, and
takes int32, which CUDA refuses). For these ops the CPU kernels take the same dtypes as the
CUDA ones (dpprof.emulator.index_dtypes cites both), so each op is run on real CPU tensors
and on a virtual GPU: both accept, with the same output shapes, or both refuse, with the
same check's message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dpprof.emulator.virtual_cuda import VirtualCuda

Op = Callable[[str, torch.Tensor], Any]

OPS: dict[str, Op] = {
    "cross_entropy": lambda d, t: F.cross_entropy(torch.randn(4, 10, device=d), t),
    "cross_entropy sum": lambda d, t: F.cross_entropy(torch.randn(4, 10, device=d), t,
                                                      reduction="sum"),
    "nll_loss none": lambda d, t: F.nll_loss(torch.randn(4, 10, device=d), t,
                                             reduction="none"),
    "cross_entropy weight smoothing": lambda d, t: F.cross_entropy(
        torch.randn(4, 10, device=d), t, weight=torch.ones(10, device=d),
        label_smoothing=0.1),
    "cross_entropy [N, C, d]": lambda d, t: F.cross_entropy(
        torch.randn(4, 10, 3, device=d), t.view(4, 1).expand(4, 3).contiguous()),
    "cross_entropy [N, C, h, w]": lambda d, t: F.cross_entropy(
        torch.randn(4, 10, 2, 2, device=d), t.view(4, 1, 1).expand(4, 2, 2).contiguous()),
    "multi_margin_loss": lambda d, t: F.multi_margin_loss(torch.randn(4, 10, device=d), t),
    "embedding": lambda d, t: F.embedding(t, torch.randn(10, 3, device=d)),
    "gather": lambda d, t: torch.randn(4, 10, device=d).gather(1, t.view(4, 1)),
    "scatter_add": lambda d, t: torch.zeros(4, 10, device=d).scatter_add(
        1, t.view(4, 1), torch.ones(4, 1, device=d)),
    "index_select": lambda d, t: torch.randn(10, 3, device=d).index_select(0, t),
    "index_add": lambda d, t: torch.zeros(10, 3, device=d).index_add(
        0, t, torch.ones(4, 3, device=d)),
    "take_along_dim": lambda d, t: torch.randn(4, 10, device=d).take_along_dim(
        t.view(4, 1), 1),
}
DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool)


def outcome(op: Op, device: str, dtype: torch.dtype, backward: bool) -> Any:
    torch.manual_seed(0)
    t = torch.tensor([1, 0, 3, 1], dtype=dtype, device=device)
    try:
        out = op(device, t)
        if backward and out.is_floating_point():
            x = torch.randn(4, 10, device=device, requires_grad=True)
            F.cross_entropy(x, t).backward()  # nll_loss_backward with this target
            assert x.grad is not None
        return ("ok", tuple(out.shape), out.dtype)
    except (RuntimeError, IndexError) as e:
        return ("refused", str(e).splitlines()[0].split(" (while running")[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(OPS))
def test_a_virtual_gpu_takes_the_integer_dtypes_the_kernels_take(
        name: str, dtype: torch.dtype) -> None:
    backward = name == "cross_entropy"
    on_cpu = outcome(OPS[name], "cpu", dtype, backward)
    with VirtualCuda(2, honour_visible_devices=False):
        emulated = outcome(OPS[name], "cuda:1", dtype, backward)
    assert emulated[0] == on_cpu[0]
    if on_cpu[0] == "ok":
        assert emulated == on_cpu
    else:  # the same check; how it names the dtype differs (torch.bool, CPUBoolType)
        assert emulated[1].split("but got")[0].rstrip(", ") == on_cpu[1].split("but got")[0].rstrip(", ")


def test_uint8_class_targets_cost_no_copy() -> None:
    """CUDA's nll_loss reads uint8 targets as they are: no int64 copy is counted."""
    with VirtualCuda(1, honour_visible_devices=False) as vc:
        logits = torch.randn(64, 10, device="cuda", requires_grad=True)
        labels = torch.randint(0, 10, (64,), dtype=torch.uint8, device="cuda")
        before = vc.rt.storages.counters[0].peak_allocated
        F.cross_entropy(logits, labels).backward()
        # log_softmax [64, 10], its gradient and logits.grad, the loss and total_weight,
        # the loss's gradient: float32, each in its own 512 B block
        assert vc.rt.storages.counters[0].peak_allocated - before <= 6 * 3 * 512
