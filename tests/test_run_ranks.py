"""``dpprof run`` under a launcher runs the other ranks' code too (dpprof.script.rank_runs): a
rank other than 0 that raises or calls ``os._exit`` fails the run with its own status and
line; rank-0-only work (an EMA of the model) shows as cuda:0's excess over the other
GPUs, which show their own ranks' peaks; every report says which ranks were run; the
working folder is byte-identical after each run (the seal)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpprof.cli.app import app
from dpprof.script.session import ScriptConfig, parse_command, run_command

SCRIPTS = Path(__file__).parent / "scripts"
runner = CliRunner()


def r512(n: int) -> int:
    return -(-n // 512) * 512


def folder_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working folder the script runs in, holding files of the user's (a checkpoint
    the script would overwrite)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "ema.pt").write_bytes(b"the user's EMA checkpoint\x00\x01")
    (folder / "notes.txt").write_text("keep me\n")
    monkeypatch.chdir(folder)
    return folder


def dpprof_run(work: Path, options: list[str], command: list[str]) -> tuple[int, str, dict]:
    """``dpprof run`` through the CLI: exit status, stderr, the JSON report; the working
    folder checked byte-identical after it."""
    before = folder_bytes(work)
    report = work.parent / "out" / "r.json"
    md, html = report.with_suffix(".md"), report.with_suffix(".html")
    r = runner.invoke(app, ["run", "--no-ladder", "-o", str(report), "-o", str(md),
                            "-o", str(html), *options, "--", *command])
    assert folder_bytes(work) == before
    data = json.loads(report.read_text())
    for other in (md, html):
        assert "ranks run: " in other.read_text()
    return r.exit_code, r.stderr, data


@pytest.mark.parametrize(("nproc", "options"), [("2", ["--ranks", "last"]),
                                               ("4", ["--ranks", "all"])])
def test_a_rank_that_raises_fails_the_run_with_its_status_and_line(
        work: Path, nproc: str, options: list[str]) -> None:
    status, stderr, data = dpprof_run(
        work, options, ["torchrun", "--nproc-per-node", nproc,
                        str(SCRIPTS / "ddp_rank_raises.py")])
    assert status == 1, stderr
    assert 'ddp_rank_raises.py", line 14, in check_shard' in stderr
    assert "[rank1]: ValueError: corrupt shard on rank 1 at step 1" in stderr
    assert "dpprof/" not in stderr
    s = data["scenarios"][0]
    assert s["status"] == "error"
    assert s["message"] == (f"rank 1 of {nproc}: the script raised ValueError: corrupt shard "
                            "on rank 1 at step 1")
    assert "line 14" in s["traceback"]
    assert data["config"]["ranks"]["failed"] == 1
    assert data["config"]["ranks"]["run"] == list(range(int(nproc)))


def test_a_non_zero_rank_that_calls_os_exit_fails_the_run_with_its_status(
        work: Path) -> None:
    """mp.spawn under python: the last rank ends its process with os._exit(3); dpprof goes
    on (its own process is not ended) and exits 3 with the line that called it."""
    status, stderr, data = dpprof_run(work, ["--ranks", "last"],
                                      ["python", str(SCRIPTS / "ddp_spawn_rank_exits.py")])
    assert status == 3, stderr
    assert 'ddp_spawn_rank_exits.py", line 24, in train' in stderr
    assert "[rank3]:     os._exit(3)" in stderr
    s = data["scenarios"][0]
    assert s["status"] == "error" and s["message"].startswith("rank 3 of 4: ")
    assert data["config"]["ranks"] == {"world": 4, "run": [0, 3], "taken_as": 3,
                                       "failed": 3}


def test_rank_0_only_work_is_cuda0s_excess(work: Path) -> None:
    """Rank 0 alone keeps an EMA of the model (Linear(256, 1024), Linear(1024, 256)) on its
    GPU: cuda:0 peaks above the others by the EMA's parameters; the others show rank 3's
    own peaks (rank 3 run, ranks 1 and 2 taken as it), and the note names the branch."""
    status, stderr, data = dpprof_run(
        work, ["--ranks", "last"],
        ["torchrun", "--nproc-per-node", "4", str(SCRIPTS / "ddp_rank0_ema.py")])
    assert status == 0, stderr
    s = data["scenarios"][0]
    assert s["name"] == "ddp" and s["status"] == "ok"
    peaks = [d["peak_allocated_bytes"] for d in s["devices"]]
    ema_bytes = r512(4 * 1024 * 256) + r512(4 * 1024) + r512(4 * 256 * 1024) + r512(4 * 256)
    assert peaks[1] == peaks[2] == peaks[3]
    assert peaks[0] - peaks[1] == ema_bytes
    assert data["config"]["ranks"] == {"world": 4, "run": [0, 3], "taken_as": 3}
    notes = " ".join(s["notes"])
    assert "ranks run: 0, 3 of 4" in notes and "ranks 1, 2 not run: taken to be as rank 3" in notes
    assert "cuda:0 (rank 0) peaks 2.00 MiB above cuda:3 (rank 3)" in notes
    assert "ddp_rank0_ema.py:20 (if dist.get_rank() == 0)" in notes
    assert data["comparison"]["verdict"]


def test_every_rank_run_and_rank_0_alone(work: Path) -> None:
    """--ranks all runs each rank (none taken as another); the default runs the last
    besides rank 0; --ranks none is rank 0 standing for all, as the report says (the EMA's
    excess is then on every GPU)."""
    cmd = ["torchrun", "--nproc-per-node", "3", str(SCRIPTS / "ddp_rank0_ema.py")]
    status, stderr, every = dpprof_run(work, ["--ranks", "all"], cmd)
    assert status == 0, stderr
    assert every["config"]["ranks"] == {"world": 3, "run": [0, 1, 2]}
    peaks = [d["peak_allocated_bytes"] for d in every["scenarios"][0]["devices"]]
    assert peaks[0] > peaks[1] == peaks[2]
    status, stderr, default = dpprof_run(work, [], cmd)  # the default over meta: last
    assert status == 0, stderr
    assert default["config"]["ranks"] == {"world": 3, "run": [0, 2], "taken_as": 2}
    assert "ranks run: 0, 2 of 3 (--ranks last)" in " ".join(default["scenarios"][0]["notes"])
    status, stderr, alone = dpprof_run(work, ["--ranks", "none"], cmd)
    assert status == 0, stderr
    assert alone["config"]["ranks"] == {"world": 3, "run": [0], "taken_as": 0}
    assert [d["peak_allocated_bytes"] for d in alone["scenarios"][0]["devices"]] == [peaks[0]] * 3
    assert "ranks 1, 2 not run: taken to be as rank 0" in " ".join(alone["scenarios"][0]["notes"])


def test_over_cpu_tensors_rank_0_stands_for_every_rank_by_default(work: Path) -> None:
    """--compute computes the model on the CPU in each rank's run: by default rank 0's run
    alone, as the report says."""
    status, stderr, data = dpprof_run(work, ["--compute"], [
        "torchrun", "--nproc-per-node", "2", str(SCRIPTS / "ddp_rank0_ema.py")])
    assert status == 0, stderr
    assert data["config"]["ranks"] == {"world": 2, "run": [0], "taken_as": 0}
    assert "ranks run: 0 of 2 (--ranks none)" in " ".join(data["scenarios"][0]["notes"])


def test_bad_ranks_is_one_line(work: Path) -> None:
    r = runner.invoke(app, ["run", "--ranks", "odd", "--", "torchrun", "--nproc-per-node",
                            "2", str(SCRIPTS / "ddp_rank0_ema.py")])
    assert r.exit_code == 2
    assert "--ranks 'odd': give last, all, none, or rank numbers such as 1,3" in r.stderr
    assert "Traceback" not in r.stderr


def test_fsdp2_recipe_runs_on_every_rank(work: Path) -> None:
    """pytorch/examples' FSDP2 recipe never sets its device (torch.accelerator.device_index
    called, not entered): on a GPU, DeviceMesh sets it from LOCAL_RANK, since CUDA is not
    initialised yet and the backend is NCCL. The emulation answers both as torch does, so
    each rank shards onto its own GPU (rank 3's all-gather landed on cuda:0 when
    torch.cuda.is_initialized() was always true and get_backend() said "fake")."""
    status, stderr, data = dpprof_run(
        work, ["--ranks", "all"],
        ["torchrun", "--nproc-per-node", "4", str(SCRIPTS / "fsdp2_meta_init.py")])
    assert status == 0, stderr
    assert data["config"]["ranks"] == {"world": 4, "run": [0, 1, 2, 3]}
    (s,) = data["scenarios"]
    assert s["name"] == "fsdp2" and s["status"] == "ok"
    assert "not measured" not in " ".join(s["notes"])
    peaks = [d["peak_allocated_bytes"] for d in s["devices"]]
    assert peaks[0] == peaks[1] == peaks[2] == peaks[3] > 0


SAVE_BARRIER_LOAD = """\
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
model = DDP(nn.Linear(10, 5).cuda())
os.makedirs("shared", exist_ok=True)
path = os.path.join("shared", "model.checkpoint")
if rank == 0:  # the DDP tutorial's demo_checkpoint, with a vocabulary file beside it
    torch.save({"step": 7, "model": model.state_dict()}, path + ".tmp")
    os.replace(path + ".tmp", path)  # an atomic save
    with open("shared/vocab.txt", "w") as f:
        f.write("a b c\\n")
