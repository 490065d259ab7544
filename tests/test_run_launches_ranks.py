"""A script that starts its DDP ranks itself, as processes of its own (Ultralytics'
``model.train(device=[0, 1])`` runs ``python -m torch.distributed.run ... _temp.py``): the
ranks run outside dpprof's process, where torch finds no GPU, and the script fails. The
line says so and what to run instead, not only "failed before it put anything on a GPU"."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpprof.cli.app import app

PARENT = """
    import subprocess
    import sys

    # the trainer writes its rank's script and launches it, as Ultralytics does
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                    "rank.py"], check=True)
"""

RANK = """
    import torch

    torch.zeros(1, device="cuda")  # a real process: no GPU here
"""


@pytest.mark.slow  # the launcher and its rank are real Python processes importing torch
def test_a_script_that_starts_its_ranks_itself_is_told_what_to_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(textwrap.dedent(PARENT))
    (tmp_path / "rank.py").write_text(textwrap.dedent(RANK))
    r = CliRunner().invoke(app, ["run", "--gpus", "2", "--", "python", "train.py"])
    assert r.exit_code == 1, r.output
    line = " ".join(r.stderr.split())
    assert "before it put anything on a GPU" in line
    assert ("it started its ranks itself, as processes of their own (torch.distributed.run)"
            in line), line
    assert "dpprof run --gpus N -- torchrun --nproc-per-node N script.py" in line
