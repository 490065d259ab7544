"""The command line, as a user runs it (typer's CliRunner), and every bad input."""

import json
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from dpprof import __version__
from dpprof.cli.app import app

runner = CliRunner()

FAST = ["-w", "mlp", "-b", "8"]


def test_version() -> None:
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and __version__ in r.stdout


def test_compare_writes_html_and_json_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["compare", *FAST])
    assert r.exit_code == 0, r.output
    # the default target is the catalog's A100 80GB as CUDA reports it (79.25 GiB)
    assert "no CUDA GPUs found: emulating 4 devices of 79.2 GiB" in r.stderr
    said = next(line for line in r.stderr.splitlines() if "no CUDA GPUs found" in line)
    assert said.endswith("workload mlp, batch 8")  # one line, however wide, as in a log
    assert "dp-loss-primary" in r.stdout and "cuda:3" in r.stdout
    files = sorted(p.name for p in (tmp_path / "dpprof-reports").iterdir())
    assert len(files) == 2 and files[0].startswith("compare-") and files[0].endswith(".html")
    assert files[1].endswith(".json")
    data = json.loads((tmp_path / "dpprof-reports" / files[1]).read_text())
    assert data["schema_version"] == 1 and data["batch"] == 8 and data["gpus"] == 4
    assert [s["name"] for s in data["scenarios"]] == [
        "dp-loss-primary", "dp-loss-forward", "ddp", "single"]
    assert f"wrote dpprof-reports/{files[0]}" in r.stdout