dist.barrier()
state = torch.load(path, map_location={"cuda:0": f"cuda:{rank}"})
with open("shared/vocab.txt") as f:
    vocab = f.read().split()
if state["step"] != 7 or vocab != ["a", "b", "c"]:
    raise SystemExit(f"rank {rank} read {state['step']} {vocab}")
model.load_state_dict(state["model"])
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(20, 10, device="cuda")).sum().backward()
    opt.step()
with open(f"rank{rank}.log", "w") as f:
    f.write("done\\n")
dist.barrier()
if rank == 0 and sys.argv[1:] != ["keep"]:
    os.remove(path)
    os.remove("shared/vocab.txt")
dist.destroy_process_group()
"""


@pytest.mark.parametrize("keep", [False, True])
def test_a_later_rank_reads_the_files_rank_0_saved_before_a_barrier(
        work: Path, tmp_path: Path, keep: bool) -> None:
    # the ranks share a filesystem: rank 3's run reads the checkpoint rank 0's run saved
    # (removed at its end, or kept), and lists only its own writes; the user's folder is as
    # it was
    script = tmp_path / "save_barrier_load.py"
    script.write_text(SAVE_BARRIER_LOAD)
    code, err, data = dpprof_run(work, ["--steps", "10", "--ranks", "last"], [
        "torchrun", "--nproc-per-node", "4", str(script), *(["keep"] if keep else [])])
    assert code == 0, err
    assert data["config"]["ranks"]["run"] == [0, 3]
    assert "failed" not in data["config"]["ranks"]
    assert data["config"]["steps_done"] == {"as-written": 3, "as-written rank 3": 3}
    by_run: dict[str, set[tuple[str, str]]] = {}
    for w in data["writes"]:
        by_run.setdefault(w["run"], set()).add((w["path"], w["kind"]))
    kept = {("shared/model.checkpoint", "file"), ("shared/vocab.txt", "file")} if keep else set()
    assert by_run["as-written"] == {("shared", "folder"), ("rank0.log", "file"), *kept}
    # the folder and files rank 0 made are there for rank 3 already: not its writes
    assert by_run["as-written rank 3"] == {("rank3.log", "file")}
    assert not (work / "shared").exists()


RANK_0_DECIDES = """\
import os
import uuid

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
# rank 0 names the run and draws its seed; the others are told
chosen = ([f"run-{uuid.uuid4().hex[:8]}", int.from_bytes(os.urandom(4), "little")]
          if rank == 0 else [None, None])
