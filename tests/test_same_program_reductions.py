"""A script's reductions and all-to-alls across ranks read back what ranks that run the
same program get (dpprof.emulator.same_program): the same script, its ranks contributing
equal tensors, run plainly over gloo on two real CPU processes is the reference, and
``dpprof run`` of it over NCCL on two virtual GPUs (meta tensors, whose small values are
followed, and ``--compute``) must print what it prints. Before, torch's fake process group
left each rank its own contribution: a summed loss read back as one rank's, an average
across ranks as 1/world of it, an all-to-all as the rank's own input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpprof.script.session import ScriptConfig, parse_command, run_command

SCRIPT = """
import os
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

device = os.environ.get("DEVICE", "cuda")
dist.init_process_group("gloo" if device == "cpu" else "nccl")
rank = dist.get_rank()
if device == "cuda":
    torch.cuda.set_device(rank)
seen = []
def show(name, t):
    seen.append(f"{name} {t.tolist()}")
def v(*xs):
    return torch.tensor(xs, dtype=torch.float32, device=device)
for op in ("SUM", "PRODUCT", "MAX", "MIN"):
    t = v(3., 4.); dist.all_reduce(t, op=getattr(dist.ReduceOp, op)); show(f"all_reduce {op}", t)
t = v(3., 4.); dist.all_reduce(t, async_op=True).wait(); show("all_reduce async", t)
t = v(5.); dist.reduce(t, dst=0); show("reduce", t)
out = torch.empty(2, device=device)
dist.reduce_scatter_tensor(out, v(1., 2., 3., 4.)); show("reduce_scatter_tensor", out)
out = torch.empty(2, device=device)
dist.reduce_scatter(out, [v(1., 2.), v(3., 4.)]); show("reduce_scatter", out)
show("functional all_reduce", funcol.all_reduce(v(3., 4.), "sum", dist.group.WORLD))
show("functional reduce_scatter",
     funcol.reduce_scatter_tensor(v(1., 2., 3., 4.), "sum", 0, dist.group.WORLD))
tokens = torch.tensor([7], device=device); dist.all_reduce(tokens); show("tokens", tokens)
out = torch.empty(4, device=device)
dist.all_to_all_single(out, v(1., 2., 3., 4.)); show("all_to_all_single", out)
outs = [torch.empty(2, device=device) for _ in range(2)]
dist.all_to_all(outs, [v(1., 2.), v(3., 4.)]); show("all_to_all", torch.stack(outs))
show("functional all_to_all", funcol.all_to_all_single(v(1., 2., 3., 4.), None, None,
                                                        dist.group.WORLD))
if rank == 0:
    print("\\n".join([*seen, "done"]), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def over_gloo(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """What the script prints run plainly by torchrun: two CPU processes over gloo."""
    folder = tmp_path_factory.mktemp("gloo")
    (folder / "reduce.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE"))}
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "reduce.py"], cwd=folder, env={**env, "DEVICE": "cpu"}, capture_output=True,
        text=True, timeout=300)
    lines = r.stdout.splitlines()
    # every line printed before the group's teardown: gloo's worker threads can abort a
    # process at its exit under load ("terminate called without an active exception"),
    # after the lines, which the barrier holds back until rank 0 has printed them
    assert "done" in lines, r.stderr[-3000:]
    assert "all_reduce SUM [6.0, 8.0]" in lines  # two equal contributions, summed
    return lines


@pytest.mark.torchrun
@pytest.mark.parametrize("compute", [False, True], ids=["meta", "compute"])
def test_reductions_read_back_what_ranks_of_the_same_program_get(
        compute: bool, over_gloo: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    (tmp_path / "reduce.py").write_text(SCRIPT)
    result, _ = run_command(ScriptConfig(
        launch=parse_command(["torchrun", "--nproc-per-node", "2", "reduce.py"], 2), gpus=2,
        compute=compute, ranks="none"), alternatives=False)
    (scenario,) = result.scenarios
    assert scenario.status == "ok", scenario.message
    printed = capsys.readouterr().out.splitlines()
    assert printed[:len(over_gloo)] == over_gloo
    # real values, not stand-ins: nothing made up was read
    assert not any("stand-in" in note for note in scenario.notes)
