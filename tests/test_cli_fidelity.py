"""The command-line options of issue 3: DDP options, precision, target GPU, cpu backend."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpprof.cli.app import app

runner = CliRunner()
FAST = ["-w", "mlp", "-b", "8", "-q"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--bucket-cap-mb", "0"], "--bucket-cap-mb must be a positive"),
        (["--dtype", "float64"], "--dtype 'float64': choose from float32, bfloat16, float16"),
        (["--amp", "float32"], "--amp 'float32': choose from bfloat16, float16"),
        (["--compute-capability", "zz9000"], "--compute-capability 'zz9000'"),
        (["--backend", "gpu"], "unknown backend 'gpu'"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(args: list[str], needle: str) -> None:
    r = runner.invoke(app, ["compare", *FAST, *args])
    assert r.exit_code == 2, r.output
    assert needle in r.output and "Traceback" not in r.output


def test_options_reach_the_result(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    r = runner.invoke(app, ["compare", *FAST, "--scenarios", "ddp", "--bucket-cap-mb", "2",
                            "--gradient-as-bucket-view", "--amp", "bfloat16",
                            "--compute-capability", "9.0", "-o", str(out)])
    assert r.exit_code == 0, r.output
    run = json.loads(out.read_text())
    assert run["config"]["bucket_cap_mb"] == 2 and run["config"]["gradient_as_bucket_view"]
    assert run["config"]["amp"] == "bfloat16"
    d = run["scenarios"][0]["devices"][0]
    # two 32 MiB cuBLAS workspaces and cuBLASLt's 1 MiB on sm90, as an H100 allocated them
    assert d["workspace_bytes"] == 2 * 32 * 2**20 + 2**20
    assert d["peak_reserved_bytes"] >= d["peak_allocated_bytes"]
    assert any("autocast" in a for a in run["assumptions"])


@pytest.mark.slow
def test_cpu_backend_runs_ddp_as_gloo_processes(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    r = runner.invoke(app, ["compare", "-w", "mlp", "-b", "4", "-g", "2", "-q", "--backend",
                            "cpu", "--scenarios", "ddp,single", "-o", str(out)])
    assert r.exit_code == 0, r.output
    run = json.loads(out.read_text())
    assert run["backend"] == "cpu"
    ddp, single = run["scenarios"]
    assert ddp["status"] == "ok" and [d["rank"] for d in ddp["devices"]] == [0, 1]
    assert all(d["peak_requested_bytes"] > 0 for d in ddp["devices"])
    assert ddp["loss"] is not None and single["loss"] is not None