def test_compare_options(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    r = runner.invoke(app, ["compare", *FAST, "-g", "2", "--gpu-memory", "40GB",
                            "--scenarios", "dp-loss-primary,single", "-o", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    assert r.stdout == ""
    data = json.loads(out.read_text())
    assert data["gpus"] == 2 and data["gpu_memory_bytes"] == 40 * 10**9
    assert [s["name"] for s in data["scenarios"]] == ["dp-loss-primary", "single"]
    assert "primary_excess_bytes" in data["comparison"]["scenarios"]["dp-loss-primary"]


def test_report_rerenders_a_saved_result(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    assert runner.invoke(app, ["compare", *FAST, "-o", str(out), "-q"]).exit_code == 0
    html = tmp_path / "again.html"
    r = runner.invoke(app, ["report", str(out), "-o", str(html)])
    assert r.exit_code == 0, r.output
    assert "<!DOCTYPE html>" in html.read_text()
    r = runner.invoke(app, ["report", str(out)])
    assert r.exit_code == 0 and "dp-loss-primary" in r.stdout


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["-b", "0"], 2, "--batch must be a positive"),
        (["-b", "-3"], 2, "--batch must be a positive"),
        (["-b", "many"], 2, "Invalid value"),
        (["-g", "0"], 2, "--gpus must be at least 1"),
        (["-w", "nosuch"], 2, "built-ins are lm, mlp, convnet, classifier"),
        (["-w", "no_such_module_xyz:fn"], 2, "no module named 'no_such_module_xyz'"),
        (["-w", "missing/file.py:fn"], 2, "no such file"),
        (["--gpu-memory", "lots"], 2, "e.g. 80GiB"),
        (["--scenarios", "dp,single"], 2, "choose from dp-loss-primary"),
        (["--backend", "tpu"], 2, "unknown backend"),
        (["-o", "out.pdf"], 2, "unknown format .pdf"),
    ],
)
def test_bad_input_is_one_line_and_a_usage_exit(args: list[str], code: int, needle: str) -> None:
    r = runner.invoke(app, ["compare", *FAST, *args])
    assert r.exit_code == code, r.output
    assert needle in r.output
    assert "Traceback" not in r.output


def test_user_workload_errors(tmp_path: Path) -> None:
    f = tmp_path / "wl.py"
    f.write_text(
        "import dpprof\n"
        "def raises():\n    raise ValueError('bad config')\n"
        "def wrong():\n    return 42\n"
        "def malformed():\n    return dpprof.Workload(model=1, batch=2, loss=3)\n"
    )
    cases = {
        "raises": "raises() raised ValueError: bad config",
        "wrong": "returned int, not a dpprof.Workload",
        "malformed": "'model' must be callable",
        "absent": "has no function 'absent'",
    }
    for fn, needle in cases.items():
        r = runner.invoke(app, ["compare", "-w", f"{f}:{fn}", "-b", "8"])
        assert r.exit_code == 2, r.output
        assert needle in r.output and "Traceback" not in r.output


def test_unwritable_output_fails_before_running(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = runner.invoke(app, ["compare", *FAST, "-o", str(blocker / "sub" / "run.json")])
    assert r.exit_code == 2
    assert "cannot write reports" in r.output and "Traceback" not in r.output


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    f = tmp_path / "wl.py"
    f.write_text("def raises():\n    raise ValueError('bad config')\n")
    r = runner.invoke(app, ["compare", "-w", f"{f}:raises", "--debug"])
    assert r.exit_code == 2 and "Traceback" in r.output


def test_report_rejects_files_that_are_not_results(tmp_path: Path) -> None:
    cases = {
        "missing.json": (None, "no such file"),
        "text.json": ("not json", "not JSON"),
        "other.json": ('{"a": 1}', "not a dpprof result"),
        "newer.json": ('{"schema_version": 99, "scenarios": []}', "newer than this dpprof"),
    }
    for name, (content, needle) in cases.items():
        p = tmp_path / name
        if content is not None:
            p.write_text(content)
        r = runner.invoke(app, ["report", str(p)])
        assert r.exit_code == 1, r.output
        assert needle in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("command", [["compare", *FAST], ["maxbatch", "-w", "mlp"]])
def test_a_bare_number_for_memory_is_refused_with_the_fix(command: list[str]) -> None:
    """--gpu-memory 80 read as 80 bytes made every scenario "OOM" with exit status 0."""
    r = runner.invoke(app, [*command, "--gpu-memory", "80"])
    assert r.exit_code == 2, r.output
    assert "--gpu-memory 80: a size needs its unit; write 80GiB" in r.output


def _help_lines(command: str) -> list[str]:
    r = runner.invoke(app, [command, "--help"], terminal_width=80, env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    return r.output.splitlines()


@pytest.mark.parametrize("command", ["compare", "maxbatch", "run", "report", "watch", "env"])
def test_help_at_80_columns_shows_every_option_whole_and_explained(command: str) -> None:
    lines = _help_lines(command)
    text = "\n".join(lines)
    assert all(len(line) <= 80 for line in lines)
    params = typer.main.get_command(app).commands[command].params  # type: ignore[attr-defined]
    for p in params:
        if p.param_type_name != "option":
            continue
        assert p.help, f"{command} {p.opts[0]} has no help"
        for name in (*p.opts, *p.secondary_opts):
            assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), (command, name)


def test_compare_help_groups_its_options() -> None:
    text = "\n".join(_help_lines("compare"))
    panels = re.findall(r"╭─ (.+?) ─", text)
    assert panels == ["Options", "Workload", "GPUs", "Measurement", "DDP", "Output and CI"]
    assert text.index("--bucket-cap-mb") > text.index("╭─ DDP")


@pytest.mark.parametrize(("args", "needle"), [
    (["compare", "-b", "many"], "Invalid value for '--batch' / '-b'"),
    (["compare", "--no-such-option"], "No such option: --no-such-option"),
    (["nosuchcommand"], "No such command 'nosuchcommand'"),
])
def test_parse_errors_are_one_line(args: list[str], needle: str) -> None:
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("dpprof: error: "), r.output
    assert needle in lines[0] and "--help" in lines[0]
    assert "╭" not in r.output


@pytest.mark.parametrize(("args", "needle"), [
    (["--devices", "0,1"], "--devices 0,1: picks real CUDA GPUs, but the emulated backend"),
    (["--compute-capability", "99.9"], "--compute-capability 99.9: no GPU has it"),
    (["--compute-capability", "0.1"], "--compute-capability 0.1: no GPU has it"),
    (["--gpu", ""], "'--gpu': empty; give a GPU from the catalog"),
    (["--gpu", "  "], "'--gpu': empty; give a GPU from the catalog"),
])
def test_options_that_cannot_apply_are_refused(args: list[str], needle: str) -> None:
    r = runner.invoke(app, ["compare", *FAST, "--backend", "emulated", *args])
    assert r.exit_code == 2, r.output
    assert needle in r.output and "Traceback" not in r.output


def test_report_of_a_rendered_report_names_the_json(tmp_path: Path) -> None:
    (tmp_path / "r.json").write_text("{}")
    (tmp_path / "r.md").write_text("## dpprof\n")
    (tmp_path / "other.html").write_text("<html></html>")
    r = runner.invoke(app, ["report", str(tmp_path / "r.md")])
    assert r.exit_code == 2 and f"pass {tmp_path / 'r.json'}" in r.output, r.output
    r = runner.invoke(app, ["report", str(tmp_path / "other.html")])
    assert r.exit_code == 2 and "pass the .json written beside it" in r.output, r.output


CHDIR = '''
import os
import torch
import dpprof

def _batch(n, device):
    return torch.randn(n, 4, device=device), torch.randn(n, 4, device=device)

def _model():
    os.chdir(os.environ["DPPROF_TEST_ELSEWHERE"])  # as a workload that sets up its data dir
    return torch.nn.Linear(4, 4)

def wl():
    return dpprof.Workload(model=_model, batch=_batch, loss=torch.nn.MSELoss(), name="cd")
'''


@pytest.mark.parametrize("output", [["-o", "out/run.json"], []])
def test_relative_reports_go_where_the_command_ran(
        output: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A workload that changes directory does not send the reports there."""
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    (here / "wl.py").write_text(CHDIR)
    monkeypatch.chdir(here)
    monkeypatch.setenv("DPPROF_TEST_ELSEWHERE", str(elsewhere))
    r = runner.invoke(app, ["compare", "-w", "wl.py:wl", "-b", "4", "-s", "single",
                            "--no-fixes", *output])
    assert r.exit_code == 0, r.output
    assert list(elsewhere.iterdir()) == []
    written = sorted(p.relative_to(here).as_posix() for p in here.rglob("*.json"))
    assert written and all(p.startswith(("out/", "dpprof-reports/")) for p in written)
    assert f"wrote {written[0]}" in r.output  # shown as given, not made absolute


def test_nothing_measured_leaves_no_empty_report_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "wl.py").write_text("def wl():\n    raise ValueError('bad config')\n")
    r = runner.invoke(app, ["compare", "-w", "wl.py:wl", "-b", "4"])
    assert r.exit_code == 2, r.output
    r = runner.invoke(app, ["compare", "-w", "wl.py:wl", "-b", "4", "-o", "a/b/run.json"])
    assert r.exit_code == 2, r.output
    assert list(tmp_path.iterdir()) == [tmp_path / "wl.py"]


BASE_EXCEPTIONS = '''
import torch
import dpprof

class Stop(BaseException):
    pass

def _batch(n, device):
    return torch.randn(n, 4, device=device), torch.randn(n, 4, device=device)

class Stops(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        raise Stop("in forward")

def at_load():
    raise Stop("at load")

def in_forward():
    return dpprof.Workload(model=Stops, batch=_batch, loss=torch.nn.MSELoss(), name="stops")

def not_a_module():
    return dpprof.Workload(model=lambda: 42, batch=_batch, loss=torch.nn.MSELoss(), name="nm")
'''


@pytest.mark.parametrize(("fn", "code", "needle"), [
    ("at_load", 2, "workload 'wl.py:at_load': raised Stop: at load"),
    ("in_forward", 1, "the workload raised Stop: in forward, a BaseException that is not an "
                      "Exception"),
    ("not_a_module", 2, "model() returned int, not an nn.Module"),
])
def test_a_workload_raising_a_base_exception_or_returning_no_module_is_one_line(
        fn: str, code: int, needle: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "wl.py").write_text(BASE_EXCEPTIONS)
    r = runner.invoke(app, ["compare", "-w", f"wl.py:{fn}", "-b", "4", "-s", "single",
                            "--no-fixes", "-o", "r.json"])
    assert r.exit_code == code, r.output
    assert needle in " ".join(r.output.split())
    assert "Traceback" not in r.output and "internal error" not in r.output
    assert not isinstance(r.exception, BaseException) or isinstance(r.exception, SystemExit)


def test_maxbatch_shows_its_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from rich.console import Console

    from dpprof.cli import maxbatch

    screen = io.StringIO()
    monkeypatch.setattr(maxbatch, "err", Console(file=screen, force_terminal=True, width=80))
    r = runner.invoke(app, ["maxbatch", "-w", "mlp", "-g", "2", "-s", "single,ddp"])
    assert r.exit_code == 0, r.output
    shown = screen.getvalue()
    assert "searching single" in shown and "searching ddp" in shown
    assert "scenarios" in shown
