"""The launchers users start their scripts with, under ``dpprof run``: ``accelerate launch``
(and ``python -m accelerate.commands.launch``) read as accelerate reads them (its flags, its
config file, the environment it gives the script), each rank on its virtual GPU; a launcher
dpprof does not follow is refused at once, naming those it does."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import pytest

from dpprof.errors import UsageError
from dpprof.script.session import ScriptConfig, parse_command, run_command

pytest.importorskip("accelerate")

ACCELERATE_TRAIN = textwrap.dedent("""
    import torch, torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset
    from accelerate import Accelerator

    def main():
        accelerator = Accelerator()
        ds = TensorDataset(torch.randn(1024, 128), torch.randint(0, 10, (1024,)))
        loader = DataLoader(ds, batch_size=64, shuffle=True)
        model = nn.Sequential(nn.Linear(128, 1024), nn.ReLU(), nn.Linear(1024, 10))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        accelerator.print("wrapped in", type(model).__name__, accelerator.num_processes,
                          accelerator.mixed_precision)
        for epoch in range(2):
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                opt.step(); opt.zero_grad()
    if __name__ == "__main__":
        main()
""")


@pytest.mark.parametrize("head", [["accelerate", "launch"], ["accelerate-launch"],
                                  ["python", "-m", "accelerate.commands.launch"]])
def test_accelerate_launch_is_read_with_its_own_flags(head: list[str]) -> None:
    launch = parse_command([*head, "--num_processes", "2", "--mixed_precision", "bf16",
                            "train.py", "--lr", "1"], 4)
    assert (launch.target, launch.argv, launch.nproc) == ("train.py", ["--lr", "1"], 2)
    assert launch.launcher == "accelerate launch"
    assert launch.env["WORLD_SIZE"] == "2" and launch.env["RANK"] == "0"
    assert launch.env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    # without --num_processes: every GPU, as accelerate counts torch.cuda's
    assert parse_command(["accelerate", "launch", "train.py"], 8).nproc == 8
    one = parse_command(["accelerate", "launch", "--num_processes", "1", "-m", "pkg.train"], 4)
    assert (one.target, one.is_module, one.nproc) == ("pkg.train", True, 1)
    assert "WORLD_SIZE" not in one.env


def test_accelerate_reads_its_config_file(tmp_path: Path) -> None:
    config = tmp_path / "cfg.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\n"
                      "num_machines: 1\nnum_processes: 3\nmixed_precision: fp16\n"
                      "gpu_ids: all\nuse_cpu: false\n")
    launch = parse_command(["accelerate", "launch", "--config_file", str(config), "t.py"], 4)
    assert launch.nproc == 3 and launch.env["WORLD_SIZE"] == "3"
    assert launch.env["ACCELERATE_MIXED_PRECISION"] == "fp16"
    with pytest.raises(UsageError, match="--num_processes 4"):
        parse_command(["accelerate", "launch", "--num_processes", "6", "t.py"], 4)


@pytest.mark.parametrize("command", [["accelerate", "launch", "--use_deepspeed", "t.py"],
                                     ["mpirun", "-n", "2", "t.py"], ["accelerate", "config"]])
def test_a_launcher_dpprof_does_not_follow_is_refused_naming_those_it_does(
        command: list[str]) -> None:
    with pytest.raises(UsageError) as caught:
        parse_command(command, 4)
    message = str(caught.value)
    assert message.startswith("dpprof run: ") and "\n" not in message
    assert "accelerate launch" in message and ("torchrun" in message or "DDP" in message)


@pytest.mark.parametrize("command", [["deepspeed", "--num_gpus", "4", "t.py"],
                                     ["python", "-m", "deepspeed.launcher.runner", "t.py"]])
def test_deepspeed_is_refused_naming_the_fsdp2_rungs_it_maps_onto(command: list[str]) -> None:
    with pytest.raises(UsageError) as caught:
        parse_command(command, 4)
    message = str(caught.value)
    assert message.startswith("dpprof run: DeepSpeed is not emulated") and "\n" not in message
    assert "ZeRO-3: fully_shard" in message and "--ladder" in message


def test_a_script_started_by_accelerate_launch_runs_as_ddp_ranks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(ACCELERATE_TRAIN)
    result, main = run_command(ScriptConfig(
        launch=parse_command(["accelerate", "launch", "--num_processes", "4",
                              "--mixed_precision", "bf16", "train.py"], 4), gpus=4))
    assert main.exit_status == 0, main.script_traceback
    # torch's own DDP class, as accelerate checks it; the mixed precision it was asked for
    assert "wrapped in DistributedDataParallel 4 bf16" in capsys.readouterr().out
    (s,) = result.scenarios
    assert s.name == "ddp" and s.status == "ok" and len(s.devices) == 4, s.message
    # accelerate's loader: each rank its own 64 rows; the scenario's batch is the global one
    assert s.batch == 4 * 64 and all(d.batch_rows == 64 for d in s.devices)
    assert len({d.peak_allocated_bytes for d in s.devices}) == 1
    d = s.devices[0].breakdown_bytes
    # every rank: its own parameters (each storage rounded to 512 B, as the caching
    # allocator rounds it) and AdamW's exp_avg and exp_avg_sq
    params = sum(-(-4 * n // 512) * 512 for n in (128 * 1024, 1024, 1024 * 10, 10))
    assert d["parameters"] == params
    assert d["optimizer_state"] == 2 * params
    assert any("autocast" in n for n in s.notes)


def test_each_run_starts_without_the_last_runs_accelerate_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """accelerate keeps its state in process-wide singletons; dpprof runs scripts in its own
    process, so each run (an alternative, the next script) starts without them, as a new
    process would: the second run here sees its own 2 processes, not the first one's 4."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(ACCELERATE_TRAIN)
    seen = []
    for processes in ("4", "2"):
        _, main = run_command(ScriptConfig(
            launch=parse_command(["accelerate", "launch", "--num_processes", processes,
                                  "train.py"], 4), gpus=4, steps=2))
        assert main.exit_status == 0, main.script_traceback
        seen.append(capsys.readouterr().out.strip())
    assert seen == ["wrapped in DistributedDataParallel 4 no",
                    "wrapped in DistributedDataParallel 2 no"]


