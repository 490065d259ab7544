"""DataParallel around a part of the model (``model.features = nn.DataParallel(model.features)``,
pytorch/examples' ImageNet script for VGG and AlexNet). The DDP alternative had wrapped the
part alone in DDP: the rest of the model's gradients were never all-reduced (each rank would
train its own classifier), and the rank's peak left out their buckets (on the ImageNet script
with VGG-11, 2.50 GB a rank where its own DDP path, the whole model wrapped, peaks at
3.49 GB). Now the rank's DDP wraps the whole model: its peak is the DDP script's written by
hand, to the byte; the loss-inside-forward alternative and the DDP diff say why they are none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from script_runs import beside_by_hand, peaks, run_report
from torch import nn

from dpprof.script.part_of_model import whole_model

SCRIPT = Path(__file__).parent / "scripts" / "dp_part_of_model.py"
# the same model as a DDP script wraps it: whole, where it is built
BY_HAND = ('import os\nimport torch.distributed as dist\n'
           'rank = int(os.environ["LOCAL_RANK"])\ndist.init_process_group("nccl")\n'
           'torch.cuda.set_device(rank)\n'
           'model = nn.parallel.DistributedDataParallel(model.cuda(rank), device_ids=[rank])\n'
           'rows = 32 // dist.get_world_size()\n')
WRITTEN = "model.features = nn.DataParallel(model.features)\nmodel.cuda()\nrows = 32\n"


def test_the_ddp_rank_wraps_the_whole_model_and_peaks_as_the_ddp_script_by_hand(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    beside_by_hand(tmp_path, SCRIPT, (WRITTEN, BY_HAND))
    monkeypatch.chdir(tmp_path)
    result = run_report(["python", SCRIPT.name], tmp_path / "dp.json", ("--gpus", "4"))
    scenarios = {s["name"]: s for s in result["scenarios"]}
    assert set(scenarios) == {"dp-loss-primary", "ddp"}
    ddp = scenarios["ddp"]
    assert any("DataParallel wraps a part of the model (Net's features): the rank's DDP wraps "
               "the whole model" in n for n in ddp["notes"]), ddp["notes"]
    by_hand = run_report(["torchrun", "--nproc-per-node", "4", "by_hand.py"], tmp_path / "ddp.json")
    (ran,) = by_hand["scenarios"]
    assert [d["batch_rows"] for d in ran["devices"]] == [8] * 4
    assert peaks(ddp) == peaks(ran)
    # the classifier's gradients in the rank's buckets: the part's alone are far fewer
    classifier_bytes = (64 * 8 * 8 * 2048 + 2048 + 2048 * 100 + 100) * 4
    assert ddp["devices"][0]["peak_allocated_bytes"] > (
        scenarios["dp-loss-primary"]["devices"][1]["peak_allocated_bytes"]
        + 3 * classifier_bytes)
    fixes = {f["name"]: f["code"] for f in result["fixes"]}
    assert fixes["ddp"].startswith(
        "# no rewrite of the script's lines: dp_part_of_model.py:24: DataParallel wraps a part "
        "of the model (Net's features), which the model's own forward calls: DDP wraps the "
        "whole model instead"), fixes["ddp"]
    assert "no loss-inside-forward alternative: DataParallel wraps a part of the model " \
           "(Net's features)" in " ".join(result["notes"])


class Pair(nn.Module):
    """A GAN's module holding both networks, each wrapped: nothing trained outside them."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.DataParallel(nn.Linear(2, 2))
        self.d = nn.DataParallel(nn.Linear(2, 1))
        self.head = nn.Linear(1, 1)

    def forward(self, x: Any) -> Any:
        return whole_model(self.g), whole_model(self.d)


def test_the_whole_model_is_the_outermost_holder_with_parameters_of_its_own() -> None:
    pair = Pair()
    found_g, found_d = pair(None)
    assert found_g is not None and (found_g.model, found_g.name) == (pair, "g")
    assert found_d is not None and (found_d.model, found_d.name) == (pair, "d")
    pair.head.requires_grad_(False)  # every trained parameter inside a DataParallel
    assert pair(None) == (None, None)
    assert whole_model(pair.g) is None  # called by the script itself
