"""benchmarks/emulator_vs_gpu.py: its comparison logic (the GPU run itself needs GPUs)."""

import importlib.util
from pathlib import Path

import pytest

from dpprof.result import RunResult, load

ROOT = Path(__file__).resolve().parent.parent


def _module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "emulator_vs_gpu", ROOT / "benchmarks" / "emulator_vs_gpu.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rows_pair_scenarios_and_devices_and_give_the_relative_error() -> None:
    mod = _module()
    real = load(ROOT / "tests" / "data" / "synthetic-nvml.json")
    emu = RunResult.from_dict(real.to_dict())
    d = emu.scenarios[0].devices[0]
    d.peak_allocated_bytes = int(d.peak_allocated_bytes * 1.1)
    rows = mod.compare_runs(real, emu)
    assert len(rows) == sum(len([x for x in s.devices if x.used]) for s in real.scenarios)
    first = rows[0]
    assert first["scenario"] == real.scenarios[0].name and first["device"] == d.index
    assert first["allocated_error"] == pytest.approx(0.1, abs=1e-6)
    assert all(r["allocated_error"] == 0.0 for r in rows[1:] if r["allocated_error"] is not None)


def test_without_gpus_it_says_so_and_exits_2(capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs")
    monkeypatch.setattr("sys.argv", ["emulator_vs_gpu.py"])
    assert _module().main() == 2
    assert "needs 2 CUDA GPUs" in capsys.readouterr().err