# DeepSpeed itself is not a test dependency (its wheel is built from source, over CUDA torch
# by default): a package of that name stands in for it, whose initialize fails as the real
# one does on a machine without MPI (deepspeed.comm's mpi_discovery: "No module named
# 'mpi4py'"), which is what a user saw under dpprof run before.
DEEPSPEED_STAND_IN = '''
def initialize(model=None, config=None, **kwargs):
    from mpi4py import MPI  # noqa: F401  (deepspeed.comm.comm.mpi_discovery)
'''

DEEPSPEED_TRAIN = """
import torch
import deepspeed

model = torch.nn.Linear(8, 8).cuda()
engine, optimizer, _, _ = deepspeed.initialize(
    model=model, config={"train_batch_size": 8, "zero_optimization": {"stage": 3}})
"""


@pytest.mark.parametrize("imported_before", [False, True])
def test_deepspeed_initialize_stops_the_run_naming_the_fsdp2_rungs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, imported_before: bool) -> None:
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text(DEEPSPEED_STAND_IN)
    (tmp_path / "train.py").write_text(DEEPSPEED_TRAIN)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    if imported_before:  # a module the script imports was imported before the run began
        importlib.import_module("deepspeed")
    result, main = run_command(ScriptConfig(launch=parse_command(["python", "train.py"], 4),
                                            gpus=4, seal=False), alternatives=False)
    (s,) = result.scenarios
    assert s.status == "error" and main.exit_status == 1
    assert s.message.startswith("dpprof run: DeepSpeed is not emulated"), s.message
    assert "ZeRO-3: fully_shard" in s.message and "mpi4py" not in s.message
    assert "train.py" in (s.traceback or "")  # where the script reached it
    import deepspeed  # the run's patch is undone after it
    assert deepspeed.initialize.__module__ == "deepspeed"
