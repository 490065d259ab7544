"""GPU work on threads the script starts, as ``dpprof run`` measures it: counted as the
script's own thread's work. A criterion applied on each GPU in a thread of its own (the
pattern of PyTorch-Encoding's ``DataParallelCriterion``, copied into many segmentation
repositories to keep the loss off cuda:0) failed at its first loss ("Could not run
'aten::empty_strided' with arguments from the 'CUDA' backend"); a loader that moves each
batch to the GPU in the background went uncounted, said so in a note. Now both are measured:
the threaded criterion's figures are those of the same criterion applied one GPU after the
other on the script's thread, to the byte."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dpprof.script.session import ScriptConfig, parse_command, run_command

LOADER = """
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

CRITERION_ON_EACH_GPU = """
import threading

import torch
from torch import nn


class OutputsPerGpu(nn.DataParallel):
    # the replicas' outputs stay on their GPUs, for a criterion applied on each
    def gather(self, outputs, output_device):
        return outputs


crit = nn.CrossEntropyLoss()


def loss_on_each_gpu(outputs, target):
    targets = target.chunk(len(outputs))
    losses = [None] * len(outputs)

    def one(i):
        device = outputs[i].device
        with torch.cuda.device(device):
            losses[i] = crit(outputs[i], targets[i].to(device))

    {apply}
    return sum(loss.to("cuda:0") for loss in losses) / len(losses)


model = OutputsPerGpu(nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(),
                                    nn.Conv2d(64, 21, 1)).cuda())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    image = torch.randn(16, 3, 128, 128).cuda()
    target = torch.randint(0, 21, (16, 128, 128)).cuda()
    loss = loss_on_each_gpu(model(image), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
IN_THREADS = """threads = [threading.Thread(target=one, args=(i,)) for i in range(len(outputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()"""
ONE_AFTER_THE_OTHER = """for i in range(len(outputs)):
        one(i)"""


def _run(tmp_path: Path, name: str, source: str, gpus: int) -> Any:
    script = tmp_path / name
    script.write_text(source)
    result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(script)], gpus),
                                         steps=3), alternatives=False)
    (scenario,) = result.scenarios
    assert scenario.status == "ok", scenario.message
    return scenario


def _peaks(scenario: Any) -> list[tuple[int, int | None]]:
    return [(d.peak_allocated_bytes, d.peak_reserved_bytes) for d in scenario.devices]


def test_a_criterion_on_each_gpu_in_threads_counts_as_one_gpu_after_the_other(
        tmp_path: Path) -> None:
    threaded = _run(tmp_path, "threads.py",
                    CRITERION_ON_EACH_GPU.replace("{apply}", IN_THREADS), 2)
    in_turn = _run(tmp_path, "in_turn.py",
                   CRITERION_ON_EACH_GPU.replace("{apply}", ONE_AFTER_THE_OTHER), 2)
    assert _peaks(threaded) == _peaks(in_turn)
    # the loss's temporaries on each GPU, not all on cuda:0: log_softmax of each replica's
    # [8, 21, 128, 128] float32 logits (11 MiB) on its own GPU
    log_softmax_bytes = 8 * 21 * 128 * 128 * 4
    assert all(d.peak_allocated_bytes > log_softmax_bytes for d in threaded.devices)
    assert not [n for n in threaded.notes if "thread" in n], threaded.notes


@pytest.mark.parametrize("feed", ["in_background", "on_this_thread"])
def test_batches_moved_to_the_gpu_on_a_background_thread_are_counted(
        tmp_path: Path, feed: str) -> None:
    background = _run(tmp_path, "train.py", LOADER.format(feed=feed), 2)
    assert not [n for n in background.notes if "not counted" in n], background.notes
    if feed == "on_this_thread":
        return
    here = _run(tmp_path, "here.py", LOADER.format(feed="on_this_thread"), 2)
    # the batches the thread made ahead (a queue of two) besides the one in use: cuda:0
    # holds at least one more batch of 256 x 512 float32 (512 KiB) than when made in turn
    batch_bytes = 256 * 512 * 4
    assert (background.devices[0].peak_allocated_bytes
            >= here.devices[0].peak_allocated_bytes + batch_bytes)


IN_A_THREAD = """
import threading

import torch
from torch import nn


def train():
    model = nn.DataParallel(nn.Sequential(nn.Linear(256, 1024), nn.ReLU(),
                                          nn.Linear(1024, 10)).cuda())
    opt = torch.optim.Adam(model.parameters())
    for step in range(100):
        x, y = torch.randn(64, 256).cuda(), torch.randint(0, 10, (64,)).cuda()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


{start}
"""


@pytest.mark.parametrize("start", ["train()", "t = threading.Thread(target=train)\n"
                                                "t.start()\nt.join()"])
def test_a_training_loop_on_a_thread_is_measured_and_stopped_after_its_steps(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], start: str) -> None:
    """The loop on a thread the script starts is measured as on the script's own thread,
    and stopped after --steps there without a traceback (dpprof's stop, not the script's
    error)."""
    script = tmp_path / "train.py"
    script.write_text(IN_A_THREAD.format(start=start))
    result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(script)], 2),
                                         steps=3), alternatives=False)
    (scenario,) = result.scenarios
    assert scenario.status == "ok", scenario.message
    assert result.config["steps_done"]["as-written"] == 3
    assert "Traceback" not in capsys.readouterr().err
    if start != "train()":
        here = _run(tmp_path, "here.py", IN_A_THREAD.format(start="train()"), 2)
        assert _peaks(scenario) == _peaks(here)


HEARTBEAT = """
import os
import threading
import time

import torch
from torch import nn


# beside the script, not the working folder: a thread left running by code without this
# mend would write on after the test, wherever the test process then stands
BEAT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heartbeat.txt")


def beat():
    while True:
        time.sleep(0.02)
        with open(BEAT, "a") as f:
            f.write("beat\\n")


threading.Thread(target=beat, daemon={daemon}, name="dpprof-test-heartbeat").start()
model = nn.DataParallel(nn.Linear(64, 64).cuda())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(100):
    loss = model(torch.randn(32, 64).cuda()).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.02)
"""


@pytest.mark.parametrize("daemon", [True, False])
def test_threads_left_running_end_with_their_run(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 daemon: bool) -> None:
    """A thread the script leaves running (a heartbeat written every 20 ms) ended with its
    run, as a process's end ends it: left running, it wrote into the next run's overlay,
    and after the last, with Python's file calls its own again, into the user's folder.
    Each run's own heartbeat is in its overlay."""
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(HEARTBEAT.format(daemon=daemon))
    result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(script)], 2),
                                         steps=3))
    assert [s.status for s in result.scenarios] == ["ok"] * len(result.scenarios)
    time.sleep(0.3)  # past a few beats
    assert not [t for t in threading.enumerate()
                if t.name == "dpprof-test-heartbeat" and t.is_alive()]
    assert not (tmp_path / "heartbeat.txt").exists()
    assert sorted(w.run for w in result.writes if w.path == "heartbeat.txt") == sorted(
        {"as-written", "loss-in-forward", "ddp"} & {w.run for w in result.writes})
