"""The GPU's out-of-memory error raised in the run (dpprof.emulator.oom_guard): a script that
catches it and halves its batch goes on as on the GPU; one that does not is stopped where
the GPU stops it, and run on past it to measure what it needs."""

from __future__ import annotations

from pathlib import Path

import pytest
from script_runs import run_script

GiB = 2**30

# a 8192-wide MLP trained with Adam: each row of the batch holds 3 x 32 KiB of activations
HALVING = """
import torch, torch.nn as nn
model = nn.Sequential(nn.Linear(8192, 8192), nn.ReLU(), nn.Linear(8192, 8192)).cuda()
opt = torch.optim.Adam(model.parameters())
rows = 1 << 20
while True:
    try:
        for _ in range(3):
            x = torch.randn(rows, 8192, device="cuda")
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        break
    except torch.OutOfMemoryError as e:
        assert str(e).startswith("CUDA out of memory. Tried to allocate"), e
        rows //= 2
        print("halved to", rows)
"""

UNCAUGHT = """
import torch, torch.nn as nn
model = nn.Sequential(nn.Linear(8192, 8192), nn.ReLU(), nn.Linear(8192, 8192)).cuda()
opt = torch.optim.Adam(model.parameters())
for _ in range(3):
    x = torch.randn(1 << 20, 8192, device="cuda")
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
"""


pytestmark = pytest.mark.usefixtures("in_script_folder")


def test_a_script_that_halves_its_batch_on_oom_goes_on_as_on_the_gpu(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = run_script(tmp_path, HALVING)
    halved = [int(line.split()[-1]) for line in capsys.readouterr().out.splitlines()
              if line.startswith("halved to")]
    # 1,048,576 rows need 96 GiB of activations alone: halved until the steps fit in 80 GB
    assert halved and halved[-1] < 1 << 19
    assert s.status == "ok", s.message
    assert s.batch == halved[-1]  # the batch it trained on, not the first try's
    d = s.devices[0]
    assert d.total_peak_bytes <= d.capacity_bytes
    said = [n for n in s.notes if n.startswith("torch.OutOfMemoryError raised")]
    assert said and f"raised {len(halved)} time(s)" in said[0] and "train.py:" in said[0]


def test_an_uncaught_oom_stops_the_script_where_the_gpu_would_and_the_need_is_measured(
        tmp_path: Path) -> None:
    s = run_script(tmp_path, UNCAUGHT)
    assert s.status == "oom" and s.oom_device == 0
    assert "on a GPU the script stops at torch.OutOfMemoryError at train.py:" in s.message
    # run on past it: the need of the whole step (the activations of 1 Mi rows: > 96 GiB)
    assert s.oom_bytes is not None and s.oom_bytes > 96 * GiB
    assert s.devices[0].peak_allocated_bytes > 96 * GiB


def test_accelerates_batch_size_finder_settles_where_the_gpu_has_room(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("accelerate")
    s = run_script(tmp_path, """
import torch, torch.nn as nn
from accelerate.utils import find_executable_batch_size
model = nn.Sequential(nn.Linear(8192, 8192), nn.ReLU(), nn.Linear(8192, 8192)).cuda()
opt = torch.optim.Adam(model.parameters())

@find_executable_batch_size(starting_batch_size=1 << 20)
def train(batch_size):
    print("trying", batch_size)
    for _ in range(3):
        model(torch.randn(batch_size, 8192, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
train()
""")
    tried = [int(line.split()[-1]) for line in capsys.readouterr().out.splitlines()
             if line.startswith("trying")]
    assert len(tried) > 1 and s.status == "ok", s.message
    assert s.batch == tried[-1]


def test_the_error_is_known_again_where_a_worker_thread_re_raised_a_copy() -> None:
    """DataParallel's replicas run in threads: torch re-raises a replica's error in the
    caller as a new error carrying its traceback's text (ExceptionWrapper)."""
    import torch
    from torch._utils import ExceptionWrapper

    from dpprof.emulator.oom_guard import OomGuard
    from dpprof.emulator.virtual_cuda import VirtualCuda

    with VirtualCuda(1) as vc:
        guard = OomGuard(vc.memory, lambda device: 0, lambda i: i)
        vc.memory.set_per_process_memory_fraction(1e-6)  # about 85 KB for the allocator
        guard.install()
        try:
            torch.empty(2**20, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            wrapped = ExceptionWrapper(where="in replica 0 on device 0")
        try:
            wrapped.reraise()
        except torch.OutOfMemoryError as copy:
            assert guard.raised_by(copy) == guard.raised[0]
        assert guard.raised_by(RuntimeError("another")) is None


def test_the_live_simulation_keeps_to_the_replayed_one() -> None:
    """Once started, the guard's simulation follows every event (a storage resized in place,
    the cache emptied included): its reserve is what a replay of the device's allocations
    gives (memory_reserved)."""
    import torch

    from dpprof.emulator.oom_guard import OomGuard
    from dpprof.emulator.virtual_cuda import VirtualCuda

    MiB = 2**20
    with VirtualCuda(1) as vc:
        guard = OomGuard(vc.memory, lambda device: 0, lambda i: i)
        guard.install()
        vc.memory.set_per_process_memory_fraction(0.001)  # about 85 MB: live from ~21 MB
        keep = [torch.empty(12 * MiB, dtype=torch.uint8, device="cuda") for _ in range(3)]
        sim = guard.simulation(vc.index_of(0))
        assert sim is not None  # started
        grown = torch.empty(MiB, dtype=torch.uint8, device="cuda")
        grown.resize_(15 * MiB)  # in place: a free and an allocation the guard never saw
        del keep[0]
        torch.cuda.empty_cache()
        more = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
        assert sim.reserved_bytes == torch.cuda.memory_reserved()
        # the same tensors live in both (the blocks may be larger: one served whole)
        assert sim.requested_bytes == vc.rt.storages.counters[vc.index_of(0)].live_requested
        del grown, more
