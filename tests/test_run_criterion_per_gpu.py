"""The criterion applied on each GPU by a DataParallel subclass around it (PyTorch-Encoding's
``DataParallelModel``/``DataParallelCriterion`` pair, copied into CCNet, OCNet, DANet, CE2P
and more to keep the loss off cuda:0): ``dpprof run`` failed at the first loss, the
criterion's threads finding no virtual GPU. Now the script is measured as what it is, the
loss computed on each GPU (``dp-loss-forward``), and its DDP alternative runs: no DDP around
the criterion (DDP refuses a module without parameters), each rank's loss on its own outputs,
peaking as the DDP script written by hand, to the byte; the DDP change says to unwrap it."""

from __future__ import annotations

from pathlib import Path

import pytest
from script_runs import beside_by_hand, peaks, run_report

SCRIPT = Path(__file__).parent / "scripts" / "dp_criterion_per_gpu.py"
WRITTEN = ("model = OutputsPerGpu(model)\n"
           "criterion = CriterionPerGpu(nn.CrossEntropyLoss(ignore_index=255))\n"
           "rows = 16\n")
BY_HAND = ('import os\nimport torch.distributed as dist\n'
           'rank = int(os.environ["LOCAL_RANK"])\ndist.init_process_group("nccl")\n'
           'torch.cuda.set_device(rank)\n'
           'model = nn.parallel.DistributedDataParallel(model.cuda(rank), device_ids=[rank])\n'
           'criterion = nn.CrossEntropyLoss(ignore_index=255)\n'
           'rows = 16 // dist.get_world_size()\n')
LOSS = "loss = criterion(outputs, target)"
LOSS_BY_HAND = "loss = criterion(*outputs, target)"


def test_the_loss_on_each_gpu_is_measured_and_its_ddp_rank_peaks_as_by_hand(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    beside_by_hand(tmp_path, SCRIPT, (WRITTEN, BY_HAND), (LOSS, LOSS_BY_HAND))
    monkeypatch.chdir(tmp_path)
    result = run_report(["python", SCRIPT.name], tmp_path / "dp.json", ("--gpus", "2"))
    scenarios = {s["name"]: s for s in result["scenarios"]}
    assert set(scenarios) == {"dp-loss-forward", "ddp"}, [
        (s["name"], s["status"], s["message"]) for s in result["scenarios"]]
    written = scenarios["dp-loss-forward"]
    # each GPU computes the loss of its half: log_softmax of [8, 21, 96, 96] float32 on each
    log_softmax_bytes = 8 * 21 * 96 * 96 * 4
    assert all(d["peak_allocated_bytes"] > 2 * log_softmax_bytes for d in written["devices"])
    ddp = scenarios["ddp"]
    assert ddp["status"] == "ok", ddp["message"]
    assert any("CriterionPerGpu wraps CrossEntropyLoss, which has no parameters: no DDP "
               "around it" in n and "CrossEntropyLoss(*outputs, *targets)" in n
               for n in ddp["notes"]), ddp["notes"]
    by_hand = run_report(["torchrun", "--nproc-per-node", "2", "by_hand.py"],
                         tmp_path / "ddp.json")
    (ran,) = by_hand["scenarios"]
    assert [d["batch_rows"] for d in ran["devices"]] == [8] * 2
    assert peaks(ddp) == peaks(ran)
    fixes = {f["name"]: f["code"] for f in result["fixes"]}
    assert ("CriterionPerGpu wraps CrossEntropyLoss" in fixes["ddp"]
            and fixes["ddp"].endswith("unwrap it and compute the loss so")), fixes["ddp"]
