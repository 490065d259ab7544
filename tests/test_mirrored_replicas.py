"""DataParallel replicas on equal shards: one runs, the devices of the others mirror its
device (ReplicaMirrors.set_mirrors). Every device's own events, and so its figures, must be
those of emulating every replica, byte for byte; cuda:0's timeline to the event."""

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dpprof.backends.emulated import EmulationConfig, run_scenario
from dpprof.result import ScenarioResult
from dpprof.scenarios.names import DP_LOSS_FORWARD, DP_LOSS_PRIMARY
from dpprof.scenarios.step import StepConfig
from dpprof.scenarios.workloads import Workload, load_workload


def _run(wl: Workload, batch: int, gpus: int, name: str, dedupe: bool,
         **extra: object) -> tuple[ScenarioResult, dict]:
    cfg = EmulationConfig(step=StepConfig(batch=batch), gpus=gpus, gpu_memory_bytes=2**50,
                          dedupe_replicas=dedupe, debug=True, **extra)  # type: ignore[arg-type]
    trace: dict = {}
    return run_scenario(name, wl, cfg, trace), trace


Run = tuple[ScenarioResult, dict]


def run_both(wl: Workload, batch: int, gpus: int, name: str = DP_LOSS_PRIMARY,
             **extra: object) -> tuple[Run, Run]:
    """The scenario with every replica run, and with equal replicas mirrored."""
    return (_run(wl, batch, gpus, name, False, **extra),
            _run(wl, batch, gpus, name, True, **extra))


def _per_device(r: ScenarioResult) -> str:
    """The result with each device's timeline as its sequence of (bytes, phase): where a
    mirror's events sit among the other devices' is a serialization of replicas that run
    concurrently on GPUs, not a figure."""
    d = dataclasses.asdict(r)
    for dev in d["devices"]:
        dev["timeline"] = [(p["allocated_bytes"], p["phase"]) for p in dev["timeline"]]
        # the predicted step plays mirrored replicas' ops side by side, the full emulation
        # one replica after another: the same work, another interleaving of the host's
        # turns (test_the_predicted_step_agrees_with_every_replica_run holds it)
        dev.pop("predicted_busy_s")
    for key in ("predicted_step_time_s", "predicted_samples_per_s", "predicted_host_s"):
        d.pop(key)
    return json.dumps(d, sort_keys=True)


def _events_by_device(rt: Any) -> dict[int, list[tuple[int, int]]]:
    out: dict[int, list[tuple[int, int]]] = {}
    for e in rt.storages.events:
        out.setdefault(e.device, []).append((e.requested, e.allocated))
    return out


def assert_same(plain: tuple[ScenarioResult, dict], mirrored: tuple[ScenarioResult, dict]
                 ) -> None:
    (a, ta), (b, tb) = plain, mirrored
    assert a.status == "ok", a.message
    for x, y in zip(a.devices, b.devices, strict=True):
        assert x.breakdown_bytes == y.breakdown_bytes, f"cuda:{x.index}"
        assert (x.peak_allocated_bytes, x.peak_requested_bytes, x.peak_reserved_bytes,
                x.peak_phase) == (y.peak_allocated_bytes, y.peak_requested_bytes,
                                  y.peak_reserved_bytes, y.peak_phase), f"cuda:{x.index}"
    assert a.devices[0].timeline == b.devices[0].timeline  # cuda:0's, x positions included
    assert _per_device(a) == _per_device(b)
    # the whole event log, device by device, and as many events in all
    assert _events_by_device(ta["rt"]) == _events_by_device(tb["rt"])
    assert len(ta["rt"].storages.events) == len(tb["rt"].storages.events)


CASES = [
    ("lm", 32, 8),  # 8 equal shards: cuda:1 runs, cuda:2..7 mirror it
    ("lm", 30, 8),  # shards [4]*7 + [2]: the last one runs on its own
    ("attention", 16, 8),  # SDPA (flash kernel), tied embeddings
    ("classifier", 64, 8),  # a loss with parameters
    ("convnet", 24, 4),  # batch norm buffers
    # 4096 indices per replica: the embedding backward's sort-path buffers, mirrored
    (f"{Path(__file__).with_name('fidelity_models.py')}:embedding_sorted", 8, 4),
]


@pytest.mark.parametrize(("workload", "batch", "gpus"), CASES)
@pytest.mark.parametrize("name", [DP_LOSS_PRIMARY, DP_LOSS_FORWARD])
def test_mirrored_replicas_give_every_device_the_same_events(
    workload: str, batch: int, gpus: int, name: str
) -> None:
    wl = load_workload(workload)
    plain, mirrored = run_both(wl, batch, gpus, name)
    # mirrors really stood for replicas (two steps: warm-up + measured)
    assert mirrored[1]["rt"].mirrors.dedupe_failure is None
    assert mirrored[1]["rt"].mirrors.mirrored_replicas > 0
    assert plain[1]["rt"].mirrors.mirrored_replicas == 0
    assert_same(plain, mirrored)
    # the kernels' choices are counted for every replica (the notes say how many)
    assert plain[0].notes == mirrored[0].notes


