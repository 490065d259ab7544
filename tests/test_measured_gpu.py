"""The emulator against what a real H100 measured (tests/data/h100_measured.json).

The figures were measured on an NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, CUDA 13.0) by
scripts/gpu_check.sh and scripts/gpu_attribution.py: each scenario's max_memory_allocated and
max_memory_reserved over measured steps, and the libraries' first-use growth. The emulator
runs here on the CPU, with no GPU, and must reproduce them: to the byte where the measurement
is a pure function of the program, and within the stated tolerance elsewhere."""

from __future__ import annotations

import importlib.util
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


def test_the_script_the_h100_ran_reads_each_workspace_as_the_h100_did() -> None:
    """scripts/gpu_attribution.py's first-use probe, run on virtual H100s: what it reads of
    ``memory_allocated`` grows as the H100's did, to the byte, at each library's first use:
    a thread's first matmul (its handle's cuBLAS workspace), the first addmm (cuBLASLt's),
    the backward (autograd's thread), another thread's and a side stream's matmul (a handle,
    and a (handle, stream), of their own); nothing for a handle's later ops."""
    import sys

    sys.path.insert(0, str(DATA.parent.parent / "scripts"))
    from gpu_attribution import libraries

    from dpprof.emulator.virtual_cuda import VirtualCuda

    with VirtualCuda(1, gpu="h100-80gb"):
        read = libraries()
    measured = MEASURED["library_first_use_growth_bytes"]
    assert {k: read[k] for k in measured} == measured


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


def test_ddp_reports_the_h100s_worst_case_and_its_steady_state_beside_it() -> None:
    """Over NCCL the first iteration's buckets outlive DDP's rebuild until the watchdog
    reaps their all-reduce: one run's measured steps kept them (its peak one copy of the
    parameters higher), another's, after the watchdog, did not. The emulator reports the
    first as the peak and the second beside it."""
    d = _device(_emulate("mlp", 64), "ddp")
    steady, lingering = MEASURED["mlp_batch64_run4"]["ddp"], MEASURED["mlp_batch64_run1"]["ddp"]
    assert _as_the_gpu_counts(d) == pytest.approx(lingering["peak_allocated_bytes"], rel=1e-3)
    assert d.peak_reserved_bytes == lingering["peak_reserved_bytes"]
    assert d.peak_reserved_bytes + (d.context_bytes or 0) == pytest.approx(
        lingering["nvml_peak_used_bytes"], rel=1e-3)
    assert d.steady_peak_allocated_bytes is not None
    assert d.steady_peak_allocated_bytes + (d.workspace_bytes or 0) == pytest.approx(
        steady["peak_allocated_bytes"], rel=1e-3)
    assert d.steady_peak_reserved_bytes == steady["peak_reserved_bytes"]
    assert d.steady_peak_reserved_bytes + (d.context_bytes or 0) == pytest.approx(
        steady["nvml_peak_used_bytes"], rel=1e-3)
    # what the transient is: the buckets of the first iteration, a copy of the parameters;
    # steps paused for 0.5 s, or run over gloo, never kept them
    timing = {(t["backend"], t["pause_s"]): t for t in MEASURED["ddp_step_by_step_mlp_batch64"]}
    params = timing[("nccl", 0.0)]["param_bytes"]
    assert d.transient_bytes == {"ddp_unreaped_buckets": params}
    later_peaks = {k: {s["peak_bytes"] for s in t["steps"][1:]} for k, t in timing.items()}
    assert later_peaks[("nccl", 0.5)] == later_peaks[("gloo", 0.0)] == {
        timing[("nccl", 0.0)]["steps"][0]["peak_bytes"]}
    assert later_peaks[("nccl", 0.0)] == {timing[("nccl", 0.0)]["steps"][0]["peak_bytes"]
                                          + params}


@pytest.mark.parametrize("scenario", ["dp-loss-primary", "dp-loss-forward", "single"])
def test_a_convnet_matches_the_h100_allocated_and_reserved_to_the_byte(scenario: str) -> None:
    d = _device(_emulate("convnet", 32), scenario)
    real = MEASURED["convnet_batch32"][scenario]
    assert _as_the_gpu_counts(d) == real["peak_allocated_bytes"]
    assert d.peak_reserved_bytes == real["peak_reserved_bytes"]


# What the H100 measured for single with plain float32 at the batch given, and how close
# the emulator's allocated comes. classifier's 7.5 % (a 23 MB block alive at the peak) is
# cuDNN's convolution workspace, now estimated per convolution (from the H200's record, not
# from this run): within 1 %; its reserved within 4.5 % (see the H200's test below).
AGREEING = {"lm": 2e-3, "attention": 1e-3, "convnet": 1e-2, "gpt2": 1e-3, "timm_vit": 1e-3,
            "classifier": 1e-2}
RESERVED_TOLERANCE = {"classifier": 4.5e-2}
NEEDS = {"gpt2": "transformers", "timm_vit": "timm"}


