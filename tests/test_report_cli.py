"""-o x.md in compare and report; reports written atomically."""

import os
from pathlib import Path

import pytest
from reports_data import SAVED
from typer.testing import CliRunner

from dpprof.cli.app import app

runner = CliRunner()


def test_compare_writes_markdown(tmp_path: Path) -> None:
    out = tmp_path / "issue.md"
    r = runner.invoke(app, ["compare", "-w", "mlp", "-b", "8", "-o", str(out), "-q"])
    assert r.exit_code == 0, r.output
    text = out.read_text()
    assert text.startswith("## dpprof: mlp, batch 8, 4 GPUs (emulated)")
    assert "```mermaid\n%%{init: " in text and "\nxychart-beta\n" in text and "<details><summary>Environment" in text


@pytest.mark.parametrize("suffix", [".md", ".html", ".json"])
def test_report_rerenders_every_format(tmp_path: Path, suffix: str) -> None:
    out = tmp_path / f"r{suffix}"
    r = runner.invoke(app, ["report", str(SAVED["synthetic-oom"]), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert out.stat().st_size > 1000
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no temporary file left


def test_report_that_cannot_be_written_leaves_the_old_file(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    out = tmp_path / "r.md"
    out.write_text("old")

    def boom(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    r = runner.invoke(app, ["report", str(SAVED["emulated-lm"]), "-o", str(out)])
    assert r.exit_code == 1 and "No space left on device" in r.output
    assert out.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["r.md"]
