"""CUDA work on a thread the script starts (a loader wrapper that moves each batch to the GPU
in the background) is outside the emulation, which follows the thread the script runs on:
the report says so, with the line, instead of presenting figures low by those tensors as
complete. DataLoader's own pin-memory thread copies nothing to a GPU, and says nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpprof.script.session import ScriptConfig, parse_command, run_command

SCRIPT = """
import queue
import threading

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

data = TensorDataset(torch.randn(1024, 512), torch.randint(0, 100, (1024,)))
loader = DataLoader(data, batch_size=256, pin_memory=True, num_workers=0)


def in_background(batches):
    q = queue.Queue(maxsize=2)

    def run():
        for x, y in batches:
            q.put((x.cuda(non_blocking=True), y.cuda(non_blocking=True)))
        q.put(None)

    threading.Thread(target=run, daemon=True).start()
    while (item := q.get()) is not None:
        yield item


def on_this_thread(batches):
    for x, y in batches:
        yield x.cuda(non_blocking=True), y.cuda(non_blocking=True)


model = nn.DataParallel(nn.Sequential(nn.Linear(512, 1024), nn.ReLU(),
                                      nn.Linear(1024, 100)).cuda())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
crit = nn.CrossEntropyLoss()
for x, y in {feed}(loader):
    loss = crit(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.parametrize("feed", ["in_background", "on_this_thread"])
def test_gpu_copies_on_a_thread_of_the_scripts_are_said_to_be_uncounted(
        tmp_path: Path, feed: str) -> None:
    script = tmp_path / "train.py"
    source = SCRIPT.format(feed=feed)
    script.write_text(source)
    line = next(i for i, text in enumerate(source.splitlines(), 1) if "q.put((x.cuda" in text)
    result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(script)], 2),
                                         steps=3), alternatives=False)
    (scenario,) = result.scenarios
    assert scenario.status == "ok", scenario.message
    said = [n for n in scenario.notes if "on a thread of its own" in n]
    if feed == "in_background":
        (note,) = said
        assert f"{script}:{line}" in note and "not counted" in note
    else:
        assert not said