@pytest.mark.parametrize("workload", sorted(AGREEING))
def test_single_matches_the_h100_on_more_models(workload: str) -> None:
    row = next(r for r in MEASURED["benchmark_batch16_or_8"]
               if r["workload"] == workload and r["amp"] is None)
    spec = workload
    if workload in NEEDS:
        if importlib.util.find_spec("torchvision") is not None:
            # timm and transformers import torchvision, whose C ops do not load over a CPU
            # torch: declared first, as the zoo declares them (alone, this test ran first)
            from torchvision_shim import import_torchvision

            import_torchvision()
        pytest.importorskip(NEEDS[workload])
        spec = f"{Path(__file__).resolve().parent / 'zoo.py'}:{workload}"
    d = _device(_emulate(spec, row["batch"]), "single")
    real = row["rows"]["single"]
    assert _as_the_gpu_counts(d) == pytest.approx(real["peak_allocated_bytes"],
                                                  rel=AGREEING[workload])
    assert d.peak_reserved_bytes == pytest.approx(real["peak_reserved_bytes"],
                                                  rel=RESERVED_TOLERANCE.get(workload, 3e-2))


@pytest.mark.parametrize("workload", ["lm", "mlp"])
def test_single_under_bf16_autocast_matches_the_h100(workload: str) -> None:
    """--amp bfloat16: lm's loss keeps bfloat16 log-probabilities and nll_loss's float32
    copy, as CUDA's autocast lists have it (the emulator was 6.9 % high before)."""
    row = next(r for r in MEASURED["benchmark_batch16_or_8"]
               if r["workload"] == workload and r["amp"] == "bfloat16")
    d = _device(_emulate(workload, row["batch"], amp="bfloat16"), "single")
    real = row["rows"]["single"]
    assert _as_the_gpu_counts(d) == pytest.approx(real["peak_allocated_bytes"], rel=1e-3)
    # mlp's was 4.9 % under until the cuBLAS workspaces entered the simulated reserve where
    # each thread's first matmul allocates them
    assert d.peak_reserved_bytes == pytest.approx(real["peak_reserved_bytes"], rel=2e-2)


# ---- an NVIDIA H200 (torch 2.11.0+cu130, cuDNN 9.19, NCCL 2.28.9) ---------------------------
# benchmarks/emulator_vs_gpu.py's rows of 2026-11-28 (batch 16, one GPU) and
# scripts/gpu_measure.py's record (tests/data/h200_measured.json)

H200_MEASURED: dict[str, Any] = json.loads((DATA / "h200_measured.json").read_text())
H200_ROWS = [r for r in (json.loads(line) for line in (
    DATA.parent.parent / "benchmarks" / "emulator_vs_gpu.jsonl").read_text().splitlines())
    if r.get("gpu") == "NVIDIA H200" and "rows" in r]
H200 = (9, 0)


def _h200_rows(workload: str, amp: str | None, scenario: str) -> list[dict[str, Any]]:
    """The scenario's row in every recorded H200 run of the workload (two runs of
    2026-11-28: every workload in one process, then each in a process of its own)."""
    return [row for run in H200_ROWS if run["workload"] == workload and run["amp"] == amp
            for row in run["rows"] if row["scenario"] == scenario]


@pytest.mark.parametrize(("workload", "amp"), [
    ("mlp", None), ("lm", None), ("attention", None), ("convnet", None), ("classifier", None),
    ("mlp", "bfloat16"), ("lm", "bfloat16")])
def test_single_matches_the_h200(workload: str, amp: str | None) -> None:
    """Every built-in, classifier too: its 7.5 % (a 23 MB cuDNN workspace alive at the peak)
    is cuDNN's workspace, now estimated per convolution (dpprof.emulator.cudnn_workspace)."""
    d = _device(_emulate(workload, 16, amp), "single")
    rows = _h200_rows(workload, amp, "single")
    assert rows
    for real in rows:
        assert _as_the_gpu_counts(d) == pytest.approx(real["measured_allocated_bytes"],
                                                      rel=1e-2)
        # classifier's reserved: 4.0 % under (the workspaces' sizes decide its segments:
        # the measured sizes give +2.7 %); gpu_measure.py's conv-split part measures more
        tolerance = 0.045 if workload == "classifier" else 0.02
        assert d.peak_reserved_bytes == pytest.approx(real["measured_reserved_bytes"],
                                                      rel=tolerance)
        assert d.total_peak_bytes == pytest.approx(real["nvml_peak_used_bytes"], rel=0.02)


@pytest.mark.parametrize(("workload", "amp"), [
    ("mlp", None), ("lm", None), ("attention", None), ("convnet", None), ("classifier", None),
    ("mlp", "bfloat16"), ("lm", "bfloat16")])
