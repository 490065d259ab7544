"""``dpprof run`` of a DDP script reports the peak a GPU reaches: over NCCL the first
iteration's buckets outlive DDP's rebuild until the process group's watchdog reaps their
all-reduce (torch's DDP over dpprof.emulator.process_group.EmulatedRankGroup, whose nccl
group keeps each all-reduce's tensors as ProcessGroupNCCL's work does), counted at the peak
with the steady state beside it; a gloo group frees them at the rebuild."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpprof.cli.app import app

SCRIPT = '''
import os
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29511")
dist.init_process_group({backend!r}, rank=0, world_size=2)
model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 100)).cuda()
ddp = DDP(model, device_ids=[0])
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
for _ in range(4):
    x, y = torch.randn(32, 64).cuda(), torch.randint(0, 100, (32,)).cuda()
    opt.zero_grad()
    nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
dist.destroy_process_group()
'''
PARAM_BYTES = (64 * 512 + 512 + 512 * 100 + 100) * 4
BUCKET_BLOCK = -(-PARAM_BYTES // 512) * 512  # the first iteration's one bucket, as allocated


def _ddp(tmp_path: Path, backend: str) -> dict[str, object]:
    script = tmp_path / f"train_{backend}.py"
    script.write_text(SCRIPT.format(backend=backend))
    out = tmp_path / f"{backend}.json"
    r = CliRunner().invoke(app, ["run", "-q", "-g", "2", "-o", str(out), "--", "python",
                                 str(script)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    (s,) = [s for s in data["scenarios"] if s["name"] == "ddp"]
    return dict(s)


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_a_ddp_scripts_peak_counts_the_first_buckets_over_nccl_only(
        tmp_path: Path, backend: str) -> None:
    s = _ddp(tmp_path, backend)
    d = s["devices"][0]
    if backend == "gloo":
        assert d["transient_bytes"] == {} and d["steady_peak_allocated_bytes"] is None
        return
    assert d["transient_bytes"] == {"ddp_unreaped_buckets": BUCKET_BLOCK}
    assert d["peak_allocated_bytes"] - d["steady_peak_allocated_bytes"] == BUCKET_BLOCK
    assert d["steady_peak_reserved_bytes"] is not None
    assert any("watchdog" in n for n in s["notes"])
