"""SyncBatchNorm under DDP: its CUDA-only ops (dpprof.emulator.sync_batch_norm) and NCCL's
all-gather into one tensor of any shape, over CPU tensors and over meta tensors. With ranks
that run the same program every rank's statistics are the same, so the synchronized
statistics are each rank's own: the losses and the gradients of a run with SyncBatchNorm
are those of the same run with BatchNorm, step after step (its backward all-reduces its
sums over the ranks: dpprof.emulator.same_program)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpprof.result import ScenarioResult
from dpprof.script.session import ScriptConfig, parse_command, run_command

SCRIPT = """
import os, torch, torch.nn as nn, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("nccl")
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                      nn.Linear(8 * 14 * 14, 10))
if {sync}:
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
model = DDP(model.cuda(), device_ids=[rank])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(3):
    x = torch.randn(16, 3, 16, 16, generator=torch.Generator().manual_seed(step)).cuda()
    loss = model(x).square().mean()
    loss.backward()
    print("grad", step, f"{{model.module[0].weight.grad.norm().item():.6f}}")
    opt.step()
    opt.zero_grad()
    print("loss", step, f"{{loss.item():.6f}}")
"""


def _run(folder: Path, sync: bool, compute: bool) -> ScenarioResult:
    script = folder / f"train_{sync}.py"
    script.write_text(SCRIPT.format(sync=sync))
    result, _ = run_command(ScriptConfig(
        launch=parse_command(["torchrun", "--nproc-per-node", "2", str(script)], 2), gpus=2,
        compute=compute, ranks="none"), alternatives=False)
    return result.scenarios[0]


pytestmark = pytest.mark.usefixtures("in_script_folder")


def test_sync_batch_norm_trains_as_batch_norm_on_equal_ranks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    losses = {}
    for sync in (False, True):
        s = _run(tmp_path, sync, compute=True)
        assert s.status == "ok", s.message
        losses[sync] = [float(line.split()[-1]) for line in capsys.readouterr().out.splitlines()
                        if line.startswith(("loss", "grad"))]
    assert len(losses[True]) >= 4
    # the same arithmetic but for its order (float32 rounding, as on a GPU); the gradients
    # through the normalisation too (its backward all-reduces sums over the ranks)
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


def test_over_meta_tensors_sync_batch_norm_costs_what_it_costs_over_cpu_tensors(
        tmp_path: Path) -> None:
    """SyncBatchNorm drops the ranks whose batch was empty by their all-gathered counts
    (``count_all[mask]``), a shape the values decide. Over meta tensors the counts are known
    (the batch's shape) though the statistics gathered with them are not, so the run goes
    on: SyncBatchNorm adds over meta tensors what it adds over CPU tensors, whose values
    are real."""
    peaks = {}
    for sync in (False, True):
        for compute in (False, True):
            s = _run(tmp_path, sync, compute)
            assert s.status == "ok", s.message
            peaks[sync, compute] = s.devices[0].peak_allocated_bytes
    added_over_cpu = peaks[True, True] - peaks[False, True]
    assert added_over_cpu > 0
    assert peaks[True, False] - peaks[False, False] == added_over_cpu
