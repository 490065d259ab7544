"""The DDP alternative builds its rank where the script wraps its model, as the DDP fix writes
``DDP(<module>.cuda(rank), device_ids=[rank])`` there: DDP's broadcast and buckets before the
batches. It had built the rank at the wrapper's first forward, after the first batch, and for
VGG-11 the caching allocator's segments then came out otherwise: 4,120,903,680 B reserved a
rank where the fix, applied and run, reserves 4,655,677,440 B (allocated alike). Now the fix
applied peaks as the alternative promised, reserved memory too, to the byte."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest
from script_runs import peaks, run_report

from dpprof.script.ddp_rank import built_at_the_wrap

VGG = '''\
import torch
import torch.nn as nn
import torchvision

model = torchvision.models.vgg11()
model = nn.DataParallel(model).cuda()
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
for step in range(3):
    images = torch.randn(32, 3, 224, 224).cuda()
    target = torch.randint(0, 1000, (32,)).cuda()
    loss = criterion(model(images), target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''




@pytest.mark.slow
def test_the_ddp_fix_applied_reserves_what_the_alternative_promised(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.zoo import torchvision_importable

    torchvision_importable()  # the script imports it in dpprof's process
    pytest.importorskip("torchvision")  # the zoo extra
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    (tmp_path / "train.py").write_text(VGG)
    monkeypatch.chdir(tmp_path)
    result = run_report(["python", "train.py"], tmp_path / "dp.json", ("--gpus", "2"))
    alternative = {s["name"]: s for s in result["scenarios"]}["ddp"]
    diff = {f["name"]: f["code"] for f in result["fixes"]}["ddp"]
    subprocess.run(["patch", "-p0", "-s"], input=diff, text=True, check=True, cwd=tmp_path)
    fixed = run_report(["torchrun", "--nproc-per-node", "2", "train.py"], tmp_path / "ddp.json")
    (ran,) = fixed["scenarios"]
    assert [d["batch_rows"] for d in ran["devices"]] == [16, 16]
    assert peaks(ran) == peaks(alternative)  # reserved memory too


def _site(tmp_path: Path, source: str, text: str) -> str:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(source))
    line = next(i for i, s in enumerate(path.read_text().splitlines(), 1) if text in s)
    return f"{path}:{line}"


@pytest.mark.parametrize(("source", "at_wrap"), [
    ("model = nn.DataParallel(model).cuda()\n", True),
    ("net: nn.Module = DataParallel(net)\n", True),
    ("if gpus > 1: model = nn.DataParallel(model)\n", True),
    ("model.features = nn.DataParallel(model.features)\n", False),  # a part of a model
    ("self.encoder = nn.DataParallel(encoder)\n", False),
    ("models = [nn.DataParallel(m) for m in nets]\n", True),  # each a model it calls
    ("return nn.DataParallel(model)\n", False),
])
def test_the_rank_is_built_at_a_wrap_bound_to_a_name(tmp_path: Path, source: str,
                                                      at_wrap: bool) -> None:
    assert built_at_the_wrap(_site(tmp_path, source, "DataParallel(")) is at_wrap


def test_a_wrap_whose_line_cannot_be_read_waits_for_its_forward(tmp_path: Path) -> None:
    assert not built_at_the_wrap("?")
    assert not built_at_the_wrap(f"{tmp_path / 'gone.py'}:3")
