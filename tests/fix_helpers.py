"""What the fixes' tests share: users' steps, and a count of what the fixes emulate alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dpprof.backends.emulated import EmulationConfig
from dpprof.measure import fix_savings as fixes_module


def micro_batches(model: Any, batch: Any, criterion: Any, optimizer: Any) -> torch.Tensor:
    """Two micro-batches per optimizer step, two backward passes into the same gradients."""
    inputs, targets = batch
    optimizer.zero_grad()
    half = inputs.shape[0] // 2
    for part in (slice(0, half), slice(half, None)):
        loss = criterion(model(inputs[part]), targets[part]) / 2
        loss.backward()
    optimizer.step()
    return loss


def keep_grads(model: Any, batch: Any, criterion: Any, optimizer: Any) -> torch.Tensor:
    """Gradients zeroed in place (set_to_none=False): they outlive every step."""
    inputs, targets = batch
    optimizer.zero_grad(set_to_none=False)
    loss = criterion(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss


def zero_grad_late(model: Any, batch: Any, criterion: Any, optimizer: Any) -> torch.Tensor:
    """zero_grad after the forward: last step's gradients are alive through it."""
    inputs, targets = batch
    loss = criterion(model(inputs), targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


def count_emulations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, EmulationConfig]]:
    """Every (scenario, config) the fixes analysis emulates on its own from now on."""
    emulated: list[tuple[str, EmulationConfig]] = []
    real = fixes_module.run_scenario

    def counting(name: str, wl: Any, cfg: EmulationConfig, *args: Any, **kwargs: Any) -> Any:
        emulated.append((name, cfg))
        return real(name, wl, cfg, *args, **kwargs)

    monkeypatch.setattr(fixes_module, "run_scenario", counting)
    return emulated
