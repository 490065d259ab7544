"""The cuda backend end to end on real GPUs: ``pytest -m gpu`` on a box with one or more.

Skipped (conftest) without a CUDA GPU; DataParallel and DDP run over one device where the
scenario allows, and only what truly needs two GPUs is also marked ``gpus2``. Each test
says what it checks; a failure message names the number that was wrong.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import dpprof
from dpprof.backends.cuda import run_local_scenario
from dpprof.backends.cuda_measure import CudaRunConfig
from dpprof.backends.cuda_oom import find_oom
from dpprof.scenarios.step import StepConfig
from dpprof.scenarios.workloads import load_workload

pytestmark = pytest.mark.gpu

DATA = Path(__file__).parent / "data"
PY = sys.executable
FAST = ["--warmup", "1", "--steps", "3"]


def _gpus() -> int:
    """Two where there are two (every part of the path), else one."""
    return min(torch.cuda.device_count(), 2)


def _dpprof(*args: str, timeout: int = 600, torchrun: int = 0) -> subprocess.CompletedProcess:
    cmd = [PY, "-m", "dpprof", *args]
    if torchrun:
        cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(torchrun), "-m", "dpprof", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ))


def test_compare_end_to_end(tmp_path: Path) -> None:
    n = _gpus()
    out = tmp_path / "run.json"
    r = _dpprof("compare", "--backend", "cuda", "-w", f"{DATA / 'gpu_workloads.py'}:wide",
                "-b", "256", "--gpus", str(n), *FAST, "-o", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["backend"] == "cuda" and data["gpus"] == n
    by = {s["name"]: s for s in data["scenarios"]}
    assert {n: s["status"] for n, s in by.items()} == dict.fromkeys(dpprof.SCENARIOS, "ok"), {
        n: s["message"] for n, s in by.items()}
    primary = by["dp-loss-primary"]["devices"]
    if n == 2:
        assert primary[0]["peak_allocated_bytes"] > primary[1]["peak_allocated_bytes"] > 0
    for s in by.values():
        assert len(s["step_times_s"]) == 3 and s["step_time_s"] > 0
        assert s["event_step_time_s"] and s["throughput_samples_per_s"] > 0
        for d in s["devices"]:
            if not d["used"]:
                continue
            assert d["allocator_stats"] and d["peak_reserved_bytes"] >= d["peak_allocated_bytes"]
            assert set(d["phase_peak_allocated_bytes"]) >= {"inputs", "forward", "backward"}
            if data["environment"]["nvml"]["available"]:
                assert d["uuid"] and d["uuid"].startswith(("GPU-", "MIG-"))
                assert d["nvml_peak_used_bytes"] and d["timeline"], d["nvml_reason"]
                assert d["nvml_unexplained_bytes"] is not None
    assert [d["rank"] for d in by["ddp"]["devices"]] == list(range(n))
    assert [d["cuda_index"] for d in by["ddp"]["devices"]] == list(range(n))
    assert by["ddp"]["stray_contexts"] == []  # every rank called set_device first
    assert data["environment"]["gpus"] and data["environment"]["nccl_version"]


def test_a_real_oom_is_a_result_and_the_memory_comes_back() -> None:
    wl = load_workload(f"{DATA / 'gpu_workloads.py'}:greedy")
    devices = list(range(_gpus()))  # DataParallel over one device gathers the 128 rows too
    cfg = CudaRunConfig(devices=devices, step=StepConfig(batch=128, warmup=1, steps=2))
    for d in devices:  # cuBLAS keeps its workspace allocated once a matmul ran: run one first
        torch.ones(8, 8, device=f"cuda:{d}") @ torch.ones(8, 8, device=f"cuda:{d}")
    before = torch.cuda.memory_allocated(0)
    r = run_local_scenario("dp-loss-primary", wl, cfg)
    assert r.status == "oom", r.message
    assert r.oom_device == 0 and r.oom_phase == "loss"
    total = torch.cuda.get_device_properties(0).total_memory
    assert r.oom_bytes and abs(r.oom_bytes - 2 * total) < 0.01 * total
    assert torch.cuda.memory_allocated(0) <= before  # released: gc, cuBLAS, empty_cache
    s = run_local_scenario("single", wl, dataclasses.replace(
        cfg, step=StepConfig(batch=64, warmup=1, steps=2)))
    assert s.status == "ok", s.message


def test_an_oom_in_warm_up_reports_its_own_peak() -> None:
    """The allocator's peaks are process-wide: a scenario that fails in its first step must
    not report the previous one's."""
    cfg = CudaRunConfig(devices=[0], step=StepConfig(batch=64, warmup=1, steps=2))
    big = run_local_scenario("single", load_workload(f"{DATA / 'gpu_workloads.py'}:wide"),
                             dataclasses.replace(cfg, step=StepConfig(batch=4096, warmup=1,
                                                                      steps=2)))
    assert big.status == "ok", big.message
    r = run_local_scenario("dp-loss-primary",
                           load_workload(f"{DATA / 'gpu_workloads.py'}:greedy"),
                           dataclasses.replace(cfg, step=StepConfig(batch=128, warmup=1,
                                                                    steps=2)))
    assert r.status == "oom" and r.oom_phase == "loss", r.message
    assert r.devices[0].peak_allocated_bytes < big.devices[0].peak_allocated_bytes / 2


