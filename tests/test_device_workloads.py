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
    # DataParallel and DDP per GPU do not apply to such a model: a note, not errors
    assert [s.name for s in run.scenarios] == ["single"]
    assert any("not applicable" in n and "2 GPUs itself" in n for n in run.notes)


def test_model_parallel_with_a_plain_loss_runs_single_and_rules_out_the_rest() -> None:
    """The loop moves the labels to the outputs' GPU (the tutorial's
    ``labels.to(outputs.device)``); DataParallel and DDP are not applicable, said in a note,
    not errors."""
    run = compare("model_parallel_plain_loss")
    assert [s.name for s in run.scenarios] == ["single"]
    single = run.scenarios[0]
    assert single.status == "ok", single.message
    assert len(single.devices) == 2  # the labels went to cuda:1, beside the outputs
    assert single.devices[1].breakdown_bytes["parameters"] == (
        r512(4 * 2000 * 500) + r512(4 * 500))
    note = next(n for n in run.notes if "not applicable" in n)
    assert note.startswith("dp-loss-primary, dp-loss-forward, ddp: not applicable")
    assert "2 GPUs itself (cuda:0, cuda:1)" in note
    assert run.comparison.verdict.startswith("The model places its work on cuda:0 (")
    assert not run.fixes


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