dist.broadcast_object_list(chosen, src=0)
name, seed = chosen
if name is None:
    raise SystemExit(f"rank {rank} was not told the run's name")
if rank == 0:
    os.makedirs(name)
    with open(os.path.join(name, "seed.txt"), "w") as f:
        f.write(str(seed))
dist.barrier()
with open(os.path.join(name, "seed.txt")) as f:  # the folder rank 0 named
    assert int(f.read()) == seed, "another run's seed"
torch.manual_seed(seed)
# a tensor among the objects: not carried (its values are emulated)
held = [torch.zeros(4, device="cuda")] if rank == 0 else [None]
dist.broadcast_object_list(held, src=0)
# a tensor broadcast: each rank keeps its own tensor (the collective completes at once)
width = torch.tensor([64 if rank == 0 else 1], device="cuda")
dist.broadcast(width, src=0)
model = DDP(nn.Linear(16, 16).cuda())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(8, 16, device="cuda")).sum().backward()
    opt.step()
dist.destroy_process_group()
"""


def test_later_ranks_receive_what_rank_0_broadcast(work: Path, tmp_path: Path) -> None:
    """Rank 0 names the run (a folder it makes before a barrier, read by every rank) and
    draws a seed: rank 3's run is given rank 0's objects at the same call and finds the
    folder; objects that hold a tensor are not carried, and the report says so."""
    script = tmp_path / "rank_0_decides.py"
    script.write_text(RANK_0_DECIDES)
    code, err, data = dpprof_run(work, ["--ranks", "last"], [
        "torchrun", "--nproc-per-node", "4", str(script)])
    assert code == 0, err
    ranks = data["config"]["ranks"]
    assert ranks["run"] == [0, 3] and "failed" not in ranks
    assert data["config"]["steps_done"] == {"as-written": 3, "as-written rank 3": 3}
    notes = " ".join(data["scenarios"][0]["notes"])
    assert ("rank 3's broadcast_object_list: 1 of 2 call(s) received rank 0's objects as "
            "its run sent them; its own objects kept (counted as values made up) at call 2: "
            "rank 0's objects hold a tensor (its values are emulated)") in notes
    # rank 3 wrote nothing: the run's folder and seed are rank 0's writes alone
    folders = {w["path"] for w in data["writes"] if w["run"] == "as-written rank 3"}
    assert folders == set()


def test_broadcasts_that_diverge_keep_the_rank_s_own_objects() -> None:
    """Calls that do not match rank 0's (another sender, another count, more calls) leave
    the rank's own objects, each said."""
    from dpprof.script.rank_broadcasts import Broadcasts

    b = Broadcasts()
    b.record(0, ["name", 7])
    b.record(1, [None])  # rank 0 received this one
    b.record(0, [lambda: 0])  # not picklable
    first, second, third, fourth = [None, None], [None], [None], [None]
    assert b.receive(2, 0, first) and first == ["name", 7]
    assert not b.receive(2, 0, second) and second == [None]
    assert not b.receive(2, 0, third) and third == [None]
    assert not b.receive(2, 0, fourth)
    (note,) = b.notes(2)
    assert note.startswith("rank 2's broadcast_object_list: 1 of 4 call(s) received")
    assert "call 2: 1 object(s) from rank 0 where rank 0's was 1 from rank 1" in note
    assert "call 3: rank 0's objects could not be pickled" in note
    assert "call 4: rank 0 made 3 such call(s)" in note
    assert b.receive(1, 1, [None]) is False  # a sender keeps what it sends


