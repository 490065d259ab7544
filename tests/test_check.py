"""``dpprof check`` over the tests' fakes: one CPU "GPU" (tests/fake_cuda.py) and a fake
NVML that lists host PIDs, as a container does; without a GPU it says so and exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import fake_cuda
import pytest
from fake_nvml import FakeDevice, FakeNvml
from typer.testing import CliRunner

from dpprof.cli.app import app
from dpprof.nvml import libnvml

UA = "GPU-11111111-2222-3333-4444-555555555555"


def test_check_without_a_gpu_is_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda.install(monkeypatch, gpus=0, children=False)
    r = CliRunner().invoke(app, ["check"])
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU visible" in lines[0]


def test_check_reports_devices_context_scenarios_and_the_samplers_cost(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    nvml = FakeNvml([FakeDevice(UA, name="NVIDIA H100 80GB HBM3", used=3 * 2**30,
                                processes=[(3_512_771, 600 * 2**20)])])  # a host PID
    monkeypatch.setattr(libnvml, "default_nvml", lambda: nvml)
    fake_cuda.install(monkeypatch, gpus=1, children=False)
    out = tmp_path / "check.json"
    r = CliRunner().invoke(app, ["check", "-b", "4", "-s", "single,dp-loss-primary",
                                 "--sampler-steps", "2", "--steps", "1", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert f"cuda:0 = NVML 0 {UA}" in r.stdout
    assert "per-process NVML: no: NVML lists 1 process(es) but not this one" in r.stdout
    assert "NVIDIA H100 80GB HBM3, compute 9.0" in r.stdout
    report = json.loads(out.read_text())
    assert [row["scenario"] for row in report["rows"]] == ["single", "dp-loss-primary"]
    assert all(row["status"] == ["ok", "ok"] for row in report["rows"])
    assert report["context"]["emulated_bytes"] > 0  # measured: None, no allocator here
    assert report["sampler"]["devices_sampled"] == 1 and report["sampler"]["tick_s"] > 0
    assert "NVML sampler every 20 ms over 1 GPU(s)" in r.stdout


def test_a_saved_calibration_is_what_later_emulations_of_that_gpu_use(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    from dpprof.self_check import save_measured

    monkeypatch.setenv("DPPROF_CALIBRATION_DIR", str(tmp_path / "cal"))
    args = ["compare", "-w", "mlp", "-b", "8", "--gpus", "2", "-s", "single",
            "--gpu", "h100-80gb", "-q", "-o", str(tmp_path / "before.json")]
    assert CliRunner().invoke(app, args).exit_code == 0
    before = json.loads((tmp_path / "before.json").read_text())
    measured = {"gpu": "NVIDIA H100 80GB HBM3", "compute_capability": [9, 0],
                "torch": "2.13.0", "context": {"measured_bytes": 700 * 2**20},
                "cublas_workspace": {"measured_bytes": 8 * 2**20}}
    said = save_measured(measured)
    assert "saved the calibration of compute capability 9.0" in said
    assert (tmp_path / "cal" / "sm_90.json").is_file()
    args[-1] = str(tmp_path / "after.json")
    assert CliRunner().invoke(app, args).exit_code == 0
    after = json.loads((tmp_path / "after.json").read_text())
    d0, d1 = before["scenarios"][0]["devices"][0], after["scenarios"][0]["devices"][0]
    assert d1["peak_allocated_bytes"] == d0["peak_allocated_bytes"]  # tensors: the same
    assert d1["context_bytes"] != d0["context_bytes"]
    assert any(a.startswith("Calibrated: the CUDA context (734,003,200 B)")
               for a in after["assumptions"])
    assert not any(a.startswith("Calibrated") for a in before["assumptions"])


def test_nothing_is_saved_as_a_calibration_that_was_not_measured(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    from dpprof.self_check import save_measured

    monkeypatch.setenv("DPPROF_CALIBRATION_DIR", str(tmp_path))
    said = save_measured({"gpu": "x", "compute_capability": [9, 0],
                          "context": {"measured_bytes": None},
                          "cublas_workspace": {"measured_bytes": 8 * 2**20}})
    assert said.startswith("no calibration saved")
    assert list(tmp_path.iterdir()) == []
