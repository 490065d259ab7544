"""The DDP change of a project whose model is wrapped in one file and whose batches are loaded
in another, as most projects are laid out (a ``models.py`` wraps the model, ``train.py`` makes
the DataLoaders; pix2pixHD's ``models/models.py`` and ``data/custom_dataset_data_loader.py``,
torchreid's ``scripts/main.py`` and ``torchreid/data/datamanager.py``).

There was no diff ("the DataLoader made at train.py:11 (a file other than model_lib.py, where
the DataParallel is made) ...: give its batch_size // 2 there by hand"). Now one diff changes
every file, the process group started at the launched script's start (the loaders'
DistributedSampler needs it before the model exists), the files named from the folder that
holds them all. Held to what the user does with it: ``patch -p0`` in a copy of the project,
then ``dpprof run -- torchrun --nproc-per-node 2 <script>``, which must peak on each rank as
the fix promised, to the byte; an evaluation's loader (iterated without gradients, or never
and not shuffled) keeps every rank evaluating all of it, the training loader is sharded."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from dpprof.cli.app import app

MODEL = """
import torch
from torch import nn


def make_model():
    net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 100))
    return nn.DataParallel(net).cuda()
"""

LOADING = """
import torch
from torch.utils.data import DataLoader, TensorDataset


def loaders(batch_size):
    train = TensorDataset(torch.randn(1024, 64), torch.randint(0, 100, (1024,)))
    val = TensorDataset(torch.randn(256, 64), torch.randint(0, 100, (256,)))
    return (DataLoader(train, batch_size=batch_size, shuffle=True),
            DataLoader(val, batch_size=batch_size, shuffle=False))
"""

LOOP = """
criterion = nn.CrossEntropyLoss()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step, (x, y) in enumerate(train_loader):
    x, y = x.to(device), y.to(device)
    loss = criterion(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == 0:  # a validation pass after the first step
        with torch.no_grad():
            seen = sum(len(v) for v, _ in val_loader)
        print("validated", seen)
"""

# layout -> {file: text}, the launched script
LAYOUTS: dict[str, tuple[dict[str, str], str]] = {
    # the model wrapped in a file of its own, the data loaded in the script
    "model_file": ({"model_lib.py": MODEL, "train.py": """
import torch
from torch import nn

from model_lib import make_model
from loading import loaders

device = torch.device("cuda:0")
train_loader, val_loader = loaders(128)
model = make_model()
""" + LOOP, "loading.py": LOADING}, "train.py"),
    # three folders, as pix2pixHD's: the loaders made before the model
    "packages": ({"models/__init__.py": "", "models/net.py": MODEL,
                  "data/__init__.py": "", "data/loading.py": LOADING, "train.py": """
import torch
from torch import nn

from data.loading import loaders
from models.net import make_model


def main():
    device = "cuda:0"
    train_loader, val_loader = loaders(128)
    model = make_model()
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in train_loader:
        x, y = x.to(device), y.to(device)
        loss = criterion(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
"""}, "train.py"),
    # the script in a folder of its own beside the package, as torchreid's scripts/main.py
    "script_folder": ({"pkg/__init__.py": "", "pkg/loading.py": LOADING, "scripts/train.py": """
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch
from torch import nn

from pkg.loading import loaders

device = torch.device("cuda:0")
train_loader, val_loader = loaders(128)
model = nn.DataParallel(nn.Sequential(nn.Linear(64, 512), nn.ReLU(),
                                      nn.Linear(512, 100))).cuda()
""" + LOOP}, "scripts/train.py"),
}


def _run(command: list[str], out: Path) -> dict[str, Any]:
    r = CliRunner().invoke(app, ["run", "--gpus", "2", "-q", "--ranks", "none", "-o", str(out),
                                 "--", *command])
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text())  # type: ignore[no-any-return]


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs patch(1)")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_project_s_ddp_change_spans_its_files_and_peaks_as_promised(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    files, script = LAYOUTS[layout]
    project, fixed = tmp_path / "project", tmp_path / "fixed"
    for name, text in files.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text)
    shutil.copytree(project, fixed)
    monkeypatch.chdir(project / Path(script).parent)
    result = _run(["python", str(project / script)], tmp_path / "as_written.json")
    fix = {f["name"]: f for f in result["fixes"]}["ddp"]
    code = fix["code"]
    named = [line[4:].partition(" (as written)")[0] for line in code.splitlines()
             if line.startswith("--- ")]
    assert len(named) >= 2, code  # one diff, every file it changes
    root = project if layout == "script_folder" else project / Path(script).parent
    assert all((root / name).is_file() for name in named), (named, code)
    if layout == "script_folder":
        assert f"the files are named from {project}: apply the diff with `patch -p0` there" \
            in code, code

    diff = "\n".join(line for line in code.splitlines() if not line.startswith("# "))
    done = subprocess.run(["patch", "-p0"], cwd=fixed, input=diff + "\n", text=True,
                          capture_output=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    loading = next(text for name, text in ((n, (fixed / n).read_text()) for n in named)
                   if "DataLoader(" in text)
    assert "DataLoader(train, batch_size=batch_size // 2, sampler=DistributedSampler(" \
        in loading, loading
    # the evaluation's loader: every rank evaluates all of it
    assert "DataLoader(val, batch_size=batch_size // 2, shuffle=False)" in loading, loading

    # in a process of its own, as the user runs it: this one holds the project's modules
    # from outside the script's folder (scripts/train.py's pkg), which dpprof keeps loaded
    # between its runs of one command
    out = tmp_path / "patched.json"
    done = subprocess.run([sys.executable, "-m", "dpprof", "run", "--gpus", "2", "-q",
                           "--ranks", "none", "-o", str(out), "--", "torchrun",
                           "--nproc-per-node", "2", str(fixed / script)],
                          cwd=fixed / Path(script).parent, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    again = json.loads(out.read_text())
    ran = again["scenarios"][0]
    assert (ran["name"], ran["status"]) == ("ddp", "ok"), ran
    peaks = [d["peak_allocated_bytes"] for d in ran["devices"]]
    assert peaks == [fix["primary_peak_bytes"]] * 2 == [fix["max_peak_bytes"]] * 2, (
        peaks, fix["primary_peak_bytes"])
