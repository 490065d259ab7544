"""The loss inside forward where a model file makes the DataParallel (``build_model()``
returns ``nn.DataParallel(net)``) and the training script calls it and computes the loss.
Before, the fix had no diff ("the wrap, the model's call and the loss are in different
files"). Now the training file alone changes: ModelWithLoss is set inside the DataParallel
it holds, as its module, once it has the model and the loss (after the loss's definition
where that comes later); applied with ``patch`` and run, the script peaks on every GPU where
the alternative promised, to the byte, and the model file is left as written. Where the model
comes into a function as its argument, the diff is a reason: by hand."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from test_run_diffs import _run, undefined_names
from test_script_rewrite import apply_diff

MODELS = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 512))

    def forward(self, x):
        return self.body(x).view(-1, 4, 128)


def build_model():
    net = Net().cuda()
    return nn.DataParallel(net)
"""

TRAIN = """
import torch
import torch.nn.functional as F
from torch import nn

from models import build_model

B = 96
{before}
model = build_model()
{after}
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    x = torch.randn(B, 64).cuda()
    y = torch.randint(0, 128, (B, 4)).cuda()
    {loss}
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

CALL = "out = model(x)\n    "
# (lines before the model's binding, lines after it, the step's forward and loss)
FORMS = {
    # the loss module defined after the model: the new line comes after both
    "module_after": ("", "criterion = nn.CrossEntropyLoss()",
                     CALL + "loss = criterion(out.transpose(1, 2), y)"),
    # a function of torch's, bound before the model
    "function_before": ("criterion = F.cross_entropy", "",
                        CALL + "loss = criterion(out.transpose(1, 2), y)"),
    # the loss on a view of the outputs (an LM's): a function of the outputs and targets
    "view": ("", "criterion = nn.CrossEntropyLoss(label_smoothing=0.1)",
             CALL + "loss = criterion(out.view(-1, 128), y.view(-1))"),
    # the same with the model's call inside the loss's: the model's name read from the call
    "view_inline": ("", "criterion = nn.CrossEntropyLoss()",
                    "loss = criterion(model(x).view(-1, 128), y.view(-1))"),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_model_files_wrap_gets_the_loss_inside_forward_from_the_training_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    before, after, loss = FORMS[form]
    train = TRAIN.format(before=before, after=after, loss=loss)
    (tmp_path / "models.py").write_text(MODELS)
    (tmp_path / "train.py").write_text(train)
    monkeypatch.chdir(tmp_path)
    result = _run(["--", "python", "train.py"], tmp_path / "r.json")
    fix = next(f for f in result["fixes"] if f["name"] == "loss-in-forward")
    code = fix["code"]
    assert code.startswith("--- train.py (as written)\n+++ train.py ("), code
    assert "models.py (as written)" not in code and "model.module = dpprof.ModelWithLoss(" \
        "model.module, " in code, code
    patched = apply_diff(train, code)
    assert undefined_names(patched) == []
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    (fixed / "models.py").write_text(MODELS)
    if shutil.which("patch"):  # as a user applies it
        (fixed / "train.py").write_text(train)
        diff = "\n".join(line for line in code.splitlines() if not line.startswith("# "))
        done = subprocess.run(["patch", "-s", "train.py"], cwd=fixed, input=diff + "\n",
                              text=True, capture_output=True, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        assert (fixed / "train.py").read_text() == patched
    (fixed / "train.py").write_text(patched)
    monkeypatch.chdir(fixed)
    again = _run(["--", "python", "train.py"], tmp_path / "again.json")
    ran = again["scenarios"][0]
    assert ran["name"] == "dp-loss-forward" and ran["status"] == "ok", ran
    peaks = [d["peak_allocated_bytes"] for d in ran["devices"]]
    assert peaks[0] == fix["primary_peak_bytes"], (peaks, fix["primary_peak_bytes"])
    assert max(peaks) == fix["max_peak_bytes"], (peaks, fix["max_peak_bytes"])
    assert (fixed / "models.py").read_text() == MODELS


IN_A_FUNCTION = """
import torch
from torch import nn

from models import build_model


def train(model, steps):
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x = torch.randn(96, 64).cuda()
        y = torch.randint(0, 128, (96, 4)).cuda()
        out = model(x)
        loss = criterion(out.transpose(1, 2), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


train(build_model(), 4)
"""


def test_a_model_given_to_the_training_function_is_changed_by_hand(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    (tmp_path / "models.py").write_text(MODELS)
    (tmp_path / "train.py").write_text(IN_A_FUNCTION)
    monkeypatch.chdir(tmp_path)
    result = _run(["--", "python", "train.py"], tmp_path / "r.json")
    alt = next(s for s in result["scenarios"] if s["name"] == "dp-loss-forward")
    assert alt["status"] == "ok", alt
    code = next(f for f in result["fixes"] if f["name"] == "loss-in-forward")["code"]
    assert not code.startswith("---"), code
    words = " ".join(code.split())
    assert "`model` comes into train() as an argument (line 8)" in words, code
    assert "model.module = dpprof.ModelWithLoss(model.module, <loss>)` by hand" in words
