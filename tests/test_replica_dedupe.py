"""DataParallel replicas on equal shards emulated once and replayed (dpprof.emulator.replicas):
the per-device results must equal those of emulating every replica, byte for byte."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from dpprof.backends.emulated import EmulationConfig, run_scenario
from dpprof.result import ScenarioResult
from dpprof.scenarios.base import DP_LOSS_FORWARD, DP_LOSS_PRIMARY
from dpprof.scenarios.step import StepConfig
from dpprof.scenarios.workloads import Workload, load_workload


def _run(wl: Workload, batch: int, gpus: int, name: str, dedupe: bool,
         **extra: object) -> tuple[ScenarioResult, dict]:
    cfg = EmulationConfig(step=StepConfig(batch=batch), gpus=gpus, gpu_memory_bytes=2**50,
                          dedupe_replicas=dedupe, debug=True, **extra)  # type: ignore[arg-type]
    trace: dict = {}
    return run_scenario(name, wl, cfg, trace), trace


def _as_bytes(r: ScenarioResult) -> str:
    return json.dumps(dataclasses.asdict(r), sort_keys=True)


CASES = [
    ("lm", 32, 8),  # 8 equal shards: replicas 1..7 replayed
    ("lm", 30, 8),  # shards [4]*7 + [2]: the last one emulated on its own
    ("attention", 16, 8),  # SDPA (flash kernel), tied embeddings
    ("classifier", 64, 8),  # a loss with parameters
    ("convnet", 24, 4),  # batch norm buffers
    # 4096 indices per replica: the embedding backward's sort-path buffers, replayed
    (f"{Path(__file__).with_name('fidelity_models.py')}:embedding_sorted", 8, 4),
]


@pytest.mark.parametrize(("workload", "batch", "gpus"), CASES)
@pytest.mark.parametrize("name", [DP_LOSS_PRIMARY, DP_LOSS_FORWARD])
def test_replayed_replicas_give_the_same_results_byte_for_byte(
    workload: str, batch: int, gpus: int, name: str
) -> None:
    wl = load_workload(workload)
    plain, t_plain = _run(wl, batch, gpus, name, dedupe=False)
    dedup, t_dedup = _run(wl, batch, gpus, name, dedupe=True)
    assert plain.status == "ok", plain.message
    # the replay really stood for replicas (two steps: warm-up + measured)
    assert t_dedup["rt"].dedupe_failure is None
    assert t_dedup["rt"].replayed_replicas > 0
    assert t_plain["rt"].replayed_replicas == 0
    for a, b in zip(plain.devices, dedup.devices, strict=True):
        assert a.breakdown_bytes == b.breakdown_bytes, f"cuda:{a.index}"
        assert (a.peak_allocated_bytes, a.peak_requested_bytes, a.peak_reserved_bytes,
                a.peak_phase) == (b.peak_allocated_bytes, b.peak_requested_bytes,
                                  b.peak_reserved_bytes, b.peak_phase), f"cuda:{a.index}"
        assert a.timeline == b.timeline, f"cuda:{a.index}"
    assert _as_bytes(plain) == _as_bytes(dedup)
    # the whole event log, not only what the result keeps of it
    ev_a = [(e.device, e.requested, e.allocated) for e in t_plain["rt"].events]
    ev_b = [(e.device, e.requested, e.allocated) for e in t_dedup["rt"].events]
    assert ev_a == ev_b


def test_uneven_chunks_and_output_device_as_the_fixes_emulate_them() -> None:
    wl = load_workload("lm")
    cases: list[tuple[int, dict, int]] = [
        (7, {"dp_chunk_sizes": (2, 5, 5, 5, 5, 5, 5)}, 2 * 5),  # replicas 2..6 replayed
        (8, {"dp_output_device": 7}, 2 * 5),  # cuda:7 gets a view of the gradient: alone
        (8, {"dp_output_device": 3}, 2 * (1 + 3)),  # groups 1..2 and 4..7
    ]
    for gpus, extra, replayed in cases:
        plain, _ = _run(wl, 32, gpus, DP_LOSS_PRIMARY, False, **extra)
        dedup, t = _run(wl, 32, gpus, DP_LOSS_PRIMARY, True, **extra)
        assert t["rt"].replayed_replicas == replayed, extra
        assert _as_bytes(plain) == _as_bytes(dedup)


class _EchoesInput(nn.Module):
    """Returns a view of its input next to its output: no storage of its own to replay."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), x[:, :4]


def _echo_workload() -> Workload:
    return Workload(
        model=_EchoesInput,
        batch=lambda rows, device: (torch.randn(rows, 16, device=device),
                                    torch.randn(rows, 16, device=device)),
        loss=lambda out, y: ((out[0] - y) ** 2).mean() + out[1].mean(),
        name="echo",
    )


def test_a_replica_the_replay_cannot_stand_for_is_emulated_in_full() -> None:
    wl = _echo_workload()
    plain, _ = _run(wl, 32, 4, DP_LOSS_PRIMARY, dedupe=False)
    dedup, trace = _run(wl, 32, 4, DP_LOSS_PRIMARY, dedupe=True)
    assert plain.status == "ok", plain.message
    assert trace["rt"].dedupe_replicas is False  # the result comes from the rerun
    assert _as_bytes(plain) == _as_bytes(dedup)


def test_real_numbers_run_every_replica() -> None:
    wl = load_workload("mlp")
    _, trace = _run(wl, 16, 4, DP_LOSS_PRIMARY, dedupe=True, compute=True)
    assert trace["rt"].dedupe_replicas is False
    assert trace["rt"].replayed_replicas == 0


def _shape_of(replica: nn.Module, names: dict[int, str]) -> list[object]:
    """A replica's modules as (type, __dict__ keys in order, each value named: a tensor or
    module by what it is, anything else by identity): equal for equal constructions."""
    out: list[object] = []
    for m in replica.modules():
        row = []
        for k, v in m.__dict__.items():
            if isinstance(v, dict):
                v = tuple((kk, names.get(id(vv), id(vv))) for kk, vv in v.items())
            row.append((k, names.get(id(v), id(v)) if not isinstance(v, tuple) else v))
        out.append((type(m), row))
    return out


@pytest.mark.parametrize("workload", ["lm", "attention", "convnet", "classifier"])
def test_cloned_replicas_are_the_modules_replicate_builds(workload: str) -> None:
    """clone_replica (replicas 2.. under the replay) builds, for each device, modules with
    the same __dict__ keys in the same order holding the same objects as replicate's line
    for line construction: its own modules and tensors, the originals' hooks and plain
    attributes."""
    from dpprof.emulator.parallel import replicate
    from dpprof.emulator.vdevice import VirtualDevices

    wl = load_workload(workload)
    shapes = []
    rt = VirtualDevices(4)
    with rt, rt.device(0):
        model = wl.model()  # one model: the originals' objects are the same in both
    for dedupe in (False, True):
        rt.dedupe_replicas = dedupe
        with rt, rt.device(0):
            replicas = replicate(rt, model, [0, 1, 2, 3])
            names: dict[int, str] = {}
            for j, r in enumerate(replicas):
                for i, m in enumerate(r.modules()):
                    names[id(m)] = f"module {i} of replica {j}"
                    for k, t in [*m.__dict__.items(), *m._buffers.items()]:
                        if isinstance(t, torch.Tensor):
                            names[id(t)] = f"{k} of module {i} on {rt.device_of(t)}"
            shapes.append([_shape_of(r, names) for r in replicas])
    assert shapes[0] == shapes[1]