def test_the_allocator_message_parses() -> None:
    with pytest.raises(torch.cuda.OutOfMemoryError) as caught:
        torch.empty(2**50, dtype=torch.uint8, device=f"cuda:{_gpus() - 1}")
    info = find_oom(str(caught.value))
    assert info is not None
    assert info.cuda_index == _gpus() - 1 and info.requested_bytes == 2**50


@pytest.mark.gpus2
def test_model_with_loss_through_real_data_parallel_uneven_shards() -> None:
    torch.manual_seed(0)
    model = nn.Linear(16, 8).cuda(0)
    x, y = torch.randn(7, 16, device="cuda:0"), torch.randint(0, 8, (7,), device="cuda:0")
    dp = nn.DataParallel(dpprof.ModelWithLoss(model, nn.functional.cross_entropy),
                         device_ids=[0, 1])
    weighted, rows = dp(x, y)  # gathered on cuda:0: one entry per replica
    assert weighted.shape == (2,) and rows.tolist() == [4.0, 3.0]
    full = nn.functional.cross_entropy(model(x), y)
    assert dpprof.ModelWithLoss.combine((weighted, rows)).item() == pytest.approx(
        full.item(), rel=1e-5)


def test_torchrun_ddp_over_nccl(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    n = _gpus()
    r = _dpprof("compare", "--scenarios", "ddp", "-w", f"{DATA / 'gpu_workloads.py'}:wide",
                "-b", "256", *FAST, "-o", str(out), torchrun=n)
    assert r.returncode == 0, r.stderr[-4000:]
    (s,) = json.loads(out.read_text())["scenarios"]
    assert s["status"] == "ok", s["message"]
    assert [(d["rank"], d["cuda_index"]) for d in s["devices"]] == [(i, i) for i in range(n)]
    assert all(d["peak_allocated_bytes"] > 0 for d in s["devices"])


@pytest.mark.gpus2
def test_a_rank_that_forgets_set_device_is_flagged(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    r = _dpprof("compare", "--backend", "cuda", "--scenarios", "ddp", "--gpus", "2",
                "-w", f"{DATA / 'gpu_workloads.py'}:careless", "-b", "64", *FAST,
                "-o", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    (s,) = data["scenarios"]
    blind = [n for n in s["notes"] if "per-process" in n or "PID namespace" in n]
    if not data["environment"]["nvml"]["available"] or blind:
        pytest.skip(f"NVML per-process usage is not available here: {blind}")
    assert any(c["rank"] == 1 and c["cuda_index"] == 0 for c in s["stray_contexts"]), s


def test_env_lists_every_gpu_with_its_uuid() -> None:
    r = _dpprof("env", "--markdown")
    assert r.returncode == 0, r.stderr
    for i in range(torch.cuda.device_count()):
        uuid = str(torch.cuda.get_device_properties(i).uuid)
        assert uuid in r.stdout
