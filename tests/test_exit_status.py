"""One exit-status policy (dpprof.errors) for every command, and the option bounds."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from dpprof.cli.app import app
from dpprof.errors import (
    ENV_EXIT_STATUS_HELP,
    EXIT_STATUS_HELP,
    MAXBATCH_EXIT_STATUS_HELP,
    REPORT_EXIT_STATUS_HELP,
    RUN_EXIT_STATUS_HELP,
    WATCH_EXIT_STATUS_HELP,
    run_exit_status,
)
from dpprof.result import STATUS_ERROR, STATUS_OK, DeviceResult, RunResult, ScenarioResult

runner = CliRunner()

WORKLOADS = '''
import sys
import torch
import dpprof

class Boom(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        raise RuntimeError("boom in forward")

def _batch(n, device):
    return torch.randn(n, 4, device=device), torch.randn(n, 4, device=device)

def boom():
    return dpprof.Workload(model=Boom, batch=_batch, loss=torch.nn.MSELoss(), name="boom")

def exits():
    sys.exit(0)

class Quits(Boom):
    def forward(self, x):
        sys.exit(0)

def quits():
    return dpprof.Workload(model=Quits, batch=_batch, loss=torch.nn.MSELoss(), name="quits")
'''


@pytest.fixture
def wl_file(tmp_path: Path) -> Path:
    f = tmp_path / "wl.py"
    f.write_text(WORKLOADS)
    return f


def test_a_scenario_that_errors_exits_1_and_still_writes_the_report(
        wl_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    r = runner.invoke(app, ["compare", "-w", f"{wl_file}:boom", "-b", "4", "-s", "single",
                            "--no-fixes", "-o", str(out)])
    assert r.exit_code == 1, r.output
    assert "1 scenario(s) errored: single" in r.output and "Traceback" not in r.output
    assert out.exists()  # the error is a result: the report says what went wrong


@pytest.mark.parametrize("fn", ["exits", "quits"])
def test_a_workload_that_calls_sys_exit_0_is_not_success(wl_file: Path, fn: str) -> None:
    r = runner.invoke(app, ["compare", "-w", f"{wl_file}:{fn}", "-b", "4", "-s", "single",
                            "--no-fixes", "-o", str(wl_file.parent / "r.json")])
    assert r.exit_code == 1, r.output
    assert "sys.exit(0)" in r.output and "nothing was measured" in r.output
    assert "Traceback" not in r.output


def test_run_exit_status_counts_errors_and_empty_runs() -> None:
    ok = ScenarioResult("single", STATUS_OK, devices=[DeviceResult(index=0)])
    bad = ScenarioResult("ddp", STATUS_ERROR, message="rank 1 failed")
    base = {"backend": "emulated", "workload": "x", "batch": 1, "gpus": 1,
            "gpu_memory_bytes": 1}
    assert run_exit_status(RunResult(**base, scenarios=[ok])) == 0
    assert run_exit_status(RunResult(**base, scenarios=[ok, bad])) == 1
    assert run_exit_status(RunResult(**base, scenarios=[])) == 1
    no_devices = ScenarioResult("single", STATUS_OK)
    assert run_exit_status(RunResult(**base, scenarios=[no_devices])) == 1


EPILOGS = {"compare": EXIT_STATUS_HELP, "maxbatch": MAXBATCH_EXIT_STATUS_HELP,
           "run": RUN_EXIT_STATUS_HELP, "report": REPORT_EXIT_STATUS_HELP,
           "env": ENV_EXIT_STATUS_HELP, "watch": WATCH_EXIT_STATUS_HELP}


@pytest.mark.parametrize("command", list(EPILOGS))
def test_every_command_documents_its_own_exit_statuses(command: str) -> None:
    r = runner.invoke(app, [command, "--help"], terminal_width=200)
    assert r.exit_code == 0
    text = " ".join(r.output.split())
    assert " ".join(EPILOGS[command].replace("`", "").split()) in text
    # the epilog names only options this command has (no --fail-on-* under maxbatch)
    epilog = text[text.index("Exit status:"):]
    own = {o for p in typer.main.get_command(app).commands[command].params  # type: ignore[attr-defined]
           for o in (*p.opts, *p.secondary_opts)}
    for named in re.findall(r"--[a-z][a-z-]*\*?", epilog):
        assert any(o.startswith(named.rstrip("*")) if named.endswith("*") else o == named
                   for o in own), f"{command}'s epilog names {named}"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--batch", "9223372036854775808"], "--batch 9223372036854775808: out of range"),
        (["--gpus", "10000"], "--gpus 10000: out of range; give a number from 1 to 64"),
        (["--nvml-interval", "nan"], "--nvml-interval nan: give a finite number"),
        (["--ddp-timeout", "inf"], "--ddp-timeout inf: give a finite number"),
        (["--fail-on-imbalance", "nan"], "--fail-on-imbalance nan: give a finite number"),
        (["--bucket-cap-mb", "nan"], "--bucket-cap-mb"),
        (["--seed", "-1"], "--seed -1: out of range"),
        (["--warmup", "100000"], "--warmup 100000: out of range"),
        (["--gpu-memory", "9999999TiB"], "more than 1 PiB per GPU"),
        (["-s", "ddp,single,ddp"], "ddp given more than once"),
        (["-o", "adir.html/"], "names a directory"),
        (["-o", "run.json", "-o", "run.json"], "given twice"),
        (["-o", ""], "--output is empty"),
    ],
)
def test_option_bounds_are_usage_errors(args: list[str], needle: str, tmp_path: Path) -> None:
    r = runner.invoke(app, ["compare", "-w", "mlp", "-b", "4", *args])
    assert r.exit_code == 2, r.output
    assert needle in r.output and "Traceback" not in r.output
    assert not (Path.cwd() / "adir.html").exists()


def test_maxbatch_bounds() -> None:
    r = runner.invoke(app, ["maxbatch", "-w", "mlp", "--gpus", "100000"])
    assert r.exit_code == 2 and "--gpus 100000: out of range" in r.output


def test_maxbatch_exits_1_when_the_step_raises(wl_file: Path) -> None:
    r = runner.invoke(app, ["maxbatch", "-w", f"{wl_file}:boom", "-s", "single", "--gpus", "2"])
    assert r.exit_code == 1, r.output
    assert "scenario(s) errored: single" in r.output and "Traceback" not in r.output


@pytest.mark.slow
def test_a_gloo_rank_that_raises_reports_the_users_line(wl_file: Path, tmp_path: Path) -> None:
    """compare --backend cpu: ddp runs as gloo processes; the rank's error names the line of
    the workload file that raised, as the emulated scenarios do, in every report."""
    line = WORKLOADS.splitlines().index('        raise RuntimeError("boom in forward")') + 1
    site = f"wl.py:{line} in forward"
    outs = [tmp_path / f"run.{ext}" for ext in ("json", "md", "html")]
    r = runner.invoke(app, ["compare", "-w", f"{wl_file}:boom", "-b", "4", "-g", "2",
                            "-s", "ddp", "--backend", "cpu", "--no-fixes",
                            *[a for o in outs for a in ("-o", str(o))]])
    assert r.exit_code == 1, r.output
    assert "1 scenario(s) errored: ddp" in r.output and "Traceback" not in r.output
    # The terminal folds long lines, inside a long path too (pytest-xdist's tmp folders)
    assert site.replace(" ", "") in "".join(r.output.split()), r.output
    for out in outs:
        assert site in out.read_text(encoding="utf-8"), out.name


def test_help_piped_into_head_ends_without_a_traceback() -> None:
    # `dpprof compare --help | head -3`: the reader goes away mid-help
    env = dict(os.environ, COLUMNS="80")
    p = subprocess.Popen([sys.executable, "-m", "dpprof", "compare", "--help"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.readline()
    p.stdout.close()  # as head does after its lines
    err = p.stderr.read().decode()
    p.wait(timeout=60)
    assert "Traceback" not in err, err[-2000:]