def test_ddp_brackets_what_the_h200s_measured_steps_held(workload: str, amp: str | None) -> None:
    """The GPU's measured steps (after 3 of warm-up) held the first iteration's buckets or
    not, as the watchdog's timing had it (a fast loop's, mlp's: yes; lm's 23 ms steps: no):
    its peak is the emulator's worst case or its steady state within 2 %, in each recorded
    run, and never more than 2 % above the worst case."""
    d = _device(_emulate(workload, 16, amp), "ddp")
    worst = _as_the_gpu_counts(d)
    assert d.steady_peak_allocated_bytes is not None and d.transient_bytes
    steady = d.steady_peak_allocated_bytes + (d.workspace_bytes or 0)
    assert d.steady_peak_reserved_bytes is not None and d.peak_reserved_bytes is not None
    rows = _h200_rows(workload, amp, "ddp")
    assert rows
    for real in rows:
        measured = real["measured_allocated_bytes"]
        # never above the worst case beyond the 2 %: convnet's second run is 1.3 %
        # over it (its single 0.8 % over the emulator: cuDNN's workspaces at batch 16)
        assert measured <= worst * 1.02
        # convnet's first run lies 2.2 MB over its steady state, 2.6 MB under its worst
        # case (-2.03 %), its second at the worst case (-1.3 %): which of its first
        # iteration's buckets the watchdog had reaped is not recorded
        tolerance = 0.025 if workload == "convnet" else 0.02
        assert min(abs(worst - measured), abs(steady - measured)) <= tolerance * measured
        # reserved: cached segments stay, so a transient met in warm-up counts in it as well
        reserved = real["measured_reserved_bytes"]
        tolerance = 0.045 if workload == "classifier" else 0.02  # as single's, above
        assert reserved <= d.peak_reserved_bytes * (1 + tolerance)
        assert min(abs(d.peak_reserved_bytes - reserved),
                   abs(d.steady_peak_reserved_bytes - reserved)) <= tolerance * reserved


def test_the_transient_is_the_first_buckets_that_a_paused_run_never_holds() -> None:
    """A fresh rank's steps without a pause peak one bucket copy above the same steps 0.3 s
    apart (bfloat16 autocast, six steps each; the emulator's transient is that copy)."""
    for workload, rows in (("mlp", 64), ("lm", 16), ("attention", 16)):
        part = H200_MEASURED["parts"][f"rank-{workload}"]["result"]
        runs = {(r["amp"], r["pause_s"]): r for r in part["runs"]}
        fast, paused = runs[("bfloat16", 0.0)], runs[("bfloat16", 0.3)]
        step2 = fast["steps"][1]
        # the excess over the paused run's step 2, from the same bytes at the step's start
        excess = (step2["peak_bytes"] - step2["start_bytes"]) - (
            paused["steps"][1]["peak_bytes"] - paused["steps"][1]["start_bytes"])
        d = _device(_emulate(workload, rows, "bfloat16"), "ddp")
        assert d.transient_bytes == {"ddp_unreaped_buckets": sum(fast["bucket_bytes"])}
        assert sum(fast["bucket_bytes"]) == pytest.approx(excess, rel=0.01, abs=2**20)
        assert all(s["peak_bytes"] == paused["steps"][1]["peak_bytes"]
                   for s in paused["steps"][2:])  # paused: never again


def test_a_ranks_memory_outside_the_allocator_is_the_models_within_1_2_percent() -> None:
    """NVML used (the rank's process) minus reserved after six steps, float32 and bf16, five
    fresh ranks: 1,298-1,318 MiB; the model's context + NCCL (+ cuDNN's library where
    convolutions run) is within 1.2 % of each."""
    for workload in ("mlp", "lm", "attention", "convnet", "classifier"):
        part = H200_MEASURED["parts"][f"rank-{workload}"]["result"]
        ctx = device_context(H200, uses_cudnn=part["uses_conv"])
        modelled = ctx.outside_allocator_bytes + ctx.nccl_bytes
        for stage in part["stages"]:
            if stage["stage"].startswith("after_steps"):
                outside = stage["process_used_bytes"] - stage["reserved_bytes"]
                assert modelled == pytest.approx(outside, rel=0.012), (workload, stage)


def test_the_h200_rows_ddp_nvml_counted_the_benchmarks_own_context() -> None:
    """benchmarks/emulator_vs_gpu.py ran several workloads per process; each workload after
    a process's first found that process's CUDA context (its single's NVML used less its
    reserved, the run before) on the rank's GPU. Less that, every ddp row's NVML used is the
    emulator's reserved + context within 2 % (the worst case's or the steady state's, as
    above); the first workloads' rows (classifier, mlp with bf16, attention) need nothing, nor
    do the rows of a harness that runs each workload in a process of its own."""
    first = {("classifier", None), ("mlp", "bfloat16"), ("attention", None)}
    previous: dict[str, Any] | None = None
    for run in H200_ROWS:
        key = (run["workload"], run["amp"])
        real = next(row for row in run["rows"] if row["scenario"] == "ddp")
        parent = 0
        if not run.get("first_in_process", key in first):
            assert previous is not None
            single = next(row for row in previous["rows"] if row["scenario"] == "single")
            parent = single["nvml_peak_used_bytes"] - single["measured_reserved_bytes"]
        d = _device(_emulate(run["workload"], 16, run["amp"]), "ddp")
        context = d.context_bytes or 0
        totals = [d.peak_reserved_bytes + context, d.steady_peak_reserved_bytes + context]
        rank = real["nvml_peak_used_bytes"] - parent
        assert min(abs(t - rank) for t in totals) <= 0.02 * rank, key
        previous = run
