"""Re-rendering a saved result (``dpprof report``) and ``--help`` start without torch (about
two seconds of import): only the commands that measure (and ``env``, which reports torch's
build) load it, and the console script loads it for them before the command runs
(dpprof.cli.entry)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).parent / "data"

READ_ONLY = """
import sys
from typer.testing import CliRunner
from dpprof.cli.app import app
runner = CliRunner()
for args in (["--help"], ["run", "--help"], ["compare", "--help"], ["report", sys.argv[1]],
             ["report", sys.argv[1], "-o", sys.argv[2]]):
    result = runner.invoke(app, args)
    assert result.exit_code == 0, (args, result.output)
print(sorted(m for m in sys.modules if m.split(".")[0] == "torch")[:3])
"""


def test_help_and_report_never_import_torch(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", READ_ONLY, str(DATA / "emulated-lm.json"),
                           str(tmp_path / "r.html")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
    assert (tmp_path / "r.html").stat().st_size > 0


def test_a_measuring_command_has_torch_before_it_runs() -> None:
    # under the console script's own signal handlers: a Ctrl-C while torch loads ends the
    # process at once, as before any command runs
    code = ("import sys\nfrom dpprof.cli import entry, app\n"
            "app.main = lambda: print('torch' in sys.modules)\n"
            "sys.argv = ['dpprof', 'compare', '--batch', '8']\nentry.main()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
