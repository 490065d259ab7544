"""A DataParallel subclass with a forward of its own (transformer-xl's BalancedDataParallel
is copied into many repositories: fewer rows on cuda:0, its own scatter, then torch's
``replicate``, ``parallel_apply`` and ``gather``) runs under ``dpprof run`` as written: torch's
``parallel_apply`` started a thread per replica, where the emulation is not, and the run
failed ("Caught NotImplementedError in replica 0 on device 0")."""

from __future__ import annotations

from pathlib import Path

import pytest
from script_runs import run_cli
from typer.testing import CliRunner

from dpprof.cli.app import app

HEAD = """
import torch
from torch import nn
from torch.nn.parallel._functions import Scatter
from torch.nn.parallel.parallel_apply import parallel_apply

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 1000))
"""

LOOP = """
criterion = nn.CrossEntropyLoss()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(5):
    x = torch.randn(64, 256).cuda()
    y = torch.randint(0, 1000, (64,)).cuda()
    out = model(x)
    loss = criterion(out, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

# DataParallel's own forward, written out with torch's pieces (as older scripts do)
WRITTEN_OUT = HEAD + """

class SameAsTorch(nn.DataParallel):
    def forward(self, *inputs, **kwargs):
        inputs, kwargs = self.scatter(inputs, kwargs, self.device_ids)
        replicas = self.replicate(self.module, self.device_ids[:len(inputs)])
        outputs = self.parallel_apply(replicas, inputs, kwargs)
        return self.gather(outputs, self.output_device)


model = SameAsTorch(net).cuda()
""" + LOOP

PLAIN = HEAD + "\nmodel = nn.DataParallel(net).cuda()\n" + LOOP

# fewer rows on the first GPU, as BalancedDataParallel gives it
BALANCED = HEAD + """

class FewerOnFirst(nn.DataParallel):
    def __init__(self, first_rows, *args, **kwargs):
        self.first_rows = first_rows
        super().__init__(*args, **kwargs)

    def forward(self, *inputs, **kwargs):
        rows = inputs[0].size(self.dim)
        rest = rows - self.first_rows
        sizes = [self.first_rows] + [rest // (len(self.device_ids) - 1)] * (
            len(self.device_ids) - 1)
        sizes[-1] += rows - sum(sizes)
        inputs = list(zip(*[Scatter.apply(self.device_ids, sizes, self.dim, t)
                            for t in inputs]))
        replicas = self.replicate(self.module, self.device_ids)
        outputs = parallel_apply(replicas, inputs, [{{}}] * len(inputs), self.device_ids)
        return self.gather(outputs, self.output_device)


model = FewerOnFirst({first}, net, dim=0).cuda()
""" + LOOP


def _run(tmp_path: Path, name: str, source: str) -> dict:  # type: ignore[type-arg]
    return run_cli(tmp_path, name, source, gpus=4)[0]


def _scenario(result: dict, name: str) -> dict:  # type: ignore[type-arg]
    (s,) = [s for s in result["scenarios"] if s["name"] == name]
    assert s["status"] == "ok", s["message"]
    return s  # type: ignore[no-any-return]


def test_dataparallels_forward_written_out_with_torchs_pieces_peaks_as_dataparallel(
        tmp_path: Path) -> None:
    """torch's own scatter, replicate, parallel_apply and gather, called by the script's
    subclass, give every GPU the peak dpprof's re-enactment of DataParallel gives."""
    written = _scenario(_run(tmp_path, "written.py", WRITTEN_OUT), "dp-loss-primary")
    plain = _scenario(_run(tmp_path, "plain.py", PLAIN), "dp-loss-primary")
    assert [d["peak_allocated_bytes"] for d in written["devices"]] == [
        d["peak_allocated_bytes"] for d in plain["devices"]]
    assert [d["batch_rows"] for d in written["devices"]] == [16] * 4


def test_replicas_under_bf16_autocast_compute_as_torchs_threads_make_them(
        tmp_path: Path) -> None:
    """torch's parallel_apply enters autocast in each replica's thread without a dtype:
    float16 there, whatever the caller's region asked; called by a subclass as by
    DataParallel itself."""
    region = ("    with torch.autocast('cuda', dtype=torch.bfloat16):\n"
              "        out = model(x)\n")
    notes = []
    for name, source in (("written.py", WRITTEN_OUT), ("plain.py", PLAIN)):
        source = source.replace("    out = model(x)\n", region)
        notes.append([n for n in _scenario(_run(tmp_path, name, source),
                                           "dp-loss-primary")["notes"]
                      if "replicas compute in float16, not bfloat16" in n])
    assert notes[0] and notes[0] == notes[1]


@pytest.mark.parametrize("first", [4, 10])
def test_a_subclass_that_splits_the_batch_its_own_way_runs_as_written(
        tmp_path: Path, first: int) -> None:
    result = _run(tmp_path, "balanced.py", BALANCED.format(first=first))
    as_written = _scenario(result, "dp-loss-primary")
    rest = 64 - first
    assert [d["batch_rows"] for d in as_written["devices"]] == [
        first, rest // 3, rest // 3, rest - 2 * (rest // 3)]
    ddp = _scenario(result, "ddp")
    assert [d["batch_rows"] for d in ddp["devices"]] == [16] * 4
    notes = " ".join(result["notes"])
    assert "subclass FewerOnFirst splits the batch in a forward of its own" in notes
    (fix,) = [f for f in result["fixes"] if f["name"] == "ddp"]
    assert "line 29: FewerOnFirst(...) makes the DataParallel" in fix["code"], fix["code"]


def test_a_replicas_error_is_raised_as_torchs_parallel_apply_raises_it(tmp_path: Path) -> None:
    source = WRITTEN_OUT.replace("net = nn.Sequential(nn.Linear(256, 2048)",
                                 "net = nn.Sequential(nn.Linear(255, 2048)")
    script = tmp_path / "bad.py"
    script.write_text(source)
    r = CliRunner().invoke(app, ["run", "--gpus", "4", "--steps", "3", "-o",
                                 str(tmp_path / "r.json"), "--", "python", str(script)])
    assert r.exit_code != 0
    assert "Caught RuntimeError in replica 0 on device 0." in r.output
