"""What the commands print, as a user sees it: ``--help`` without a type on flags, one line
per command in ``dpprof --help``, piped output at ``COLUMNS`` or 80 columns."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from reports_data import SAVED
from typer.testing import CliRunner

from dpprof.cli.app import app
from dpprof.cli.common import PIPED_WIDTH, output_width

COMMANDS = ("compare", "maxbatch", "watch", "run", "report", "env", "check")


def _help(*args: str) -> str:
    r = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "120", "NO_COLOR": "1"})
    assert r.exit_code == 0, r.output
    return r.output


@pytest.mark.parametrize("command", ("", *COMMANDS))
def test_help_shows_no_type_on_a_flag(command: str) -> None:
    """A flag takes no value: ``--help`` showed ``<bool>`` beside every one, and
    ``<list[str]>`` beside ``-o``."""
    text = _help(*([command] if command else []))
    assert "<bool>" not in text
    assert "<list[str]>" not in [w for line in text.splitlines() if "--output" in line
                                 for w in line.split()]
    if command in ("compare", "maxbatch", "run", "report", "watch", "check"):
        line = next(line for line in text.splitlines() if "--output" in line)
        assert "FILE" in line, line


def test_each_command_is_one_line_in_the_overview() -> None:
    """``check``'s summary took seven lines of ``dpprof --help``."""
    text = _help()
    box = text[text.index("Commands"):]
    rows = [line.strip("│ ").rstrip() for line in box.splitlines()[1:]]
    rows = rows[:next(i for i, r in enumerate(rows) if r.startswith("╰"))]
    assert [r.split()[0] for r in rows] == list(COMMANDS), rows


def test_piped_output_takes_columns_or_80() -> None:
    assert output_width({}, tty=False) == PIPED_WIDTH == 80
    assert output_width({"COLUMNS": "132"}, tty=False) == 132
    assert output_width({}, tty=True) is None  # a terminal: rich asks it


def _report(columns: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns is not None:
        env["COLUMNS"] = columns
    r = subprocess.run([sys.executable, "-m", "dpprof", "report", str(SAVED["emulated-lm"])],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_piped_report_is_80_columns_unless_columns_says_otherwise() -> None:
    """Piped, the output was 140 columns whatever the terminal."""
    text = _report(None)
    widths = [len(line.rstrip()) for line in text.splitlines()]
    assert max(widths) <= 80 and max(widths) > 60
    wide = _report("150")
    assert max(len(line.rstrip()) for line in wide.splitlines()) > 80
    assert re.search(r"cuda:0 +cuda:1 +cuda:2 +cuda:3", wide)