REMOVED_OUTSIDE_PYTHON = """\
import ctypes
import os
import subprocess

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
model = DDP(nn.Linear(10, 5).cuda())
if rank == 0:
    torch.save({"step": 7, "model": model.state_dict()}, "model.checkpoint")
    with open("vocab.txt", "w") as f:
        f.write("a b c\\n")
    subprocess.run(["sh", "-c", "echo 3 > epoch.txt"], check=True)  # written outside Python
dist.barrier()
state = torch.load("model.checkpoint", map_location={"cuda:0": f"cuda:{rank}"})
with open("vocab.txt") as f:
    vocab = f.read().split()
with open("epoch.txt") as f:
    epoch = int(f.read())
if state["step"] != 7 or vocab != ["a", "b", "c"] or epoch != 3:
    raise SystemExit(f"rank {rank} read {state['step']} {vocab} {epoch}")
model.load_state_dict(state["model"])
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(20, 10, device="cuda")).sum().backward()
    opt.step()
dist.barrier()
if rank == 0:  # removed outside Python: a subprocess, and the C library through ctypes
    subprocess.run(["rm", "model.checkpoint", "epoch.txt"], check=True)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unlink(b"vocab.txt") != 0:
        raise OSError(ctypes.get_errno(), "unlink vocab.txt")
dist.destroy_process_group()
"""


