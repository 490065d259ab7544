"""One cuBLAS handle a thread, one workspace a handle: where the program's own thread and a
thread it started (DataParallel's parallel_apply runs each of two replicas or more in one)
both run cuBLAS on a GPU, that GPU holds one workspace more.

torch keeps a pool of cuBLAS handles per device (``DeviceThreadHandlePool``,
``aten/src/ATen/cuda/CublasHandlePool.cpp``): a thread takes one at its first cuBLAS op and
gives it back when it ends, and each (handle, stream) gets its own workspace from the caching
allocator, kept for the process (``cublas_handle_stream_to_workspace``). So a face-recognition
loop whose margin head (a matmul) runs on cuda:0 outside DataParallel holds three workspaces
there: its thread's, the replica thread's (reused step after step from the pool) and
autograd's; the other GPUs two. The H100 measured one such workspace: 32 MiB at a thread's
first matmul (tests/data/h100_measured.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpprof.emulator.catalog import lookup_gpu
from dpprof.script.session import ScriptConfig, parse_command, run_command

ONE_WORKSPACE = json.loads((Path(__file__).parent / "data" / "h100_measured.json").read_text())[
    "library_first_use_growth_bytes"]["mm_other_thread"]

LOOP = """
import threading
import torch, torch.nn as nn, torch.nn.functional as F
class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 128))
    def forward(self, x):
        return self.net(x)
class Margin(nn.Module):  # a margin head on the features, ArcFace's shape
    def __init__(self, classes=1000):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(classes, 128))
    def forward(self, f):
        return F.linear(F.normalize(f), F.normalize(self.weight)) * 30.0
{setup}
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    x = torch.randn(64, 256).cuda(); y = torch.randint(0, 1000, (64,)).cuda()
    loss = F.cross_entropy({logits}, y)
    opt.zero_grad(); loss.backward(); opt.step()
    {after}
"""
HEAD_OUTSIDE = ("backbone, head = nn.DataParallel(Backbone().cuda()), Margin().cuda()\n"
                "model = nn.ModuleList([backbone, head])", "head(backbone(x))")
HEAD_INSIDE = ("model = nn.DataParallel(nn.Sequential(Backbone(), Margin()).cuda())", "model(x)")


def _workspaces(tmp_path: Path, setup: tuple[str, str], gpus: int = 2,
                after: str = "pass") -> list[int]:
    (tmp_path / "train.py").write_text(LOOP.format(setup=setup[0], logits=setup[1],
                                                   after=after))
    result, main = run_command(ScriptConfig(launch=parse_command(["python", "train.py"], gpus),
                                            gpus=gpus, gpu=lookup_gpu("h100-80gb")),
                               alternatives=False)
    assert main.exit_status == 0, main.script_traceback
    (s,) = result.scenarios
    return [d.workspace_bytes or 0 for d in s.devices]


def test_a_head_outside_data_parallel_holds_a_workspace_more_on_cuda_0(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    outside = _workspaces(tmp_path, HEAD_OUTSIDE)
    inside = _workspaces(tmp_path, HEAD_INSIDE)
    # the replicas' threads and autograd's on every GPU; the loop's own thread on cuda:0
    assert inside[0] == inside[1] == outside[1]
    assert outside[0] - outside[1] == ONE_WORKSPACE


def test_on_one_gpu_the_replica_runs_in_the_program_s_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DataParallel over one GPU calls the module itself: no thread, no other handle."""
    monkeypatch.chdir(tmp_path)
    assert _workspaces(tmp_path, HEAD_OUTSIDE, gpus=1) == _workspaces(tmp_path, HEAD_INSIDE,
                                                                       gpus=1)


def test_a_thread_the_script_starts_takes_a_handle_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On one GPU, where every op ran in the program's thread, a thread that runs a matmul
    there (an evaluation beside the loop) adds its handle's workspace; one that runs none
    adds nothing."""
    monkeypatch.chdir(tmp_path)
    probe = "t = threading.Thread(target=lambda: {work}); t.start(); t.join()"
    plain = _workspaces(tmp_path, HEAD_INSIDE, gpus=1)
    matmul = _workspaces(tmp_path, HEAD_INSIDE, gpus=1, after=probe.format(
        work="torch.randn(64, 64, device='cuda') @ torch.randn(64, 64, device='cuda')"))
    host = _workspaces(tmp_path, HEAD_INSIDE, gpus=1, after=probe.format(
        work="torch.randn(64, 64) @ torch.randn(64, 64)"))
    assert host == plain
    assert matmul[0] - plain[0] == ONE_WORKSPACE
