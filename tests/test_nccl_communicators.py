"""NCCL's memory on the GPUs of one process's own communicators: torch.cuda.nccl makes one
per GPU of a call's devices (``ncclCommInitAll``, torch/csrc/cuda/nccl.cpp) for
torch.cuda.comm's broadcast and reduce, which DataParallel runs every step; like a DDP
rank's process group, it holds NCCL's code, channels and connection buffers outside the
caching allocator, counted in compare's DataParallel scenarios, in ``dpprof run``'s figures
and in what ``torch.cuda`` tells the script as it runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dpprof.backends.emulated import run_scenario
from dpprof.backends.emulated_config import EmulationConfig
from dpprof.emulator.catalog import lookup_gpu
from dpprof.emulator.context import device_context, link_of
from dpprof.emulator.nccl_memory import NcclSettings, nccl_clique_memory, nccl_rank_memory
from dpprof.emulator.virtual_cuda import VirtualCuda
from dpprof.result import ScenarioResult
from dpprof.scenarios.workloads import load_workload
from dpprof.script import parallel_state, wrappers
from dpprof.script.run_figures import NcclOnDevices
from dpprof.script.session import ScriptConfig, parse_command, run_command

H100 = (9, 0)


def test_broadcast_and_reduce_connect_the_ring_alone() -> None:
    """NCCL runs broadcast and reduce on the ring only (tuning.cc), and connects an algorithm
    at its first use: DataParallel's GPUs hold no tree and no NVLS buffers, which a DDP
    rank's all-reduce may connect; with connection at init the two are the same."""
    for gpus in (2, 4, 8):
        clique = nccl_clique_memory(gpus, compute_capability=H100, link="nvlink")
        rank = nccl_rank_memory(gpus, compute_capability=H100, link="nvlink")
        assert clique.parts_high_bytes["nvls_buffers"] == 0 < rank.parts_high_bytes[
            "nvls_buffers"]
        assert clique.low_bytes == rank.low_bytes  # the least: a ring, in both
        assert clique.low_bytes < clique.high_bytes < rank.high_bytes
        assert "ncclCommInitAll" in clique.notes[0]
        at_init = NcclSettings.from_env({"NCCL_RUNTIME_CONNECT": "0"})
        connected = nccl_clique_memory(gpus, compute_capability=H100, settings=at_init)
        assert connected.parts_high_bytes == nccl_rank_memory(
            gpus, compute_capability=H100, settings=at_init).parts_high_bytes
    # more GPUs in one process add no channel: the ring's connections stay two per channel
    assert nccl_clique_memory(8).high_bytes == nccl_clique_memory(2).high_bytes
    # without P2P the buffers move to host memory
    no_p2p = NcclSettings.from_env({"NCCL_P2P_DISABLE": "1"})
    assert nccl_clique_memory(4, settings=no_p2p).parts_high_bytes["p2p_buffers"] == 0


@pytest.mark.parametrize("scenario", ["dp-loss-primary", "dp-loss-forward"])
def test_dataparallels_gpus_each_hold_a_communicator_in_compare(scenario: str) -> None:
    """Every GPU DataParallel replicates to holds NCCL's memory; one GPU (no replicas) and
    the single scenario hold none."""
    wl = load_workload("mlp")
    spec = lookup_gpu("h100-80gb")
    expected = nccl_clique_memory(4, compute_capability=spec.compute_capability,
                                  link=link_of(spec)).high_bytes
    cfg = EmulationConfig(gpus=4, gpu="h100-80gb", compute_capability=spec.compute_capability,
                          gpu_memory_bytes=spec.total_memory_bytes)
    s = run_scenario(scenario, wl, cfg)
    assert s.status == "ok", s.message
    for d in s.devices:
        assert d.context_breakdown_bytes["nccl"] == expected
        assert d.context_bytes == sum(d.context_breakdown_bytes.values())
    assert any(n.startswith("NCCL's communicators on cuda:0, cuda:1, cuda:2, cuda:3") for n in s.notes)
    single = run_scenario("single", wl, cfg)
    assert "nccl" not in single.devices[0].context_breakdown_bytes
    one = run_scenario(scenario, wl, EmulationConfig(
        gpus=1, gpu="h100-80gb", compute_capability=spec.compute_capability,
        gpu_memory_bytes=spec.total_memory_bytes))
    assert "nccl" not in one.devices[0].context_breakdown_bytes