def test_a_later_rank_reads_files_rank_0_removed_outside_python(tmp_path: Path) -> None:
    """Rank 0 saves a checkpoint and a vocabulary (Python) and an epoch file (a shell),
    the ranks read them after a barrier, and rank 0 removes them at its end with ``rm`` and
    the C library's ``unlink``: rank 3's run reads them as rank 0's run left them before it
    removed them, as it does where rank 0 removes them through Python. The kernel's overlay
    only: on the Python line alone, code outside Python never sees the run's files."""
    from test_seal_lines import dpprof, kernel_line

    if (why := kernel_line()) is not None:
        pytest.skip(f"no mount namespace on this machine: {why}")
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "train.py").write_text(REMOVED_OUTSIDE_PYTHON)
    before = folder_bytes(folder)
    done = dpprof(["-q", "--no-ladder", "--steps", "10", "--ranks", "last", "-o",
                   str(tmp_path / "r.json"), "--", "torchrun", "--nproc-per-node", "4", "train.py"], folder,
                  namespace=True)
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["config"]["ranks"]["run"] == [0, 3] and "failed" not in data["config"]["ranks"]
    assert data["config"]["steps_done"] == {"as-written": 3, "as-written rank 3": 3}
    assert not any(w["run"] == "as-written rank 3" for w in data["writes"])
    assert folder_bytes(folder) == before


TWO_D_MESH = """
import os
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
tp = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
w = torch.nn.Parameter(DTensor.from_local(torch.randn(4, 8, device="cuda"), tp, [Shard(0)]))
opt = torch.optim.SGD([w], lr=0.1)
for _ in range(3):
    y = (w * 2).redistribute(tp, [Replicate()])  # the product's spec: sharding propagation
    y.to_local().sum().backward()
    opt.step()
"""


def test_each_rank_over_a_2d_mesh_asks_its_own_process_groups(work: Path) -> None:
    """Ranks 2 and 3 of a 2x2 mesh are in another tensor-parallel group than ranks 0 and 1.
    DTensor caches what its ops' sharding gives, keyed by the mesh's layout, which is every
    rank's: a rank run after rank 0 in the same process must start without rank 0's
    entries, as its own process would (they name rank 0's group, which rank 2 is not in:
    "Could not resolve the process group registered under the name 3" before)."""
    (work / "mesh.py").write_text(TWO_D_MESH)
    status, stderr, data = dpprof_run(
        work, ["--ranks", "all"], ["torchrun", "--nproc-per-node", "4", "mesh.py"])
    assert status == 0, stderr
    assert data["config"]["ranks"]["run"] == [0, 1, 2, 3]
    assert "failed" not in data["config"]["ranks"]
    (s,) = data["scenarios"]
    assert s["status"] == "ok"
    peaks = [d["peak_allocated_bytes"] for d in s["devices"]]
    assert peaks[0] == peaks[1] == peaks[2] == peaks[3] > 0


def test_a_distributed_checkpoint_is_saved_and_loaded_back_on_every_rank(work: Path) -> None:
    """``torch.distributed.checkpoint`` over FSDP2's sharded state (PyTorch's DCP recipe: a
    Stateful app state beside a plain epoch): each rank's save agrees a plan with the others,
    which ranks run one after another cannot (the gathered plans held one rank's shards in
    every slot: "invalid fill"). The save is a stand-in in the overlay and the load reads the
    plain values back, as on a GPU; the script's own checks pass on every rank."""
    status, stderr, data = dpprof_run(
        work, ["--ranks", "all", "--steps", "10"],
        ["torchrun", "--nproc-per-node", "2", str(SCRIPTS / "fsdp2_distributed_checkpoint.py")])
    assert status == 0, stderr
    (s,) = data["scenarios"]
    assert s["status"] == "ok", s["notes"]
    notes = " ".join(s["notes"])
    assert "torch.distributed.checkpoint.save step-4" in notes
    assert "read back as the run saved it, as on a GPU: torch.distributed.checkpoint.load" in notes
    peaks = [d["peak_allocated_bytes"] for d in s["devices"]]
    # each rank holds half of every weight and bias and AdamW's two moments of it
    params = 1024 * 4096 + 4096 + 4096 * 1024 + 1024
    assert peaks[0] == peaks[1] >= 3 * 4 * params // 2
    assert not (work / "checkpoints").exists()


