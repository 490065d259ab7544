"""The measured loop is the PyTorch tutorial's loop: what lives when, as Python keeps it."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from dpprof.backends.emulated import EmulationConfig, run_scenario
from dpprof.scenarios.measured_loop import StepHooks, loop_description, training_loop
from dpprof.scenarios.names import PHASES
from dpprof.scenarios.step import StepConfig
from dpprof.scenarios.workloads import Workload


class Probe(nn.Module):
    """A linear layer that notes, at each forward, what of the last iteration is alive."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.outputs: list[weakref.ref[torch.Tensor]] = []
        self.inputs: list[weakref.ref[torch.Tensor]] = []
        self.seen: list[dict[str, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append({
            "previous outputs alive": bool(self.outputs) and self.outputs[-1]() is not None,
            "previous batch alive": bool(self.inputs) and self.inputs[-1]() is not None,
            "gradient alive": self.fc.weight.grad is not None,
        })
        self.inputs.append(weakref.ref(x))
        y = self.fc(x)
        self.outputs.append(weakref.ref(y))
        return y


def test_the_loop_keeps_what_the_tutorial_loop_keeps() -> None:
    model = Probe()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    alive_in_backward: list[bool] = []

    def criterion(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        ref = weakref.ref(out)
        loss = nn.functional.mse_loss(out, target)
        # during backward: are this iteration's outputs still alive (they are, in the loop)
        loss.register_hook(lambda g: alive_in_backward.append(ref() is not None))
        return loss

    batches = [(torch.randn(2, 4), torch.randn(2, 3)) for _ in range(3)]
    training_loop(model, criterion, opt, batches, lambda x, _: x.clone(), False)
    assert model.seen[0] == {"previous outputs alive": False, "previous batch alive": False,
                             "gradient alive": False}
    for seen in model.seen[1:]:
        # outputs = model(inputs) has not rebound ``outputs`` yet: the previous outputs live
        # through the next forward; the batch was rebound before; zero_grad() set the
        # gradients to None before the forward.
        assert seen == {"previous outputs alive": True, "previous batch alive": False,
                        "gradient alive": False}
    assert alive_in_backward == [True, True, True]


def test_the_report_names_the_loop() -> None:
    text = loop_description(2)
    assert "optimizer.zero_grad(); outputs = model(inputs)" in text
    assert "2 iterations in one scope, the last measured" in text


def _head_workload() -> Workload:
    """Outputs 256x larger than the activations they come from, and a loss that saves none of
    them for backward (a mean): only the loop's ``outputs`` name keeps them alive there."""
    return Workload(
        name="wide-head",
        model=lambda: nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4096)),
        batch=lambda rows, device: (torch.randn(rows, 16, device=device),
                                    torch.randn(rows, device=device)),
        loss=lambda out, target: (out.mean(dim=1) - target).abs().mean(),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
    )


def test_the_gathered_outputs_live_through_backward_under_dp_loss_primary() -> None:
    """cuda:0's peak (in backward) holds the whole batch's gathered outputs: the loop keeps
    ``outputs`` through backward (a step that deleted them before backward would not)."""
    cfg = EmulationConfig(gpus=4, gpu_memory_bytes=2**40, step=StepConfig(batch=64))
    r = run_scenario("dp-loss-primary", _head_workload(), cfg)
    assert r.status == "ok", r.message
    dev0 = r.devices[0]
    assert dev0.peak_phase == "backward"
    assert dev0.breakdown_bytes.get("outputs", 0) >= 64 * 4096 * 4


class Recorder(nn.Module):
    """A linear model with DDP's ``no_sync``: notes which forwards ran inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.syncing = True
        self.forwards_synced: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards_synced.append(self.syncing)
        return self.fc(x)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True


def _phases(micro_batches: int, rows: int = 6) -> tuple[list[str], Recorder]:
    torch.manual_seed(0)
    model = Recorder()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[str] = []

    @contextlib.contextmanager
    def phase(name: str) -> Iterator[None]:
        seen.append(name)
        yield

    batches = [(torch.randn(rows, 4), torch.randn(rows, 3)) for _ in range(2)]
    training_loop(model, nn.functional.mse_loss, opt, batches, lambda x, _: x.clone(), False,
                  StepHooks(phase=phase), micro_batches=micro_batches)
    return seen, model


def test_the_plain_step_is_one_micro_batch_of_the_one_loop() -> None:
    plain, model = _phases(1)
    assert plain == [*PHASES] * 2
    assert model.forwards_synced == [True, True]
    # three micro-batches of two rows: zeroed once per optimizer step, before the first;
    # the first two backwards inside no_sync(), the last one all-reduces
    accumulating, model = _phases(3)
    assert accumulating == (["zero_grad", *["inputs", "forward", "loss", "backward"] * 3,
                             "optimizer"] * 2)
    assert model.forwards_synced == [False, False, True] * 2


def test_accumulation_steps_as_the_whole_batch_does() -> None:
    """k micro-batches of a step, each loss divided by k, add up to the whole batch's mean
    gradient: the parameters after the loop are the plain loop's."""
    torch.manual_seed(0)
    start = nn.Linear(4, 3)
    batches = [(torch.randn(8, 4), torch.randn(8, 3)) for _ in range(3)]
    after = {}
    for k in (1, 2, 4):
        model = nn.Linear(4, 3)
        model.load_state_dict(start.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        training_loop(model, nn.functional.mse_loss, opt, batches, lambda x, _: x, False,
                      micro_batches=k)
        after[k] = model.weight.detach().clone()
    assert not torch.equal(after[1], start.weight)
    torch.testing.assert_close(after[2], after[1])
    torch.testing.assert_close(after[4], after[1])
