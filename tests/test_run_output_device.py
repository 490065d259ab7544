"""DataParallel gathering its outputs on another GPU than its first (``output_device=k``):
the script puts its targets there (``.cuda(k)``, ``"cuda:k"``, ``torch.device("cuda", k)``)
and computes its loss on cuda:k. Under DDP there is no gather: a rank's outputs are on its
own GPU, and so must its targets be. The DDP alternative takes cuda:k for the rank's own GPU
wherever the script's lines name it (before, it failed: "Expected all tensors to be on the
same device"), and the diff rewrites those lines so: applied with ``patch`` and run under
torchrun, every rank peaks where the alternative promised, to the byte."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_run_diffs import _run, launcher, undefined_names
from test_script_rewrite import apply_diff

SCRIPT = """
import torch
from torch import nn

B = 96
OUT = {device}
net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 512)).cuda()
model = nn.DataParallel(net, output_device={k})
criterion = nn.CrossEntropyLoss(weight=torch.ones(512).to({k}))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    x = torch.randn(B, 64).cuda()
    y = {targets}
    out = model(x)
    loss = criterion(out, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

# the ways a script names cuda:k for its targets
TARGETS = {
    "cuda_k": ('"unused"', "torch.randint(0, 512, (B,)).cuda({k})"),
    "string": ('"cuda:{k}"', "torch.randint(0, 512, (B,), device=OUT)"),
    "device": ('torch.device("cuda", {k})', "torch.randint(0, 512, (B,)).to(OUT)"),
}


@pytest.mark.parametrize(("k", "named"), [(1, "cuda_k"), (3, "string"), (1, "device")])
def test_ddp_of_a_gather_on_another_gpu_puts_the_targets_on_the_ranks_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, k: int, named: str) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    device, targets = TARGETS[named]
    script = tmp_path / "train.py"
    original = SCRIPT.format(k=k, device=device.format(k=k), targets=targets.format(k=k))
    script.write_text(original)
    monkeypatch.chdir(tmp_path)
    result = _run(["--", "python", "train.py"], tmp_path / "r.json")
    ddp = next(s for s in result["scenarios"] if s["name"] == "ddp")
    assert ddp["status"] == "ok", ddp["message"]
    fix = next(f for f in result["fixes"] if f["name"] == "ddp")
    code = fix["code"]
    assert f"cuda:{k}" in code and "by hand" not in code, code
    patched = apply_diff(original, code)
    assert "output_device" not in patched
    assert f"cuda:{k}" not in patched and f".cuda({k})" not in patched
    assert f".to({k})" not in patched and f'"cuda", {k})' not in patched
    assert undefined_names(patched) == []
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    (fixed / "train.py").write_text(patched)
    monkeypatch.chdir(fixed)
    again = _run(["--", *launcher(code, "train.py")], tmp_path / "again.json")
    ran = again["scenarios"][0]
    assert ran["name"] == "ddp" and ran["status"] == "ok", ran
    peaks = [d["peak_allocated_bytes"] for d in ran["devices"]]
    assert peaks[0] == fix["primary_peak_bytes"], (peaks, fix["primary_peak_bytes"])
    assert max(peaks) == fix["max_peak_bytes"], (peaks, fix["max_peak_bytes"])


BY_HAND = """
import torch
from torch import nn

B = 96
net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 512)).cuda()
model = nn.DataParallel(net, output_device=1)
criterion = nn.CrossEntropyLoss()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gathered_on = 1
for step in range(4):
    x = torch.randn(B, 64).cuda()
    y = torch.randint(0, 512, (B,)).to(f"cuda:{gathered_on}")
    loss = criterion(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_gpu_named_in_a_way_no_rewrite_reaches_is_left_by_hand(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda:k from an f-string: the alternative still runs the targets on the rank's GPU,
    and the diff names the line to change by hand."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    (tmp_path / "train.py").write_text(BY_HAND)
    monkeypatch.chdir(tmp_path)
    result = _run(["--", "python", "train.py"], tmp_path / "r.json")
    ddp = next(s for s in result["scenarios"] if s["name"] == "ddp")
    assert ddp["status"] == "ok", ddp["message"]
    code = next(f for f in result["fixes"] if f["name"] == "ddp")["code"]
    assert "line 13 names cuda:1, DataParallel's output_device, another way" in " ".join(
        code.split()), code
