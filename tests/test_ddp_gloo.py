"""The ddp path for real over gloo on CPU: dpprof's own spawned ranks, torchrun on one node,
and torchrun as two "nodes" on localhost. The code is the cuda backend's, on the tests' CPU
host (``fake_cuda.CpuHost``, installed in the child processes by ``tests/fakehost``): only
the process group backend (gloo, not NCCL) and the device (cpu, not cuda) differ."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import fake_cuda
import pytest

from dpprof.pipeline import CompareConfig, run_compare
from dpprof.scenarios.step import StepConfig

DATA = Path(__file__).parent / "data"
TINY = f"{DATA / 'ddp_workloads.py'}:tiny"
PY = sys.executable

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPPROF_TEST_")}
    env.update(extra)
    return fake_cuda.fakehost_env(gpus=2, base=env)


def test_every_scenario_runs_with_ddp_ranks_spawned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPPROF_TEST_OOM_ROWS", "4")  # inherited by the spawned ranks
    fake_cuda.install(monkeypatch, gpus=2)  # here and in the spawned ranks
    cfg = CompareConfig(
        workload=TINY, gpus=2, backend="cuda", ddp_timeout_s=60,
        step=StepConfig(batch=8, warmup=1, steps=2),
    )
    run = run_compare(cfg)
    assert run is not None
    data = json.loads(run.to_json())
    status = {s["name"]: s["status"] for s in data["scenarios"]}
    # the full batch OOMs in DataParallel's forward; a 4-row shard fits: ddp and single run
    assert status == {"dp-loss-primary": "oom", "dp-loss-forward": "oom", "ddp": "ok",
                      "single": "ok"}
    ddp = data["scenarios"][2]
    assert [d["rank"] for d in ddp["devices"]] == [0, 1]
    assert len(ddp["step_times_s"]) == 2 and ddp["throughput_samples_per_s"] > 0
    assert data["config"]["warmup_steps"] == 1 and data["environment"]["nvml"]


def _check_torchrun_report(path: Path, nodes: set[int]) -> None:
    data = json.loads(path.read_text())
    assert data["config"]["torchrun"] is True and data["gpus"] == 2
    (ddp,) = data["scenarios"]
    assert ddp["name"] == "ddp" and ddp["status"] == "ok", ddp["message"]
    assert [d["rank"] for d in ddp["devices"]] == [0, 1]
    assert {d["node_rank"] for d in ddp["devices"]} == nodes
    assert all(d["node"] for d in ddp["devices"]) and ddp["loss"] is not None


@pytest.mark.torchrun
def test_torchrun_standalone_a_rank_out_of_memory_is_reported_by_rank_0(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    r = subprocess.run(
        [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "dpprof", "compare", "--scenarios", "ddp", "-w", TINY,
         "-b", "8", "--warmup", "1", "--steps", "2", "-o", str(out), "-q"],
        env=_env(DPPROF_TEST_OOM_RANK="1"), capture_output=True, text=True, timeout=300,
    )
    # an OOM is a result: every rank exits 0, rank 0 writes the report, nothing hangs
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    (s,) = data["scenarios"]
    assert s["status"] == "oom" and s["oom_device"] == 1 and s["oom_phase"] == "forward"
    assert s["oom_bytes"] == int(2.5 * 2**30)
    assert s["message"].startswith("rank 1: out of memory")
    assert "OutOfMemoryError" in s["traceback"] and "ddp_workloads.py" in s["traceback"]
    assert "rank 1 failed first" in s["notes"]
    assert [d["rank"] for d in s["devices"]] == [0, 1]


@pytest.mark.torchrun
def test_torchrun_two_nodes_on_localhost(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    port = _free_port()
    procs = [
        subprocess.Popen(
            [PY, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--node-rank", str(node), "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "dpprof-test",
             "-m", "dpprof", "compare", "--scenarios", "ddp", "-w", TINY,
             "-b", "8", "--warmup", "1", "--steps", "2", "-o", str(out), "-q"],
            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for node in (0, 1)
    ]
    try:
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-3000:]
    _check_torchrun_report(out, {0, 1})