def test_loading_a_distributed_checkpoint_never_saved_fails_as_on_a_gpu(work: Path) -> None:
    """A load from a folder that holds no checkpoint is torch's own: it raises
    CheckpointException (a BaseException), which is the script's failure, with what was
    measured before it and the first line of torch's message, not a dpprof error that
    measured nothing."""
    before = folder_bytes(work)
    report = work.parent / "r.json"
    r = runner.invoke(app, ["run", "--no-ladder", "--steps", "10", "-o", str(report), "--",
                            "torchrun", "--nproc-per-node", "2",
                            str(SCRIPTS / "fsdp2_distributed_checkpoint.py"), "missing"])
    assert r.exit_code == 1
    assert folder_bytes(work) == before
    (s,) = json.loads(report.read_text())["scenarios"]
    assert s["status"] == "error"
    assert s["message"] == ("the script raised CheckpointException: CheckpointException "
                            "ranks:dict_keys([0, 1]) (more in the traceback)")
    assert "No such file or directory" in s["traceback"]
    assert s["devices"][0]["peak_allocated_bytes"] > 0


def test_ddp_s_bf16_compression_hook_is_accepted_as_on_a_cuda_build(work: Path) -> None:
    """DDP accepts its bf16 compression hook only where ``torch.version.cuda`` names a CUDA
    and NCCL is 2.10 or later; the CPU build says None and has no NCCL, so the script that
    runs on the GPU failed here. The virtual GPUs answer as the CUDA build of this torch
    does, and the hook's half-size copy of each bucket is counted on each rank."""
    status, stderr, data = dpprof_run(
        work, ["--ranks", "all"],
        ["torchrun", "--nproc-per-node", "2", str(SCRIPTS / "ddp_bf16_hook.py")])
    assert status == 0, stderr
    (s,) = data["scenarios"]
    assert s["name"] == "ddp" and s["status"] == "ok"
    peaks = [d["peak_allocated_bytes"] for d in s["devices"]]
    weights = r512(512 * 512 * 4) + r512(512 * 4)
    # the weights, their gradients, DDP's bucket of them, and the bucket's bf16 copy
    assert peaks[0] == peaks[1] >= 3 * weights + weights // 2


KEYWORDS_ONLY = """\
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(32, 4)

    def forward(self, features=None, labels=None):
        return nn.functional.cross_entropy(self.body(features), labels)


dist.init_process_group("nccl")
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
model = fully_shard(Classifier().cuda())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(4):
    batch = {"features": torch.randn(12, 32), "labels": torch.randint(0, 4, (12,))}
    loss = model(**{k: v.cuda() for k, v in batch.items()})  # Hugging Face's model(**batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
dist.destroy_process_group()
"""


def test_the_batch_of_a_model_called_with_keywords_only_is_its_rows(work: Path) -> None:
    """A model called with its inputs by keyword alone (``model(**batch)``, as Hugging
    Face's Trainer calls it), sharded by FSDP2 (no wrapper module that sees the inputs),
    gives no tensor to a global forward pre-hook: the batch was reported as 0 and the
    samples a second as 0. It is read after the forward, from the
    keywords: 12 rows a rank, 24 over the two."""
    (work / "train.py").write_text(KEYWORDS_ONLY)
    status, stderr, data = dpprof_run(work, [], ["torchrun", "--nproc-per-node", "2",
                                                 "train.py"])
    assert status == 0, stderr
    (s,) = data["scenarios"]
    assert s["status"] == "ok"
    assert s["batch"] == 24 and [d["batch_rows"] for d in s["devices"]] == [12, 12]
    assert s["predicted_samples_per_s"] > 0


