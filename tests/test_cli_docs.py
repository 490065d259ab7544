"""Each command's ``--help`` ends with the page that documents it, and that page exists and
speaks of the command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from dpprof.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
runner = CliRunner()


def test_there_are_commands_to_check() -> None:
    assert {"compare", "run", "maxbatch", "watch", "report", "env", "check"} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_points_to_the_commands_page(command: str) -> None:
    r = runner.invoke(app, [command, "--help"], terminal_width=100, env={"COLUMNS": "100"})
    assert r.exit_code == 0, r.output
    found = re.findall(r"Docs: (docs/[\w-]+\.md)\b", r.output)
    assert len(found) == 1, f"dpprof {command} --help names no page:\n{r.output}"
    page = ROOT / found[0]
    assert page.is_file(), f"dpprof {command} --help names {found[0]}, which does not exist"
    assert f"dpprof {command}" in page.read_text(encoding="utf-8"), (
        f"{found[0]} never mentions dpprof {command}")


def test_dpprofs_own_help_points_to_the_readme_and_the_pages() -> None:
    r = runner.invoke(app, ["--help"], terminal_width=100, env={"COLUMNS": "100"})
    assert r.exit_code == 0, r.output
    assert "Docs: README.md and docs/" in r.output
