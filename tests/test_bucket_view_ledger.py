"""DDP with gradient_as_bucket_view=True, followed in a ledger while plain DDP runs
(:class:`dpprof.emulator.ddp.BucketViewFollower`): byte for byte what emulating it
on its own gives, or nothing (and the fix is emulated on its own)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from fix_helpers import count_emulations, keep_grads, micro_batches, zero_grad_late
from torch import nn

from dpprof.backends.emulated import Alongside, EmulationConfig, run_scenario
from dpprof.pipeline import CompareConfig, run_compare
from dpprof.scenarios.step import DdpOptions, StepConfig
from dpprof.scenarios.workloads import LMConfig, Workload, classifier, convnet, lm, mlp

SMALL_LM = LMConfig(vocab=8000, seq=64, d_model=128, layers=2)


def _peaks(s: Any) -> list[tuple[int, int, int]]:
    return [(d.index, d.peak_allocated_bytes, d.peak_requested_bytes) for d in s.devices]


CASES = {
    "lm": (lambda: lm(SMALL_LM), {}),
    "lm, 1 MiB buckets": (lambda: lm(SMALL_LM), {"ddp": DdpOptions(bucket_cap_mb=1)}),
    "lm, unused parameters searched": (
        lambda: lm(SMALL_LM), {"ddp": DdpOptions(find_unused_parameters=True)}),
    "lm, autocast": (lambda: lm(SMALL_LM), {"amp": "bfloat16"}),
    "lm, bfloat16": (lambda: lm(SMALL_LM), {"dtype": "bfloat16"}),
    "mlp": (mlp, {}),
    "convnet": (convnet, {}),
    "classifier (a loss with parameters)": (classifier, {}),
    "gradients kept": (lambda: dataclasses.replace(lm(SMALL_LM), step=keep_grads), {}),
    "zero_grad after forward": (
        lambda: dataclasses.replace(lm(SMALL_LM), step=zero_grad_late), {}),
    "two backward passes": (lambda: dataclasses.replace(lm(SMALL_LM), step=micro_batches), {}),
    "three steps": (lambda: lm(SMALL_LM), {"warmup": 2}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_ledger_is_the_bucket_view_run(case: str) -> None:
    make, options = CASES[case]
    wl = make()
    base = EmulationConfig(gpus=4, gpu_memory_bytes=80 << 30,
                           step=StepConfig(batch=16, **options))
    seen = Alongside(bucket_view=True)
    plain = run_scenario("ddp", wl, base, alongside=seen)
    assert plain == run_scenario("ddp", wl, base)  # following it changes nothing
    ddp = base.step.ddp
    alone = run_scenario("ddp", wl, base.with_step(
        ddp=dataclasses.replace(ddp, gradient_as_bucket_view=True)))
    assert seen.bucket_view_result is not None
    assert _peaks(seen.bucket_view_result) == _peaks(alone)
    assert seen.bucket_view_result.status == alone.status


class _Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 256)
        self.b = nn.Linear(256, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _flat_grads(model: Any, batch: Any, criterion: Any, optimizer: Any) -> torch.Tensor:
    """Every gradient a view of one flat buffer the step made (as apex's flat grads)."""
    inputs, targets = batch
    params = [p for g in optimizer.param_groups for p in g["params"]]
    flat = torch.zeros(sum(p.numel() for p in params), device=params[0].device)
    offset = 0
    for p in params:
        p.grad = flat[offset: offset + p.numel()].view_as(p)
        offset += p.numel()
    del flat
    loss = criterion(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss


def _shared_workload() -> Workload:
    return Workload(name="shared", description="", model=_Shared,
                    batch=lambda rows, device: (torch.randn(rows, 256, device=device),
                                                torch.randn(rows, 8, device=device)),
                    loss=nn.functional.mse_loss, step=_flat_grads)


def test_a_shared_gradient_storage_is_not_followed_and_the_fix_is_emulated() -> None:
    wl = _shared_workload()
    base = EmulationConfig(gpus=2, gpu_memory_bytes=80 << 30, step=StepConfig(batch=8))
    seen = Alongside(bucket_view=True)
    run_scenario("ddp", wl, base, alongside=seen)
    assert seen.bucket_view_result is None
    run = run_compare(CompareConfig(gpus=2, step=StepConfig(batch=8)), workload=wl)
    fix = next(f for f in run.fixes if f.name == "gradient-as-bucket-view")
    alone = run_scenario("ddp", wl, base.with_step(
        ddp=DdpOptions(gradient_as_bucket_view=True)))
    assert fix.primary_peak_bytes == alone.devices[0].peak_allocated_bytes


def test_compare_takes_the_bucket_view_fix_from_the_ddp_scenario(monkeypatch) -> None:
    """No DDP is emulated again for the fix when the ddp scenario followed it."""
    emulated = count_emulations(monkeypatch)
    run = run_compare(CompareConfig(step=StepConfig(batch=16)), workload=lm(SMALL_LM))
    fix = next(f for f in run.fixes if f.name == "gradient-as-bucket-view")
    assert "ddp" not in [name for name, _ in emulated]
    alone = run_scenario("ddp", lm(SMALL_LM), EmulationConfig(
        gpus=4, gpu_memory_bytes=80 << 30,
        step=StepConfig(batch=16, ddp=DdpOptions(gradient_as_bucket_view=True))))
    assert fix.primary_peak_bytes == alone.devices[0].peak_allocated_bytes