def _run_pipeline(work: Path, nproc: int, args: list[str]) -> tuple[int, str, dict]:
    """``dpprof run --ranks all`` of tests/scripts/pipeline_two_stages.py: exit status,
    stderr, the JSON report; the working folder checked byte-identical after it."""
    before = folder_bytes(work)
    report = work.parent / "r.json"
    r = runner.invoke(app, ["run", "--no-ladder", "--ranks", "all", "-o", str(report), "--",
                            "torchrun", "--nproc-per-node", str(nproc),
                            str(SCRIPTS / "pipeline_two_stages.py"), *args])
    assert folder_bytes(work) == before
    return r.exit_code, r.stderr, json.loads(report.read_text())


@pytest.mark.parametrize(("args", "message"), [
    ([], "dpprof run: pipeline parallelism across ranks (torch.distributed.pipelining) is "
         "not emulated"),
    (["objects"], "dpprof run: recv_object_list (objects sent by another rank while both "
                  "run) is not emulated")])
def test_what_one_rank_receives_from_another_while_both_run_is_refused_in_one_line(
        work: Path, args: list[str], message: str) -> None:
    """A pipeline's stages (and any rank's recv_object_list) wait for bytes another rank
    sends while both run; each emulated rank runs on its own, so they never come. The run
    stops there naming dpprof, not with torch's unpickling error read as the script's."""
    status, stderr, data = _run_pipeline(work, 2, args)
    assert status == 1
    (s,) = data["scenarios"]
    assert s["status"] == "error" and message in s["message"]  # ("rank 1 of 2: " first)
    assert "Unpickling" not in stderr and s["devices"][0]["peak_allocated_bytes"] > 0


def test_a_pipeline_stage_over_one_rank_runs(work: Path) -> None:
    status, stderr, data = _run_pipeline(work, 1, [])
    assert status == 0, stderr
    (s,) = data["scenarios"]
    assert s["status"] == "ok" and s["devices"][0]["peak_allocated_bytes"] > 0


@pytest.mark.parametrize(("where", "imported"), [
    ("helper.py", "import helper"),
    ("lib/__init__.py", "from lib import helper"),  # a package
    ("lib/helper.py", "from lib import helper"),  # a namespace package (KAIR's utils/)
])
def test_each_rank_imports_the_scripts_own_modules_afresh(tmp_path: Path, where: str,
                                                          imported: str) -> None:
    """A module of the script's own keeps its state for its process: a later rank (another
    process on a GPU machine) starts with it as imported, not as the last rank left it
    (torchtitan's CUDA graph manager held rank 0's stream and pool). So does a module of a
    namespace package, a folder without ``__init__.py``, whose package the next run found
    holding the last run's module (whose classes then did not pickle by name: "it's not the
    same object as utils.utils_option.NoneDict", KAIR's DataLoader workers under torchrun)."""
    (tmp_path / "lib").mkdir()
    (tmp_path / where).write_text("STATE = {}\n\n\nclass Options(dict):\n    pass\n")
    if where == "lib/__init__.py":
        (tmp_path / "lib" / "helper.py").write_text("from lib import STATE, Options\n")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os
        import pickle
        import torch
        import torch.distributed as dist
        IMPORTED

        rank = int(os.environ["RANK"])
        assert "rank" not in helper.STATE, f"found rank {helper.STATE['rank']}'s state"
        helper.STATE["rank"] = rank
        pickle.dumps(helper.Options(rank=rank))  # by its module's name, as spawn does
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8).cuda())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(4, 8, device="cuda")).sum().backward()
        opt.step()
    """).replace("IMPORTED", imported))
    result, main = run_command(ScriptConfig(
        launch=parse_command(["torchrun", "--nproc-per-node", "2", str(script)], 2), gpus=2,
        ranks="all"), alternatives=False)
    assert main.exit_status == 0, main.script_traceback
    assert [r.exit_status for r in main.rank_runs] == [0], [
        r.script_traceback for r in main.rank_runs]
    assert result.scenarios[0].status == "ok", result.scenarios[0].message
