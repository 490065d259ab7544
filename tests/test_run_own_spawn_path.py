"""A DataParallel script whose DDP path starts its ranks itself (``mp.spawn`` under an option,
as pytorch/examples' ImageNet script does): the DDP fix said to start it under ``torchrun``,
which, without the option, runs the DataParallel path in every process, and to give each rank
a batch of ``N // GPUs`` that the path then divides again. Now the note names the spawn, the
condition and the option that take the path, and the division the script makes itself;
followed, every rank peaks as the fix promised, to the byte. A rank and world size the real
process group refuses (the option alone: world size -4) now fail the emulated run as they
fail the real one."""

from __future__ import annotations

import ast
import json
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from dpprof.cli.app import app
from dpprof.script.ddp_diff import own_process_group
from dpprof.script.own_ddp_path import divided_batch, divides_itself, spawns
from dpprof.script.source import ScriptSource

SCRIPT = Path(__file__).parent / "scripts" / "spawn_own_ddp.py"


def _line(text: str) -> int:
    return next(i for i, line in enumerate(SCRIPT.read_text().splitlines(), 1) if text in line)


def _run(folder: Path, args: list[str], out: Path) -> tuple[int, str, dict[str, Any]]:
    r = CliRunner().invoke(app, ["run", "--gpus", "4", "-q", "-o", str(out), "--", "python",
                                 str(folder / SCRIPT.name), *args])
    return r.exit_code, r.output, json.loads(out.read_text()) if out.exists() else {}


