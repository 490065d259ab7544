"""A module's conversions after DDP has wrapped it, on virtual GPUs: ``model.to(device)``,
``.cuda()`` and ``.to(dtype)`` that leave every parameter where and as it is do nothing, as on
a GPU, and ``.half()`` converts the parameters in place (their ``.data``), as torch does on a
GPU. The emulator had swapped every parameter (``torch.utils.swap_tensors``, needed to move a
CPU parameter onto a virtual GPU), and a swap of a parameter DDP's reducer holds fails:
"_apply(): Couldn't swap Conv2d.weight" (VainF's DeepLabV3Plus-Pytorch, fixed to DDP, calls
``model.to(device)`` after the wrap). The optimizer built before the move keeps the module's
parameters throughout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpprof.cli.app import app

SCRIPT = '''\
import os
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))  # its own, beside its children's
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8))

    def forward(self, x):
        return self.body(x) * self.scale.view(1, -1, 1, 1)


net = Net()
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)  # before the move
model = DDP(net.cuda(rank), device_ids=[rank])
first = [id(p) for p in net.parameters()]
model.to(torch.device("cuda"))
model.cuda()
model.to(dtype=torch.float32)
assert [id(p) for p in net.parameters()] == first
assert all(a is b for a, b in zip(optimizer.param_groups[0]["params"], net.parameters()))
for _ in range(3):
    optimizer.zero_grad()
    model(torch.randn(4, 3, 16, 16).cuda()).sum().backward()
    optimizer.step()
model.half()
assert [id(p) for p in net.parameters()] == first
assert {p.dtype for p in net.parameters()} == {torch.float16}
assert {p.device for p in net.parameters()} == {torch.device("cuda", rank)}
'''


def test_conversions_after_ddp_run_as_on_a_gpu(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    (tmp_path / "train.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["run", "-o", str(tmp_path / "r.json"), "--", "torchrun",
                                 "--nproc-per-node", "2", "train.py"])
    assert r.exit_code == 0, r.output
    (ddp,) = json.loads((tmp_path / "r.json").read_text())["scenarios"]
    assert ddp["status"] == "ok", ddp