def test_uneven_chunks_and_output_device_as_the_fixes_emulate_them() -> None:
    wl = load_workload("lm")
    cases: list[tuple[int, dict, int]] = [
        (7, {"dp_chunk_sizes": (2, 5, 5, 5, 5, 5, 5)}, 2 * 5),  # cuda:2..6 mirror cuda:1
        # the output device mirrors cuda:1 too: its share of the gradient is a view there
        # (held until cuda:1's copy dies), its gathered outputs and loss its own events
        (8, {"dp_output_device": 7}, 2 * 6),
        (8, {"dp_output_device": 3}, 2 * 6),
        (8, {"dp_output_device": 1}, 2 * 5),  # it never runs for others: 2..7 mirror 2
    ]
    for gpus, extra, mirrored in cases:
        plain, dedup = run_both(wl, 32, gpus, **extra)
        assert dedup[1]["rt"].mirrors.mirrored_replicas == mirrored, extra
        assert_same(plain, dedup)


class _EchoesInput(nn.Module):
    """Returns a view of its input next to its output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), x[:, :4]


class _TouchesCuda0(_EchoesInput):
    """Every replica makes a tensor on cuda:0 (a mirror of cuda:1 would not copy it)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bias = torch.ones(16, device="cuda:0").to(x.device)
        return self.lin(x) + bias, x[:, :4]


def _workload(model: type[nn.Module]) -> Workload:
    return Workload(
        model=model,
        batch=lambda rows, device: (torch.randn(rows, 16, device=device),
                                    torch.randn(rows, 16, device=device)),
        loss=lambda out, y: ((out[0] - y) ** 2).mean() + out[1].mean(),
        name=model.__name__,
    )


def test_a_replica_that_returns_a_view_of_its_input_is_mirrored() -> None:
    wl = _workload(_EchoesInput)
    plain, mirrored = run_both(wl, 32, 4)
    assert mirrored[1]["rt"].mirrors.mirrored_replicas == 4
    assert_same(plain, mirrored)


def test_a_replica_that_touches_another_device_is_run_on_every_device() -> None:
    wl = _workload(_TouchesCuda0)
    plain, rerun = run_both(wl, 32, 4)
    assert rerun[1]["rt"].mirrors.dedupe_replicas is False  # the result comes from the rerun
    assert rerun[1]["rt"].mirrors.mirrored_replicas == 0
    assert_same(plain, rerun)


def test_real_numbers_run_every_replica() -> None:
    wl = load_workload("mlp")
    _, trace = _run(wl, 16, 4, DP_LOSS_PRIMARY, dedupe=True, compute=True)
    assert trace["rt"].mirrors.dedupe_replicas is False
    assert trace["rt"].mirrors.mirrored_replicas == 0


class _KeywordsModel(nn.Module):
    """Called the Hugging Face way (keyword tensors), returns a dict with a per-replica
    scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 16)
        self.lin = nn.Linear(16, 100)

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
        h = self.emb(input_ids) * mask.unsqueeze(-1)
        return {"logits": self.lin(h), "aux": h.pow(2).mean()}


def test_keyword_inputs_and_dict_outputs_are_mirrored() -> None:
    wl = Workload(
        model=_KeywordsModel,
        batch=lambda rows, device: (
            {"input_ids": torch.randint(0, 100, (rows, 12), device=device),
             "mask": torch.ones(rows, 12, device=device)},
            torch.randint(0, 100, (rows, 12), device=device)),
        loss=lambda out, y: nn.functional.cross_entropy(
            out["logits"].flatten(0, 1), y.flatten()) + out["aux"].mean(),
        name="keywords",
    )
    for batch in (32, 30):  # 8 equal shards; [4] * 7 + [2]
        plain, mirrored = run_both(wl, batch, 8)
        assert mirrored[1]["rt"].mirrors.mirrored_replicas == (12 if batch == 32 else 10)
        assert_same(plain, mirrored)


class _ReadsAValue(_EchoesInput):
    """Reads a number in forward (an emulated value: a stand-in, counted per replica)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = 1.0 + 0.0 * float(x.abs().max().item())
        return self.lin(x) * scale, x[:, :4]


def test_values_read_in_a_mirrored_replica_are_counted_for_every_replica() -> None:
    wl = _workload(_ReadsAValue)
    plain, mirrored = run_both(wl, 32, 4)
    assert mirrored[1]["rt"].mirrors.mirrored_replicas == 4
    assert_same(plain, mirrored)
    assert plain[0].notes == mirrored[0].notes
    assert plain[1]["rt"].stand_ins.total == 2 * 4  # two steps, four replicas


@pytest.mark.parametrize(("workload", "batch", "gpus"), [("lm", 32, 4), ("convnet", 24, 4)])
def test_the_predicted_step_agrees_with_every_replica_run(workload: str, batch: int,
                                                          gpus: int) -> None:
    """Mirrored replicas predict the step the full emulation predicts, within 5 %: each
    replica's op is charged to the host once per replica, as its own thread issues it."""
    (full, _), (mirrored, _) = run_both(load_workload(workload), batch, gpus)
    a, b = full.predicted_step_time_s, mirrored.predicted_step_time_s
    assert a is not None and b is not None
    assert b == pytest.approx(a, rel=0.05)