def test_the_ddp_note_names_the_script_s_own_spawned_path_and_it_peaks_as_promised(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    shutil.copy(SCRIPT, tmp_path)
    monkeypatch.chdir(tmp_path)
    code, output, written = _run(tmp_path, [], tmp_path / "dp.json")
    assert code == 0, output
    fixes = {f["name"]: f for f in written["fixes"]}
    note = fixes["ddp"]["code"]
    assert note == (
        "# no rewrite of the script's lines: the script starts its own process group (line "
        f"{_line('init_process_group(')}) and wraps DistributedDataParallel itself (line "
        f"{_line('DistributedDataParallel(model')}) in processes it starts itself (mp.spawn, "
        f"line {_line('mp.spawn(')}, when `args.multiprocessing_distributed`: the option "
        "--multiprocessing-distributed): take that path rather than change its lines or start "
        "it under torchrun, each rank's DataLoader batch_size 8 (DataParallel's 32 rows // 4, "
        "as the DDP alternative ran it); the script divides args.batch_size by the ranks itself "
        f"(line {_line('args.batch_size = int(')}): give it DataParallel's 32; `dpprof run "
        "--gpus 4 -- python spawn_own_ddp.py --multiprocessing-distributed ...` measures it")
    assert "gradient_as_bucket_view=True" in fixes["gradient-as-bucket-view"]["code"]

    # as the note says, with what the path needs besides (this script's rendezvous options)
    code, output, again = _run(tmp_path, ["--multiprocessing-distributed", "--world-size", "1",
                                          "--rank", "0", "-b", "32"], tmp_path / "ddp.json")
    assert code == 0, output
    (ran,) = again["scenarios"]
    assert ran["name"] == "ddp" and ran["status"] == "ok", ran
    assert [d["batch_rows"] for d in ran["devices"]] == [8] * 4
    assert [d["peak_allocated_bytes"] for d in ran["devices"]] == [
        fixes["ddp"]["max_peak_bytes"]] * 4


def test_a_rank_and_world_size_the_real_process_group_refuses_fail_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The option alone: world size 4 x -1, rank -1 x 4 + 0, which NCCL's and gloo's groups
    refuse (gloo: "rank < size. 0 vs -2"); the emulated group had carried on, its peaks
    reported for a run that fails on the machine."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    shutil.copy(SCRIPT, tmp_path)
    monkeypatch.chdir(tmp_path)
    code, output, _ = _run(tmp_path, ["--multiprocessing-distributed"], tmp_path / "bad.json")
    assert code == 1, output
    assert "init_process_group: rank -4 of world size -4" in output
    code, output, _ = _run(tmp_path, ["--multiprocessing-distributed", "--world-size", "1",
                                      "--rank", "1"], tmp_path / "bad.json")
    assert code == 1, output  # rank 1 x 4 + 0 of a world of 4
    assert "init_process_group: rank 4 of world size 4" in output


@pytest.mark.parametrize(("imports", "call", "guard", "option"), [
    ("import torch.multiprocessing as mp", "mp.spawn(work, nprocs=2)", "if args.spawn:",
     ("--spawn",)),
    ("import torch.multiprocessing", "torch.multiprocessing.spawn(work, nprocs=2)",
     "if opts.use_mp and opts.gpus > 1 and ready:", ("--use-mp", "--gpus")),
    ("from torch.multiprocessing import spawn", "spawn(work, nprocs=2)", "if args.many:",
     ("--many-procs",)),
    ("from torch import multiprocessing", "multiprocessing.start_processes(work, nprocs=2)",
     "if True:", ()),
])
def test_a_spawn_is_found_with_its_guard_and_the_options_it_reads(
        imports: str, call: str, guard: str, option: tuple[str, ...]) -> None:
    source = textwrap.dedent(f"""\
        import argparse
        {imports}
        parser = argparse.ArgumentParser()
        parser.add_argument("--spawn", action="store_true")
        parser.add_argument("--use-mp", action="store_true")
        parser.add_argument("--gpus", type=int, default=1)
        parser.add_argument("--many-procs", dest="many", action="store_true")

        def work(i):
            pass

        def main(args, opts):
            {guard}
                {call}
            else:
                pass
        """)
    src = ScriptSource(source, "train.py")
    (found,) = spawns(src)
    assert found.line == len(source.splitlines()) - 2
    assert found.condition == guard[3:-1]
    assert found.options == option


def test_other_spawns_and_a_call_in_the_else_branch_are_told_apart() -> None:
    source = textwrap.dedent("""\
        import pexpect
        import torch.multiprocessing as mp
        child = pexpect.spawn("ls")
        if ask:
            pass
        else:
            mp.spawn(work, nprocs=2)
        """)
    (found,) = spawns(ScriptSource(source, "train.py"))
    assert (found.line, found.call, found.condition) == (7, "mp.spawn", "")


@pytest.mark.parametrize(("statement", "divides"), [
    ("args.batch_size = int(args.batch_size / ngpus)", True),
    ("args.batch_size //= world", True),
    ("args.batch_size = args.batch_size // dist.get_world_size()", True),
    ("args.batch_size = args.batch_size * 2", False),
    ("args.lr = args.lr / ngpus", False),
    ("batch = int(args.batch_size / ngpus)", False),
])
def test_a_batch_size_the_path_divides_itself(statement: str, divides: bool) -> None:
    source = f"x = 1\n{statement}\n"
    assert divides_itself(ScriptSource(source, "train.py"), "args.batch_size") == (
        2 if divides else 0)
    ast.parse(source)


@pytest.mark.parametrize(("source", "found"), [
    # a DataLoader's batch size divided before it is made (ImageNet's)
    ("loader = DataLoader(ds, batch_size=args.batch_size)\n"
     "args.batch_size = int(args.batch_size / ngpus)\n", ("args.batch_size", 2)),
    # divided in the call that makes the loader (YOLOv5's create_dataloader)
    ("loader, ds = create_dataloader(path, 640, batch_size // WORLD_SIZE, gs, hyp=hyp)\n",
     ("batch_size (`batch_size // WORLD_SIZE`)", 1)),
    ("loader = DataLoader(ds, batch_size=opt.batch // world)\n",
     ("opt.batch (`opt.batch // world`)", 1)),
    ("loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True)\n", None),
    ("x = make(lr / world, steps // 2)\n", None),  # a division, not of a batch size
])
def test_the_batch_size_a_ddp_path_divides_is_found(source: str,
                                                    found: tuple[str, int] | None) -> None:
    assert divided_batch(ScriptSource(source, "train.py")) == found


def test_a_torchrun_path_that_divides_its_batch_says_to_give_it_the_whole() -> None:
    """YOLOv5's DDP path starts its process group under torchrun and divides ``--batch-size``
    by the ranks itself: the fix says to give it DataParallel's whole batch (each rank's
    share, given, would be cut again)."""
    source = textwrap.dedent("""\
        import os
        import torch.distributed as dist
        WORLD_SIZE = int(os.getenv("WORLD_SIZE", 1))
        if WORLD_SIZE > 1:
            dist.init_process_group("nccl")
        loader, ds = create_dataloader(path, 640, batch_size // WORLD_SIZE, gs)
        """)
    reason = own_process_group(source, "/work/train.py", 2, 8)
    assert reason.startswith("the script starts its own process group (line 5): run it as DDP "
                             "ranks with `torchrun --nproc-per-node 2 train.py`"), reason
    assert reason.endswith("; the script divides batch_size (`batch_size // WORLD_SIZE`) by "
                           "the ranks itself (line 6): give it DataParallel's 8"), reason