# a DataParallel script that reads what the GPUs hold before and after its first step
DP_READS = """
import torch, torch.nn as nn
model = nn.DataParallel(nn.Linear(256, 256).cuda())
before = [torch.cuda.device_memory_used(i) for i in range(4)]
free_before = torch.cuda.mem_get_info(1)[0]
model(torch.randn(64, 256, device="cuda")).sum().backward()
after = [torch.cuda.device_memory_used(i) for i in range(4)]
free_after = torch.cuda.mem_get_info(1)[0]
print("grew", *[a - b for a, b in zip(after, before)])
print("free fell", free_before - free_after)
"""


@pytest.fixture
def _in_tmp(in_script_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NCCL_RUNTIME_CONNECT", "NCCL_P2P_DISABLE", "NCCL_MAX_NCHANNELS"):
        monkeypatch.delenv(name, raising=False)


def _run(folder: Path, source: str, gpus: int = 4) -> ScenarioResult:
    script = folder / "train.py"
    script.write_text(source)
    result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(script)], gpus),
                                         gpus=gpus, gpu=lookup_gpu("h100-80gb")),
                            alternatives=False)
    return result.scenarios[0]


@pytest.mark.usefixtures("_in_tmp")
def test_a_data_parallel_script_is_told_of_nccls_memory_from_its_first_step(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """NVML's used memory and cudaMemGetInfo's free memory, as the script reads them, count
    the communicators from DataParallel's first replicate on (not before), and the run's
    figures count them on every GPU."""
    s = _run(tmp_path, DP_READS)
    out = capsys.readouterr().out
    spec = lookup_gpu("h100-80gb")
    nccl = nccl_clique_memory(4, compute_capability=spec.compute_capability,
                              link=link_of(spec)).high_bytes
    grew = [int(x) for x in next(line for line in out.splitlines()
                                 if line.startswith("grew")).split()[1:]]
    fell = int(next(line for line in out.splitlines() if line.startswith("free fell")).split()[-1])
    # each GPU grew by NCCL's memory and the step's reserve (its tensors and the cuBLAS
    # workspaces: well under 128 MiB here)
    assert all(nccl <= g < nccl + (128 << 20) for g in grew), (grew, nccl)
    assert nccl <= fell < nccl + (128 << 20)
    assert s.status == "ok", s.message
    for d in s.devices:
        assert d.context_breakdown_bytes["nccl"] == nccl


# a tensor on cuda:1 of what was free there before anything ran, less 256 MiB (more than
# the step's own reserve, far less than NCCL's memory), after a step with or without
# DataParallel
FILL_CUDA1 = """
import torch, torch.nn as nn
free = torch.cuda.mem_get_info(1)[0]
model = nn.Linear(256, 256).cuda()
if {dp}:
    model = nn.DataParallel(model)
model(torch.randn(64, 256, device="cuda")).sum().backward()
try:
    x = torch.empty(free - (256 << 20), dtype=torch.uint8, device="cuda:1")
    print("fits")
except torch.OutOfMemoryError:
    print("out of memory")
"""


@pytest.mark.usefixtures("_in_tmp")
@pytest.mark.parametrize("dp", [False, True])
def test_the_oom_in_the_run_leaves_room_for_nccls_communicators(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], dp: bool) -> None:
    """What fits on a GPU after one GPU's step does not after DataParallel's: its
    communicator on the GPU holds NCCL's memory, as on the GPU."""
    _run(tmp_path, FILL_CUDA1.format(dp=dp))
    said = capsys.readouterr().out.splitlines()
    assert ("out of memory" if dp else "fits") in said, said


# a DDP rank that reads its GPU's used memory before its process group and after DDP
DDP_READS = """
import os, torch, torch.distributed as dist, torch.nn as nn
rank = int(os.environ["LOCAL_RANK"])
before = torch.cuda.device_memory_used(rank)
dist.init_process_group("nccl")
print("grew", torch.cuda.device_memory_used(rank) - before)  # nothing allocated yet
model = nn.parallel.DistributedDataParallel(nn.Linear(16, 16).to(rank), device_ids=[rank])
"""


