"""Dict batches as keyword arguments, and model outputs of any shape gathered as
``nn.DataParallel`` gathers them (``torch/nn/parallel/scatter_gather.py: gather_map``)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpprof.backends.emulated import EmulationConfig, run_scenario
from dpprof.scenarios.registry import SCENARIOS
from dpprof.scenarios.step import StepConfig
from dpprof.scenarios.workloads import Workload

ROWS, CLASSES = 8, 4000  # logits 8 x 4000 floats: 128000 B gathered on cuda:0


class Pair(NamedTuple):
    logits: torch.Tensor
    hidden: torch.Tensor


@dataclasses.dataclass
class Plain:
    logits: torch.Tensor


class Net(nn.Module):
    """Called the Hugging Face way, ``model(**batch)``; returns ``kind`` of output."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(16, CLASSES)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        logits = self.fc(input_ids * attention_mask)
        if self.kind == "ordered":  # ModelOutput is an OrderedDict subclass
            return OrderedDict(logits=logits, hidden=input_ids)
        if self.kind == "namedtuple":
            return Pair(logits, input_ids)
        if self.kind == "nested":
            return {"out": (logits, [input_ids])}
        return Plain(logits)


def logits_of(out: Any) -> torch.Tensor:
    if isinstance(out, dict) and "out" in out:
        return out["out"][0]
    if isinstance(out, (dict, OrderedDict)):
        return out["logits"]
    return out.logits


def _wl(kind: str) -> Workload:
    return Workload(
        name=kind,
        model=lambda: Net(kind),
        batch=lambda rows, device: (
            {"input_ids": torch.randn(rows, 16, device=device),
             "attention_mask": torch.ones(rows, 16, device=device)},
            torch.randint(0, CLASSES, (rows,), device=device)),
        loss=lambda out, t: F.cross_entropy(logits_of(out), t),
    )


@pytest.mark.parametrize("kind", ["ordered", "namedtuple", "nested"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_dict_batches_and_structured_outputs_run_everywhere(kind: str, scenario: str) -> None:
    r = run_scenario(scenario, _wl(kind), EmulationConfig(
        gpus=4, gpu_memory_bytes=2**40, compute=True,
        step=StepConfig(batch=ROWS),
    ))
    assert r.status == "ok", r.message
    assert r.loss is not None


@pytest.mark.parametrize("kind", ["ordered", "namedtuple", "nested"])
def test_gathered_outputs_are_filed_as_outputs_on_cuda0(kind: str) -> None:
    """Every tensor of the gathered structure is cuda:0's 'outputs'; the loss computed from
    them is 'loss'."""
    r = run_scenario("dp-loss-primary", _wl(kind),
                     EmulationConfig(gpus=4, gpu_memory_bytes=2**40, step=StepConfig(batch=ROWS)))
    assert r.status == "ok", r.message
    dev0 = r.devices[0].breakdown_bytes
    assert dev0["outputs"] >= ROWS * CLASSES * 4 + ROWS * 16 * 4  # logits and the 2nd leaf
    assert dev0.get("loss", 0) > 0


def test_a_dataclass_output_fails_as_dataparallel_fails() -> None:
    """torch's gather_map rebuilds dicts, namedtuples and sequences; a plain dataclass is
    none of them, so nn.DataParallel raises "'Plain' object is not iterable": so does the
    emulation, and the other scenarios run."""
    cfg = EmulationConfig(gpus=4, gpu_memory_bytes=2**40, step=StepConfig(batch=ROWS))
    r = run_scenario("dp-loss-primary", _wl("plain"), cfg)
    assert r.status == "error" and "'Plain' object is not iterable" in r.message
    assert run_scenario("single", _wl("plain"), cfg).status == "ok"
    assert run_scenario("dp-loss-forward", _wl("plain"), cfg).status == "ok"
