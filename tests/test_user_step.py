"""A workload's own loop body: every scenario runs it around its own wrapper."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpprof.backends.emulated import EmulationConfig, run_scenario
from dpprof.errors import WorkloadError
from dpprof.scenarios.registry import SCENARIOS
from dpprof.scenarios.step import StepConfig
from dpprof.scenarios.workloads import Workload

ROWS, WIDE = 64, 4096
OUT_BYTES = ROWS * WIDE * 4  # the whole batch's outputs


def _wide(step: Any = None) -> Workload:
    """Outputs 256x wider than the activations, a loss that saves none of them."""
    return Workload(
        name="wide",
        model=lambda: nn.Sequential(nn.Linear(16, 16), nn.Linear(16, WIDE)),
        batch=lambda rows, device: (torch.randn(rows, 16, device=device),
                                    torch.randn(rows, device=device)),
        loss=lambda out, target: (out.mean(dim=1) - target).abs().mean(),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        step=step,
    )


def tutorial(model: Any, batch: Any, criterion: Any, optimizer: Any) -> torch.Tensor:
    inputs, targets = batch
    optimizer.zero_grad()
    outputs = model(inputs)
    loss = criterion(outputs, targets)
    loss.backward()
    optimizer.step()
    return loss


def del_outputs(model: Any, batch: Any, criterion: Any, optimizer: Any) -> torch.Tensor:
    inputs, targets = batch
    optimizer.zero_grad()
    outputs = model(inputs)
    loss = criterion(outputs, targets)
    del outputs  # the habit: the outputs die before backward
    loss.backward()
    optimizer.step()
    return loss


def accumulate(model: Any, batch: Any, criterion: Any, optimizer: Any) -> torch.Tensor:
    """Two micro-batches per optimizer step, gradients clipped."""
    inputs, targets = batch
    optimizer.zero_grad()
    total = torch.zeros(())
    for x, y in zip(inputs.chunk(2), targets.chunk(2), strict=True):
        loss = criterion(model(x), y) / 2
        loss.backward()
        total = total + loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return total


def _run(name: str, wl: Workload, compute: bool = False, amp: str | None = None) -> Any:
    r = run_scenario(name, wl, EmulationConfig(step=StepConfig(batch=ROWS, amp=amp), gpus=4,
                                               gpu_memory_bytes=2**40, compute=compute))
    assert r.status == "ok", r.message
    return r


def test_the_step_decides_what_lives() -> None:
    """``del outputs`` before backward frees cuda:0's gathered outputs for its peak; a step
    that keeps them has them there, as the default loop does."""
    kept = _run("dp-loss-primary", _wide(tutorial)).devices[0]
    deleted = _run("dp-loss-primary", _wide(del_outputs)).devices[0]
    default = _run("dp-loss-primary", _wide()).devices[0]
    assert kept.breakdown_bytes.get("outputs", 0) >= OUT_BYTES
    assert deleted.breakdown_bytes.get("outputs", 0) < OUT_BYTES // 4
    assert kept.peak_allocated_bytes - deleted.peak_allocated_bytes >= OUT_BYTES
    assert default.breakdown_bytes.get("outputs", 0) >= OUT_BYTES


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_scenario_runs_the_step(name: str) -> None:
    r = _run(name, _wide(accumulate), compute=True)
    assert r.loss is not None and r.loss > 0


def test_the_step_runs_inside_the_phases() -> None:
    """The model call is forward, the criterion loss, then backward until optimizer.step()."""
    trace: dict[str, Any] = {}
    run_scenario("dp-loss-primary", _wide(accumulate),
                 EmulationConfig(gpus=4, gpu_memory_bytes=2**40, step=StepConfig(batch=ROWS)), trace)
    marks = [m.name for m in trace["rt"].storages.phases]
    # the measured iteration: two micro-batches, then the optimizer step
    one = ["inputs", "zero_grad", "forward", "loss", "backward", "forward", "loss", "backward",
           "optimizer", "zero_grad"]
    assert marks[-len(one):] == one


def test_dp_loss_forward_defers_the_model_call_to_the_criterion() -> None:
    """Under dp-loss-forward cuda:0 receives one number per GPU, not the outputs."""
    fwd = _run("dp-loss-forward", _wide(tutorial)).devices[0]
    prim = _run("dp-loss-primary", _wide(tutorial)).devices[0]
    assert fwd.breakdown_bytes.get("outputs", 0) < 1024
    assert prim.peak_allocated_bytes - fwd.peak_allocated_bytes > OUT_BYTES


def test_same_numbers_as_the_default_loop_with_compute() -> None:
    """The tutorial step and the built-in loop compute the same loss (same data, seed)."""
    a = _run("single", _wide(tutorial), compute=True)
    b = _run("single", _wide(), compute=True)
    assert a.loss == pytest.approx(b.loss, rel=1e-6)


def test_using_the_outputs_under_dp_loss_forward_says_what_to_do() -> None:
    def peek(model: Any, batch: Any, criterion: Any, optimizer: Any) -> torch.Tensor:
        inputs, targets = batch
        outputs = model(inputs)
        print(outputs.shape)
        return criterion(outputs, targets)

    r = run_scenario("dp-loss-forward", _wide(peek),
                     EmulationConfig(gpus=4, gpu_memory_bytes=2**40, step=StepConfig(batch=ROWS)))
    assert r.status == "error"
    assert "(.shape) other than through criterion(outputs, targets)" in r.message


def test_a_step_that_is_not_callable_is_named() -> None:
    wl = dataclasses.replace(_wide(), step=3)
    with pytest.raises(WorkloadError, match="'step' must be a function"):
        wl.validate()


class DictModel(nn.Module):
    """A model whose forward takes the batch dict itself (``forward(self, batch)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.fc(batch["features"] * batch["mask"])


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_model_taking_the_batch_dict_is_called_with_it(scenario: str) -> None:
    """``forward(self, batch)`` gets ``model(batch)``; ``forward(self, input_ids, ...)``
    ``model(**batch)`` (the test above): the signature says which."""
    wl = Workload(
        name="dict-arg",
        model=DictModel,
        batch=lambda rows, device: ({"features": torch.randn(rows, 8, device=device),
                                     "mask": torch.ones(rows, 8, device=device)},
                                    torch.randint(0, 4, (rows,), device=device)),
        loss=F.cross_entropy,
    )
    r = run_scenario(scenario, wl, EmulationConfig(gpus=2, gpu_memory_bytes=2**31,
                                                   step=StepConfig(batch=8)))
    assert r.status == "ok", r.message
    assert r.devices[0].breakdown_bytes["parameters"] == 2 * 512  # weight 128 B, bias 16 B


def test_huggingface_style_dict_batch_and_output() -> None:
    """A dict batch is passed as keyword arguments; a dict output is gathered key by key."""

    class KwModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
            logits = self.fc(input_ids)
            return {"loss": F.cross_entropy(logits, labels), "logits": logits}

    wl = Workload(
        name="kw",
        model=KwModel,
        batch=lambda rows, device: ({"input_ids": torch.randn(rows, 8, device=device),
                                     "labels": torch.randint(0, 4, (rows,), device=device)},
                                    None),
        loss=lambda out, _: out["loss"].mean(),  # DataParallel gathers the replicas' losses
    )
    for name in SCENARIOS:
        r = _run(name, wl, compute=True)
        assert r.loss is not None


def amp_step(model: Any, batch: Any, criterion: Any, optimizer: Any) -> torch.Tensor:
    inputs, targets = batch
    optimizer.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        outputs = model(inputs)
        loss = criterion(outputs, targets)
    loss.backward()
    optimizer.step()
    return loss


def test_the_steps_own_cuda_autocast_runs_as_on_a_gpu() -> None:
    """A CPU build disables torch.autocast("cuda"); the emulator re-enacts it: the same
    bytes as the same step under --amp bfloat16, fewer than in float32."""
    own = _run("dp-loss-primary", _wide(amp_step))
    flag = _run("dp-loss-primary", _wide(tutorial), amp="bfloat16")
    plain = _run("dp-loss-primary", _wide(tutorial))
    assert [d.peak_allocated_bytes for d in own.devices] == [
        d.peak_allocated_bytes for d in flag.devices]
    assert own.devices[0].peak_allocated_bytes < plain.devices[0].peak_allocated_bytes
    assert any("torch.autocast('cuda')" in n for n in own.notes)
    assert torch.autocast.__name__ == "autocast" and isinstance(torch.autocast, type)
