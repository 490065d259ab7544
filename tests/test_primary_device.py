"""DataParallel whose first device is not cuda:0 (``device_ids=[1, 2, 3]``): the GPU that
gathers, holds the master parameters and the reduced gradients is cuda:1, and every report
names it so, in the verdict, the tables' headings, the causes and the advice."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpprof.cli.app import app

SCRIPT = """
import torch, torch.nn as nn
model = nn.DataParallel(nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 10))
                        .to("cuda:1"), device_ids=[1, 2, 3])
opt = torch.optim.Adam(model.parameters())
for _ in range(3):
    x = torch.randn(96, 512, device="cuda:1")
    nn.functional.cross_entropy(model(x), torch.randint(0, 10, (96,), device="cuda:1")).backward()
    opt.step()
    opt.zero_grad()
"""


def test_the_reports_name_dataparallels_first_device(in_script_folder: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    tmp_path = in_script_folder
    monkeypatch.setenv("COLUMNS", "120")
    (tmp_path / "train.py").write_text(SCRIPT)
    r = CliRunner().invoke(app, ["run", "--gpus", "4", "--no-alternatives", "--", "python",
                                 "train.py"])
    assert r.exit_code == 0, r.output
    out = " ".join(r.stdout.split())
    assert "cuda:1 needs" in out and "cuda:1 excess" in out
    assert "why cuda:1 is heavier under dp-loss-primary" in out
    assert "optimizer state on cuda:1 only" in out
    assert "cuda:0 excess" not in out and "cuda:0 needs" not in out
    saved = next((tmp_path / "dpprof-reports").glob("run-*.json"))
    md = tmp_path / "run.md"
    assert CliRunner().invoke(app, ["report", str(saved), "-o", str(md)]).exit_code == 0
    text = md.read_text()
    assert "### cuda:1's excess by cause" in text and "| cuda:1 excess |" in text
    assert "cuda:0's excess" not in text
    page = tmp_path / "run.html"
    assert CliRunner().invoke(app, ["report", str(saved), "-o", str(page)]).exit_code == 0
    html = page.read_text()
    assert "Why cuda:1 is heavier" in html and "cuda:1 excess</th>" in html
    assert "Why cuda:0" not in html and "cuda:0 excess" not in html
    diffed = tmp_path / "diff.md"
    assert CliRunner().invoke(app, ["report", str(saved), str(saved), "-o",
                                    str(diffed)]).exit_code == 0
    assert "*cuda:1 excess*" in diffed.read_text()
