"""The command line, as a user runs it (typer's CliRunner), and every bad input."""

import json
from pathlib import Path

import pytest
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
    assert "no CUDA GPUs found: emulating 4 devices of 80.0 GiB" in r.stderr
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