@pytest.mark.usefixtures("_in_tmp")
def test_a_ddp_rank_is_told_of_its_process_groups_nccl_memory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rank's process group over NCCL holds NCCL's memory on the rank's GPU: what the
    script reads counts it from the group's start, before the rank allocated anything, as
    the run's figures do."""
    script = tmp_path / "train.py"
    script.write_text(DDP_READS)
    spec = lookup_gpu("h100-80gb")
    result, main = run_command(ScriptConfig(
        launch=parse_command(["torchrun", "--nproc-per-node", "2", str(script)], 2), gpus=2,
        gpu=spec, ranks="none"), alternatives=False)
    assert main.exit_status == 0, main.script_traceback
    grew = int(next(line for line in capsys.readouterr().out.splitlines()
                    if line.startswith("grew")).split()[-1])
    nccl = device_context(spec.compute_capability, False, world_size=2,
                          link=link_of(spec)).nccl_bytes
    assert grew == nccl
    rank = result.scenarios[0].devices[0]
    assert rank.context_breakdown_bytes["nccl"] == nccl


# torch.cuda.nccl called by hand, over CPU tensors: each result printed
NCCL_BY_HAND = """
import torch, torch.cuda.nccl as nccl
def per_gpu(make):
    return [make(i).to(f"cuda:{i}") for i in range(4)]
def show(name, ts):
    print(name, [t.cpu().tolist() for t in ts])
print("available", nccl.is_available(per_gpu(lambda i: torch.zeros(2))))
x = per_gpu(lambda i: torch.arange(6.0) * (i + 1)); nccl.all_reduce(x); show("all_reduce", x)
x = per_gpu(lambda i: torch.arange(6.0) - i); nccl.all_reduce(x, op=2); show("max", x)
x = per_gpu(lambda i: torch.arange(6.0) * (i + 1)); nccl.reduce(x, root=2, op=4)
show("reduce_avg", x)
x = per_gpu(lambda i: torch.full((3,), float(i))); nccl.broadcast(x, root=3)
show("broadcast", x)
x = per_gpu(lambda i: torch.full((2,), float(i))); out = per_gpu(lambda i: torch.empty(8))
nccl.all_gather(x, out); show("all_gather", out)
x = per_gpu(lambda i: torch.arange(8.0) + i); out = per_gpu(lambda i: torch.empty(2))
nccl.reduce_scatter(x, out); show("reduce_scatter", out)
for bad in ([torch.zeros(2, device="cuda:0"), torch.zeros(3, device="cuda:1")],
            [torch.zeros(2, device="cuda:0"), torch.zeros(2, device="cuda:0")],
            [torch.zeros(4, device="cuda:0")[::2], torch.zeros(2, device="cuda:1")],
            [torch.zeros(2, device="cuda:0"), torch.zeros(2)]):
    try:
        nccl.all_reduce(bad)
    except RuntimeError as e:
        print("refused", e)
try:
    nccl.all_reduce(per_gpu(lambda i: torch.zeros(2)), op=7)
except RuntimeError as e:
    print("refused", e)
"""


@pytest.mark.usefixtures("_in_tmp")
def test_torch_cuda_nccl_computes_what_nccl_computes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """torch.cuda.nccl's collectives over one process's GPUs, called by hand: with --compute
    each writes what NCCL writes (the same reductions done here on plain CPU tensors), and
    refuses what nccl.cpp refuses."""
    script = tmp_path / "train.py"
    script.write_text(NCCL_BY_HAND)
    _, main = run_command(ScriptConfig(
        launch=parse_command(["python", str(script)], 4), gpus=4, compute=True),
        alternatives=False)
    assert main.exit_status == 0, main.script_traceback
    said = {line.split(" ", 1)[0]: line.split(" ", 1)[1]
            for line in capsys.readouterr().out.splitlines() if " " in line}
    parts = [torch.arange(6.0) * (i + 1) for i in range(4)]
    total = torch.stack(parts).sum(0).tolist()
    assert said["available"] == "True"
    assert said["all_reduce"] == str([total] * 4)
    shifted = torch.stack([torch.arange(6.0) - i for i in range(4)]).amax(0).tolist()
    assert said["max"] == str([shifted] * 4)
    reduced = [p.tolist() for p in parts]
    reduced[2] = (torch.stack(parts).sum(0) / 4).tolist()  # the root's only
    assert said["reduce_avg"] == str(reduced)
    assert said["broadcast"] == str([[3.0] * 3] * 4)
    gathered = torch.cat([torch.full((2,), float(i)) for i in range(4)]).tolist()
    assert said["all_gather"] == str([gathered] * 4)
    summed = torch.stack([torch.arange(8.0) + i for i in range(4)]).sum(0)
    assert said["reduce_scatter"] == str([summed[2 * i:2 * i + 2].tolist() for i in range(4)])
    assert main.scenario.status == "ok"


