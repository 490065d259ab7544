"""FSDP2 with CPU offload (``CPUOffloadPolicy``) emulated per rank: the host side.

CPU offload on a gloo rank is meaningless (no device to offload from), so the GPU side is
checked against an H200 (``tests/test_measured_ladder.py``). Here the host side: the rung
runs torch's own ``fully_shard`` over a fake process group with the model built on the host,
and after the step the host memory the run reports is what the real CPU tensors that FSDP2
and the optimizer hold take: each rank's padded shard of every parameter (pinned), its
gradient shard (copied back from the GPU into pinned memory) and AdamW's state (pageable).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from dpprof.backends.emulated import EmulationConfig, run_scenario
from dpprof.emulator.fsdp import emulated_ranks
from dpprof.measure.ladder_rungs import Rung
from dpprof.measure.rung_models import rung_workload
from dpprof.scenarios.step import StepConfig, build_model
from dpprof.scenarios.workloads import LMConfig, Workload, lm

WORLD = 3  # uneven: the vocabulary (1000 rows) and the positions (24) shard with padding
OFFLOAD = Rung("offload", "ZeRO-3 and CPU offload", None, False, reshard_after_forward=True,
               offload=True)
_real_device = torch._C.TensorBase.__dict__["device"].__get__


def _workload() -> Workload:
    return lm(LMConfig(vocab=1000, seq=24, d_model=64, layers=2, heads=4))


def _run(wl: Workload) -> tuple[Any, dict[str, Any]]:
    trace: dict[str, Any] = {}
    cfg = EmulationConfig(gpus=1, gpu_memory_bytes=2**40, step=StepConfig(batch=4),
                          collectives=True, host_model=True)
    with emulated_ranks(WORLD):
        result = run_scenario("single", rung_workload(wl, OFFLOAD), cfg, trace)
    assert result.status == "ok", result.message
    return result, trace


def _fsdp_params(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [fp for m in model.modules() if isinstance(m, FSDPModule)
            for fp in m._get_fsdp_state()._fsdp_param_group.fsdp_params]


@pytest.fixture(scope="module")
def offloaded() -> tuple[Any, dict[str, Any]]:
    return _run(_workload())


def test_the_host_bytes_are_the_real_cpu_tensors_after_a_step(
        offloaded: tuple[Any, dict[str, Any]]) -> None:
    _, trace = offloaded
    rt, model, opt = trace["rt"], trace["model"], trace["optimizer"]
    shards = [fp._sharded_param_data for fp in _fsdp_params(model)]
    grads = [fp.sharded_param.grad._local_tensor for fp in _fsdp_params(model)]
    state = [v.to_local() if hasattr(v, "to_local") else v
             for st in opt.state.values() for v in st.values()]
    assert shards and len(grads) == len(shards) and len(state) == 3 * len(shards)
    for t in (*shards, *grads, *state):  # real host memory with values, not emulated
        assert _real_device(t).type == "cpu"
    assert all(rt.is_pinned(t) for t in (*shards, *grads))
    assert not any(rt.is_pinned(t) for t in state)  # zeros_like: pageable
    host = trace["host_bytes"]
    assert host["parameters"] == sum(t.untyped_storage().nbytes() for t in shards)
    assert host["gradients"] == sum(t.untyped_storage().nbytes() for t in grads)
    assert host["optimizer_state"] == sum(t.untyped_storage().nbytes() for t in state)
    assert host["pinned"] == host["parameters"] + host["gradients"]


def test_the_result_reports_the_host_memory(offloaded: tuple[Any, dict[str, Any]]) -> None:
    result, trace = offloaded
    assert result.host_bytes == trace["host_bytes"] and result.host_bytes["parameters"] > 0
    from dpprof.result import RunResult, ScenarioResult

    run = RunResult(backend="emulated", workload="lm", batch=4, gpus=1, gpu_memory_bytes=1,
                    scenarios=[result])
    loaded = RunResult.from_dict(run.to_dict()).scenarios[0]
    assert isinstance(loaded, ScenarioResult) and loaded.host_bytes == result.host_bytes


def test_each_rank_holds_its_padded_share_of_the_model_on_the_host(
        offloaded: tuple[Any, dict[str, Any]]) -> None:
    # rank 0 of WORLD: every parameter cut along dim 0 in WORLD chunks, the first (the
    # largest) padded to ceil(rows / WORLD); AdamW's two moments and its step per parameter
    _, trace = offloaded
    whole = build_model(_workload(), 0)
    share = sum(math.ceil(p.shape[0] / WORLD) * math.prod(p.shape[1:]) * p.element_size()
                for p in whole.parameters())
    assert trace["host_bytes"]["parameters"] == share
    assert trace["host_bytes"]["gradients"] == share
    steps = 4 * sum(1 for _ in whole.parameters())  # a float32 scalar each
    assert trace["host_bytes"]["optimizer_state"] == 2 * share + steps


def test_without_offload_nothing_is_kept_on_the_host() -> None:
    zero3 = Rung("zero3", "ZeRO-3", None, False, reshard_after_forward=True)
    cfg = EmulationConfig(gpus=1, gpu_memory_bytes=2**40, step=StepConfig(batch=4),
                          collectives=True)
    trace: dict[str, Any] = {}
    with emulated_ranks(WORLD):
        result = run_scenario("single", rung_workload(_workload(), zero3), cfg, trace)
    assert result.status == "ok", result.message
    assert "host_bytes" not in trace

