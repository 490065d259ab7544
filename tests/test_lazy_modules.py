"""LazyModules on virtual GPUs: their uninitialized parameters and buffers move with the
module (``.cuda()``, ``.to(dtype)``) as torch moves them, the same objects, and take their
shapes at the first forward on the GPU they were moved to; a model written with them needs
what the same model written with its shapes needs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from script_runs import run_script
from torch import nn
from torch.nn.parameter import is_lazy

from dpprof.emulator.virtual_cuda import VirtualCuda

# the same model twice: its shapes given, or left to the first forward
TRAIN = """
import torch, torch.nn as nn
model = nn.Sequential({layers}, nn.ReLU(), nn.Flatten(), {head}).cuda()
opt = torch.optim.Adam(model.parameters())
for _ in range(3):
    model(torch.randn(8, 3, 32, 32, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
"""
SHAPED = {"layers": "nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16)", "head": "nn.Linear(14400, 10)"}
LAZY = {"layers": "nn.LazyConv2d(16, 3), nn.LazyBatchNorm2d()", "head": "nn.LazyLinear(10)"}


def test_a_lazy_model_needs_what_the_same_model_with_its_shapes_needs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shaped").mkdir()
    (tmp_path / "lazy").mkdir()
    shaped = run_script(tmp_path / "shaped", TRAIN.format(**SHAPED))
    lazy = run_script(tmp_path / "lazy", TRAIN.format(**LAZY))
    assert shaped.status == lazy.status == "ok", lazy.message
    a, b = shaped.devices[0], lazy.devices[0]
    assert a.peak_allocated_bytes > 14400 * 10 * 4 * 3  # weights, gradients, Adam's states
    assert (b.peak_allocated_bytes, b.peak_reserved_bytes) == (
        a.peak_allocated_bytes, a.peak_reserved_bytes)


def test_uninitialized_parameters_move_with_their_module_and_stay_the_same_objects() -> None:
    with VirtualCuda(2):
        m = nn.LazyLinear(10)
        weight = m.weight
        m.cuda(1)
        assert m.weight is weight and is_lazy(weight) and weight.device == torch.device("cuda", 1)
        m.to(torch.bfloat16)
        assert m.weight is weight and is_lazy(weight) and weight.dtype == torch.bfloat16
        m(torch.randn(4, 32, device="cuda:1", dtype=torch.bfloat16))
        assert m.weight is weight and not is_lazy(weight)
        assert weight.shape == (10, 32) and weight.device == torch.device("cuda", 1)
        bn = nn.LazyBatchNorm1d().cuda()
        assert is_lazy(bn.running_mean) and bn.running_mean.device == torch.device("cuda", 0)
        bn(torch.randn(4, 6, device="cuda"))
        assert bn.running_mean.shape == (6,) and bn.running_mean.device == torch.device("cuda", 0)
