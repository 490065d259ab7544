"""dpprof compare on models that name their devices themselves (issue 11 part 3).

Byte counts come from the layer shapes in tests/data/device_workloads.py (4 bytes per
float32 element, each storage rounded up to 512 B)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from dpprof.pipeline import CompareConfig, run_compare
from dpprof.result import RunResult
from dpprof.scenarios.step import StepConfig

WL = Path(__file__).parent / "data" / "device_workloads.py"


def r512(n: int) -> int:
    return -(-n // 512) * 512


def compare(name: str, batch: int = 64, **kw: object) -> RunResult:
    run = run_compare(CompareConfig(workload=f"{WL}:{name}", step=StepConfig(batch=batch),
                                    fixes=False, **kw))  # type: ignore[arg-type]
    assert run is not None
    return run


def test_model_parallel_model_shows_each_gpus_share() -> None:
    run = compare("model_parallel")
    single = run.scenario("single")
    assert single is not None and single.status == "ok", single and single.message
    d0, d1 = single.devices  # the two GPUs the model placed itself on, no more
    assert d0.breakdown_bytes["parameters"] == r512(4 * 1000 * 2000) + r512(4 * 2000)
    assert d1.breakdown_bytes["parameters"] == r512(4 * 2000 * 500) + r512(4 * 500)
    assert d0.breakdown_bytes["gradients"] == d0.breakdown_bytes["parameters"]
    # DataParallel refuses such a model, as torch does; DDP per GPU does not apply
    for name in ("dp-loss-primary", "dp-loss-forward"):
        s = run.scenario(name)
        assert s is not None and s.status == "error"
        assert "must have its parameters and buffers on device cuda:0" in s.message
    ddp = run.scenario("ddp")
    assert ddp is not None and ddp.status == "error" and "2 GPUs itself" in ddp.message


def test_item_and_bool_in_forward_are_counted_stand_ins() -> None:
    run = compare("item_in_forward", batch=16)
    for s in run.scenarios:
        assert s.status == "ok", s.message
        note = next(n for n in s.notes if "stand-ins" in n)
        assert "item x" in note and "bool x" in note and "device_workloads.py:53" in note
    single = run.scenario("single")
    assert single is not None
    # the model's .cuda() in __init__ put Linear(64, 32) on cuda:0
    assert single.devices[0].breakdown_bytes["parameters"] == r512(4 * 64 * 32) + r512(4 * 32)


def test_data_dependent_shape_names_the_fix() -> None:
    run = compare("masked", batch=8)
    single = run.scenario("single")
    assert single is not None and single.status == "error"
    assert "boolean mask" in single.message and "--compute" in single.message
    assert "--backend cpu" in single.message and "device_workloads.py:77" in single.message
    computed = compare("masked", batch=8, compute=True, scenarios=("single",),
                       equivalence=False)
    assert computed.scenarios[0].status == "ok"


def test_keras3_model_runs_every_scenario() -> None:
    if importlib.util.find_spec("keras") is None:
        pytest.skip("keras is not installed (pip install -e '.[test]')")
    run = compare("keras_mlp")
    params = r512(4 * 64 * 512) + r512(4 * 512) + r512(4 * 512 * 10) + r512(4 * 10)
    for s in run.scenarios:
        assert s.status == "ok", f"{s.name}: {s.message}"
        assert s.devices[0].breakdown_bytes["parameters"] == params
    dp = run.scenario("dp-loss-primary")
    assert dp is not None
    assert dp.devices[0].peak_allocated_bytes > dp.devices[1].peak_allocated_bytes
