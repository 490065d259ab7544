"""benchmarks/emulator_vs_gpu.py with one GPU: the tests' CPU host stands in for the GPU
(tests/fake_cuda.py), so the cuda backend's own code runs each scenario over one device and
the benchmark's rows still check single, the reserved model and the context."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import fake_cuda
import pytest

from dpprof.pipeline import CompareConfig, run_compare
from dpprof.scenarios.names import DDP, DP_LOSS_FORWARD, DP_LOSS_PRIMARY, SINGLE
from dpprof.scenarios.step import StepConfig

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "emulator_vs_gpu.py"


def _bench() -> object:
    spec = importlib.util.spec_from_file_location("emulator_vs_gpu", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_one_gpu_runs_every_scenario_and_checks_single_reserved_and_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bench = _bench()
    fake_cuda.install(monkeypatch, gpus=1)
    common = {"workload": "mlp", "step": StepConfig(batch=8, warmup=1, steps=2), "gpus": 1,
              "fixes": False, "gpu_memory_bytes": 80 * 2**30, "count_reserved": True}
    real = run_compare(CompareConfig(backend="cuda", **common))
    emu = run_compare(CompareConfig(backend="emulated", compute_capability=(9, 0), **common))
    assert real is not None and emu is not None and real.backend == "cuda"
    rows = bench.compare_runs(real, emu)  # type: ignore[attr-defined]
    by_scenario = {r["scenario"]: r for r in rows}
    assert set(by_scenario) == {DP_LOSS_PRIMARY, DP_LOSS_FORWARD, DDP, SINGLE}, rows
    for r in rows:
        assert r["status"] == ["ok", "ok"], r["messages"]
        assert r["device"] == 0
    single = by_scenario[SINGLE]
    # the measured side is the run's own (the CPU stand-in has no allocator statistics),
    # the emulated side the emulator's allocated, reserved and modelled context
    measured = real.scenario(SINGLE).device(0)  # type: ignore[union-attr]
    assert single["measured_allocated_bytes"] == (
        measured.peak_allocated_bytes if measured.allocator_stats else None)
    assert single["emulated_reserved_bytes"] >= single["emulated_allocated_bytes"] > 0
    assert single["emulated_context_bytes"] > 0
    assert single["emulated_total_bytes"] == (
        single["emulated_reserved_bytes"] + single["emulated_context_bytes"])


def test_the_zoo_joins_the_default_workloads_when_it_imports() -> None:
    bench = _bench()
    names = bench.default_workloads()  # type: ignore[attr-defined]
    assert names[:5] == ["lm", "mlp", "convnet", "classifier", "attention"]
    zoo = [n for n in names if n.endswith(":gpt2")]
    if importlib.util.find_spec("transformers") is None:
        assert zoo == []
    else:
        assert zoo and Path(zoo[0].rsplit(":", 1)[0]).name == "zoo.py"


def test_a_zoo_model_joins_only_when_its_library_is_installed() -> None:
    bench = _bench()
    none = bench.default_workloads(lambda module: False)  # type: ignore[attr-defined]
    assert none == ["lm", "mlp", "convnet", "classifier", "attention"]
    only_timm = bench.default_workloads(lambda module: module == "timm")  # type: ignore[attr-defined]
    assert [n.rsplit(":", 1)[1] for n in only_timm[5:]] == ["timm_convnext", "timm_vit"]
