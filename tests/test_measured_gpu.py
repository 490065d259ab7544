"""The emulator against what a real H100 measured (tests/data/h100_measured.json).

The figures were measured on an NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, CUDA 13.0) by
scripts/gpu_check.sh and scripts/gpu_attribution.py: each scenario's max_memory_allocated and
max_memory_reserved over measured steps, and the libraries' first-use growth. The emulator
runs here on the CPU, with no GPU, and must reproduce them: to the byte where the measurement
is a pure function of the program, and within the stated tolerance elsewhere."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dpprof.emulator.context import device_context
from dpprof.pipeline import CompareConfig, run_compare
from dpprof.result import DeviceResult, RunResult
from dpprof.scenarios.step import StepConfig

DATA = Path(__file__).resolve().parent / "data"
MEASURED: dict[str, Any] = json.loads((DATA / "h100_measured.json").read_text())
H100 = (9, 0)


def _emulate(workload: str, batch: int, amp: str | None = None) -> RunResult:
    result = run_compare(CompareConfig(
        backend="emulated", workload=workload, gpus=1, compute_capability=H100, fixes=False,
        step=StepConfig(batch=batch, warmup=1, steps=3, amp=amp)))
    assert result is not None
    return result


def _device(run: RunResult, scenario: str) -> DeviceResult:
    s = run.scenario(scenario)
    assert s is not None and s.status == "ok", scenario
    d = s.device(0)
    assert d is not None
    return d


def _as_the_gpu_counts(d: DeviceResult) -> int:
    """max_memory_allocated's view: the tensors and the workspaces the allocator serves."""
    return d.gpu_allocated_bytes


def test_the_workspaces_are_what_the_h100_allocated_at_first_use() -> None:
    growth = MEASURED["library_first_use_growth_bytes"]
    ctx = device_context(H100, uses_cudnn=False)
    # one cuBLAS workspace per thread that runs a matmul: the forward's and autograd's
    assert ctx.cublas_workspace_bytes == growth["mm_main_thread"]
    assert ctx.cublas_workspace_bytes == growth["backward_autograd_thread"]
    assert ctx.cublas_workspaces == 2
    # an addmm (a Linear's bias) adds cuBLASLt's own workspace, once
    assert ctx.cublaslt_workspace_bytes * ctx.cublaslt_workspaces == growth["addmm_main_thread"]


@pytest.mark.parametrize("scenario", ["dp-loss-primary", "dp-loss-forward", "single"])
def test_one_process_scenarios_match_the_h100_allocated_and_reserved(scenario: str) -> None:
    mlp = _device(_emulate("mlp", 64), scenario)
    for run in ("mlp_batch64_run1", "mlp_batch64_run4"):
        real = MEASURED[run][scenario]
        # 0.1 %: 256 KiB of a loss temporary (mse_loss's) the GPU keeps a moment longer
        assert _as_the_gpu_counts(mlp) == pytest.approx(real["peak_allocated_bytes"], rel=1e-3)
        assert mlp.peak_reserved_bytes == real["peak_reserved_bytes"]
    wide = _device(_emulate(str(DATA / "gpu_workloads.py") + ":wide", 256), scenario)
    assert _as_the_gpu_counts(wide) == MEASURED["wide_batch256"][scenario]["peak_allocated_bytes"]
    if scenario == "single":  # the others' reserve held segments of earlier checks
        assert wide.peak_reserved_bytes == MEASURED["wide_batch256"]["single"][
            "peak_reserved_bytes"]


