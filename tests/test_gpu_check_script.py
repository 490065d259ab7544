"""scripts/gpu_check.sh's dry run: its plumbing (steps, timeouts, files, the summary) over the
tests' fakes, with only the ``dpprof check`` step, so it fits CI; on a GPU the script runs
every step."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_dry_run_checks_one_fake_gpu_end_to_end(tmp_path: Path) -> None:
    env = dict(os.environ, GPU_CHECK_DRY="1", GPU_CHECK_STEPS="dpprof_check",
               OUT=str(tmp_path), PYTHON=sys.executable, HARD_S="200")
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = {line.split("\t")[0]: line.split("\t")[1]
             for line in (tmp_path / "steps.tsv").read_text().splitlines()[1:]}
    assert steps["dpprof_check"] == "0", (tmp_path / "dpprof_check.err").read_text()[-3000:]
    assert steps["compare"] == "skipped"  # not asked for
    summary = {row["check"]: row for row in json.loads((tmp_path / "summary.json").read_text())}
    assert summary["dpprof check: every scenario ok"]["ok"] is True
    assert summary["dpprof check: every CUDA device matched to NVML"]["ok"] is True
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["gpu"] == "NVIDIA Fake 80GB" and report["sampler"]["tick_s"] > 0



def test_the_python_checks_import_only_names_dpprof_has() -> None:
    # The checks run only where a GPU is lent; a name that moved must fail here, on CI, not
    # first on the GPU (where it once cost the whole step of Python checks).
    text = (REPO / "scripts" / "gpu_check.sh").read_text()
    sources = re.findall(r"cat > \"\$WORK/(\w+\.py)\" <<'EOF'\n(.*?)\nEOF\n", text, re.S)
    assert {name for name, _ in sources} >= {"gpu_checks.py", "summary.py"}
    missing = []
    for name, source in sources:
        for node in ast.walk(ast.parse(source, name)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dpprof"):
                module = importlib.import_module(node.module or "")
                missing += [f"{name}: {node.module}.{a.name}" for a in node.names
                            if not hasattr(module, a.name) and not (
                                hasattr(module, "__path__")
                                and importlib.util.find_spec(f"{node.module}.{a.name}"))]
    assert not missing


def test_the_session_script_runs_its_steps_in_order_within_its_budget(tmp_path: Path) -> None:
    """scripts/gpu_session.sh, dry: the measurement first (one part here), the comparison's
    command line, then gpu_check.sh (one step here), each step's rc in steps.tsv."""
    env = dict(os.environ, GPU_SESSION_DRY="1", GPU_SESSION_PARTS="conv-split",
               GPU_CHECK_STEPS="preflight", OUT=str(tmp_path), PYTHON=sys.executable,
               BUDGET_S="200")
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_session.sh")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [line.split("\t") for line in (tmp_path / "steps.tsv").read_text().splitlines()[1:]]
    assert [(name, rc) for name, rc, _ in steps] == [
        ("measure", "0"), ("compare", "0"), ("check", "0")], steps
    measured = json.loads((tmp_path / "measure" / "measure.json").read_text())
    rows = measured["parts"]["conv-split"]["result"]["rows"]
    assert rows and all("weight_grad_workspace_bytes" in row for row in rows)
    gpu_steps = (tmp_path / "gpu" / "steps.tsv").read_text()
    assert "preflight\t" in gpu_steps and "compare\tskipped" in gpu_steps


def test_the_nccl_clique_part_runs_dry(tmp_path: Path) -> None:
    """gpu_measure.py's nccl-clique part (torch.cuda.nccl's communicator, then a process
    group's), dry: its readings up to the communicators, which need a GPU."""
    env = dict(os.environ, GPU_MEASURE_DRY="1", OUT=str(tmp_path))
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_measure.py"), "--parts",
                        "nccl-clique", "--deadline-s", "120"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    part = json.loads((tmp_path / "measure.json").read_text())["parts"]["nccl-clique"]
    assert part["ok"], part
    assert [s["stage"] for s in part["result"]["stages"]] == ["start", "context", "cublas"]