@pytest.mark.usefixtures("_in_tmp")
def test_torch_cuda_nccl_refuses_what_nccl_cpp_refuses(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text(NCCL_BY_HAND)
    run_command(ScriptConfig(launch=parse_command(["python", str(script)], 4), gpus=4),
                alternatives=False)
    refused = [line for line in capsys.readouterr().out.splitlines()
               if line.startswith("refused")]
    assert refused == ["refused all inputs must have the same number of elements",
                       "refused inputs must be on unique devices",
                       "refused all inputs and outputs have to be contiguous",
                       "refused input and output elements have to be cuda dense Tensors",
                       "refused torch.cuda.nccl: reduction op 7 is not one of SUM (0), PROD "
                       "(1), MAX (2), MIN (3), AVG (4)"]


# torch.cuda.nccl over two of four GPUs, over meta tensors
NCCL_TWO_OF_FOUR = """
import torch, torch.cuda.nccl as nccl
for i in range(4):
    torch.zeros(1, device=f"cuda:{i}")
nccl.all_reduce([torch.ones(1024, device="cuda:1"), torch.ones(1024, device="cuda:3")])
"""


@pytest.mark.usefixtures("_in_tmp")
def test_torch_cuda_nccl_makes_communicators_on_the_gpus_it_joins(tmp_path: Path) -> None:
    s = _run(tmp_path, NCCL_TWO_OF_FOUR)
    spec = lookup_gpu("h100-80gb")
    two = nccl_clique_memory(2, compute_capability=spec.compute_capability,
                             link=link_of(spec)).high_bytes
    nccl = {d.index: d.context_breakdown_bytes.get("nccl") for d in s.devices}
    assert nccl == {0: None, 1: two, 2: None, 3: two}
    assert any(n.startswith("NCCL's communicators on cuda:1, cuda:3") for n in s.notes)


@pytest.mark.usefixtures("_in_tmp")
def test_a_communicator_made_by_hand_stops_the_run_in_one_line(tmp_path: Path) -> None:
    s = _run(tmp_path, "import torch.cuda.nccl as nccl\nnccl.init_rank(2, nccl.unique_id(), 0)\n")
    assert s.status == "error"
    assert s.message.startswith("dpprof: torch.cuda.nccl.unique_id / init_rank"), s.message
    assert "\n" not in s.message


def test_a_later_ranks_communicator_is_on_its_own_gpu_before_it_allocates() -> None:
    """The rank a run plays (its LOCAL_RANK) holds its process group's communicator on its
    own GPU from the group's start, nothing allocated there yet; the other GPUs hold none."""
    spec = lookup_gpu("h100-80gb")
    cfg = ScriptConfig(launch=parse_command(["python", "train.py"], 4), gpus=4, gpu=spec)
    nccl = device_context(spec.compute_capability, False, world_size=4,
                          link=link_of(spec)).nccl_bytes
    with VirtualCuda(4, spec, installers=[wrappers.install]) as vc:
        on = NcclOnDevices(vc, cfg, local_rank=2)
        assert [on(d) for d in range(4)] == [0, 0, 0, 0]  # no process group yet
        log = parallel_state.state_of(vc).log
        log.fake_group, log.world_size = True, 4
        assert [on(d) for d in range(4)] == [0, 0, nccl, 0]
