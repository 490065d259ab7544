"""The DDP alternative builds its rank where the script wraps its model, as the DDP fix writes
``DDP(<module>.cuda(rank), device_ids=[rank])`` there: DDP's broadcast and buckets before the
batches. It had built the rank at the wrapper's first forward, after the first batch, and for
VGG-11 the caching allocator's segments then came out otherwise: 4,120,903,680 B reserved a
rank where the fix, applied and run, reserves 4,655,677,440 B (allocated alike). Now the fix
applied peaks as the alternative promised, reserved memory too, to the byte; and so does the
DDP script by hand of a DataParallel around a part of the model (``model.features =
nn.DataParallel(model.features)``), whose rank is built where the wrapper is set into the
model, around the whole of it."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest
from script_runs import peaks, run_report
from torch import nn

from dpprof.script.ddp_rank import built_at_the_wrap

VGG = '''\
import torch
import torch.nn as nn
import torchvision

model = torchvision.models.vgg11()
{wrap}
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




WHOLE = "model = nn.DataParallel(model).cuda()"
PART = "model.features = nn.DataParallel(model.features)\nmodel.cuda()"
# the DDP script by hand of either: the whole model wrapped where it is built
BY_HAND = ("import os\nimport torch.distributed as dist\ndist.init_process_group(\"nccl\")\n"
           "rank = int(os.environ[\"LOCAL_RANK\"])\ntorch.cuda.set_device(rank)\n"
           "model = nn.parallel.DistributedDataParallel(model.cuda(rank), device_ids=[rank])")


@pytest.mark.slow
@pytest.mark.parametrize("wrap", [WHOLE, PART])
def test_the_ddp_fix_applied_reserves_what_the_alternative_promised(
        wrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.zoo import torchvision_importable

    torchvision_importable()  # the script imports it in dpprof's process
    pytest.importorskip("torchvision")  # the zoo extra
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    (tmp_path / "train.py").write_text(VGG.format(wrap=wrap))
    monkeypatch.chdir(tmp_path)
    result = run_report(["python", "train.py"], tmp_path / "dp.json", ("--gpus", "2"))
    alternative = {s["name"]: s for s in result["scenarios"]}["ddp"]
    if wrap == WHOLE:  # dpprof's own diff, applied
        diff = {f["name"]: f["code"] for f in result["fixes"]}["ddp"]
        subprocess.run(["patch", "-p0", "-s"], input=diff, text=True, check=True, cwd=tmp_path)
    else:  # by hand, as its fix says: the whole model in DDP, each rank its half batch
        (tmp_path / "train.py").write_text(VGG.format(wrap=BY_HAND).replace("32, 3", "16, 3")
                                           .replace("(32,)", "(16,)"))
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
    # an attribute's owner is read in the script's running frame: none here, so no model
    assert built_at_the_wrap(_site(tmp_path, source, "DataParallel("), nn.Linear(2, 2)) is at_wrap


def test_a_wrap_whose_line_cannot_be_read_waits_for_its_forward(tmp_path: Path) -> None:
    assert not built_at_the_wrap("?", nn.Linear(2, 2))
    assert not built_at_the_wrap(f"{tmp_path / 'gone.py'}:3", nn.Linear(2, 2))