def test_ddp_matches_the_h100_once_nccl_has_let_go_of_the_first_buckets() -> None:
    d = _device(_emulate("mlp", 64), "ddp")
    steady, lingering = MEASURED["mlp_batch64_run4"]["ddp"], MEASURED["mlp_batch64_run1"]["ddp"]
    assert _as_the_gpu_counts(d) == pytest.approx(steady["peak_allocated_bytes"], rel=1e-3)
    assert d.peak_reserved_bytes == steady["peak_reserved_bytes"]
    assert d.peak_reserved_bytes + (d.context_bytes or 0) == pytest.approx(
        steady["nvml_peak_used_bytes"], rel=1e-3)
    # the other run kept the buckets of the first iteration beside the rebuilt ones: one
    # more copy of the parameters, which steps paused for 0.5 s, or gloo, never kept
    timing = {(t["backend"], t["pause_s"]): t for t in MEASURED["ddp_step_by_step_mlp_batch64"]}
    params = timing[("nccl", 0.0)]["param_bytes"]
    assert lingering["peak_allocated_bytes"] - _as_the_gpu_counts(d) == pytest.approx(
        params, rel=1e-2)
    later_peaks = {k: {s["peak_bytes"] for s in t["steps"][1:]} for k, t in timing.items()}
    assert later_peaks[("nccl", 0.5)] == later_peaks[("gloo", 0.0)] == {
        timing[("nccl", 0.0)]["steps"][0]["peak_bytes"]}
    assert later_peaks[("nccl", 0.0)] == {timing[("nccl", 0.0)]["steps"][0]["peak_bytes"]
                                          + params}
    assert any("watchdog" in n for n in device_context(H100, uses_cudnn=False).assumptions)


@pytest.mark.parametrize("scenario", ["dp-loss-primary", "dp-loss-forward", "single"])
def test_a_convnet_matches_the_h100_allocated_and_reserved_to_the_byte(scenario: str) -> None:
    d = _device(_emulate("convnet", 32), scenario)
    real = MEASURED["convnet_batch32"][scenario]
    assert _as_the_gpu_counts(d) == real["peak_allocated_bytes"]
    assert d.peak_reserved_bytes == real["peak_reserved_bytes"]


# What the H100 measured for single with plain float32 at the batch given. Left out, not
# hidden: `classifier` (the GPU's allocated is 7.5 % higher, not yet explained); the README
# lists it.
AGREEING = {"lm": 2e-3, "attention": 1e-3, "convnet": 1e-2, "gpt2": 1e-3, "timm_vit": 1e-3}
NEEDS = {"gpt2": "transformers", "timm_vit": "timm"}


@pytest.mark.parametrize("workload", sorted(AGREEING))
def test_single_matches_the_h100_on_more_models(workload: str) -> None:
    row = next(r for r in MEASURED["benchmark_batch16_or_8"]
               if r["workload"] == workload and r["amp"] is None)
    spec = workload
    if workload in NEEDS:
        pytest.importorskip(NEEDS[workload])
        spec = f"{Path(__file__).resolve().parent / 'zoo.py'}:{workload}"
    d = _device(_emulate(spec, row["batch"]), "single")
    real = row["rows"]["single"]
    assert _as_the_gpu_counts(d) == pytest.approx(real["peak_allocated_bytes"],
                                                  rel=AGREEING[workload])
    assert d.peak_reserved_bytes == pytest.approx(real["peak_reserved_bytes"], rel=3e-2)


@pytest.mark.parametrize("workload", ["lm", "mlp"])
def test_single_under_bf16_autocast_matches_the_h100(workload: str) -> None:
    """--amp bfloat16: lm's loss keeps bfloat16 log-probabilities and nll_loss's float32
    copy, as CUDA's autocast lists have it (the emulator was 6.9 % high before)."""
    row = next(r for r in MEASURED["benchmark_batch16_or_8"]
               if r["workload"] == workload and r["amp"] == "bfloat16")
    d = _device(_emulate(workload, row["batch"], amp="bfloat16"), "single")
    real = row["rows"]["single"]
    assert _as_the_gpu_counts(d) == pytest.approx(real["peak_allocated_bytes"], rel=1e-3)
    if workload == "lm":  # mlp's reserved is 4.9 % under the GPU's, not yet explained
        assert d.peak_reserved_bytes == pytest.approx(real["peak_reserved_bytes"], rel=3e-2)
