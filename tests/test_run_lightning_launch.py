"""Lightning's own launchers under a plain ``python`` (dpprof.script.lightning_launch):
``Trainer(strategy="ddp", devices=4)`` and ``Fabric(strategy="ddp", devices=4).launch()``
start their other ranks as real processes (their ``_SubprocessScriptLauncher``); under
``dpprof run`` none starts: rank 0 runs in dpprof's process, the other ranks as ``--ranks``
says, each with the environment Lightning gives its process, all sealed. Fabric's
``ddp_spawn`` / ``ddp_notebook`` go through ``mp.start_processes``, played in place.

Each run is a ``dpprof run`` process of its own (as tests/test_run_framework_scripts.py
runs Lightning): a process log written by every Python process that starts (a
``sitecustomize`` on ``PYTHONPATH``) shows which processes ran the script."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_seal_run import digest_tree

SCRIPTS = Path(__file__).parent / "scripts"

SITECUSTOMIZE = """\
import os, sys
with open(os.environ["PROCESS_LOG"], "a") as log:
    log.write(" ".join(sys.orig_argv) + "\\n")
from torchvision_shim import import_torchvision
import_torchvision()
"""


def r512(n: int) -> int:
    return -(-n // 512) * 512


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A working folder holding a file of the user's, outside the repository."""
    if importlib.util.find_spec("lightning") is None:  # not imported: torchmetrics imports
        pytest.skip("lightning is not installed (the zoo extra)")  # torchvision, shimmed
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "last.ckpt").write_bytes(b"the user's checkpoint of yesterday")
    return folder


def dpprof_run(work: Path, options: list[str], script: str, args: list[str],
               namespace: bool) -> tuple[subprocess.CompletedProcess[str], dict, list[str]]:  # type: ignore[type-arg]
    """``dpprof run --gpus 4 OPTIONS -- python SCRIPT ARGS`` in ``work``, in a process of its
    own (``namespace``: False sets DPPROF_NO_NAMESPACE, the audit hook's seal): the process,
    the JSON report and every Python process's command line; the working folder and the
    scripts' folder checked byte-identical after it."""
    site = work.parent / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = work.parent / "processes.log"
    log.write_text("")
    env = {**os.environ, "PROCESS_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(site), str(Path(__file__).parent)])}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("DPPROF_NO_NAMESPACE", None)
    if not namespace:
        env["DPPROF_NO_NAMESPACE"] = "1"
    out = work.parent / "r.json"
    before = digest_tree(work), digest_tree(SCRIPTS)
    done = subprocess.run([sys.executable, "-m", "dpprof", "run", "--gpus", "4", "--no-ladder",
                           "-o", str(out), *options, "--", "python", str(SCRIPTS / script),
                           *args], cwd=work, env=env, capture_output=True, text=True,
                          timeout=600)
    assert (digest_tree(work), digest_tree(SCRIPTS)) == before
    return done, json.loads(out.read_text()), log.read_text().splitlines()


def script_processes(processes: list[str], script: str) -> list[str]:
    """The processes whose program was ``script`` (not dpprof's, which names it after --)."""
    return [p for p in processes if script in p and " -m dpprof " not in p]


@pytest.mark.slow
def test_trainer_strategy_ddp_under_python_runs_every_rank_emulated_and_sealed(
        work: Path) -> None:
    """``lightning_ddp.py``: Trainer(strategy="ddp", devices=4) from a plain python, on the
    audit hook's line: no process runs the script but dpprof's; the four ranks each run
    as their own emulated process on their own GPU, each with DDP's state for
    LitClassifier's three Linear layers; the report names the launcher followed."""
    done, result, processes = dpprof_run(work, ["--steps", "3", "--ranks", "all"],
                                         "lightning_ddp.py", ["--batch-size", "32"],
                                         namespace=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert len(processes) == 1 and " -m dpprof run " in processes[0], processes
    assert script_processes(processes, "lightning_ddp.py") == []
    assert result["seal"]["subprocesses"] == [] and result["seal"]["lines"][1] == "audit hook"
    assert not [n for n in result["notes"] if "started subprocesses" in n]
    ranks = result["config"]["ranks"]
    assert ranks == {"world": 4, "run": [0, 1, 2, 3],
                     "started_by": "Lightning's Trainer (its _SubprocessScriptLauncher)"}
    assert set(result["config"]["steps_done"].values()) == {3}
    (ddp,) = result["scenarios"]
    assert ddp["name"] == "ddp" and ddp["status"] == "ok", ddp
    assert ddp["batch"] == 128 and [d["batch_rows"] for d in ddp["devices"]] == [32] * 4
    assert [d["rank"] for d in ddp["devices"]] == [0, 1, 2, 3]
    # by hand: Linear(64, 256), Linear(256, 256), Linear(256, 10), float32, each storage
    # its own block; AdamW's exp_avg and exp_avg_sq; DDP's one bucket (85,002 floats, under
    # its 1 MiB first bucket) and the first iteration's bucket its rebuild replaced
    sizes = (64 * 256, 256, 256 * 256, 256, 256 * 10, 10)
    params_bytes = sum(r512(4 * n) for n in sizes)
    bucket_bytes = r512(4 * sum(sizes))
    for d in ddp["devices"]:
        b = d["breakdown_bytes"]
        assert b["parameters"] == params_bytes and b["gradients"] == params_bytes, d
        assert b["optimizer_state"] == 2 * params_bytes
        assert b["communication"] == 2 * bucket_bytes
        assert d["transient_bytes"] == {"ddp_unreaped_buckets": bucket_bytes}
        assert d["peak_phase"] == "backward (step 3)"
    # rank 0 and the three others ran the same code: the same peak, each measured
    assert len({d["peak_allocated_bytes"] for d in ddp["devices"]}) == 1
    assert output.count("first batch: (32, 64) per rank, 4 ranks") == 1, output
    launched = [n for n in ddp["notes"] if "starts the script's other ranks itself" in n]
    assert launched and "asked for local ranks 1 to 3" in launched[0]
    # rank 0's ModelCheckpoint wrote into the overlay; the user's last.ckpt stands (above)
    written = {(w["run"], w["path"]) for w in result["writes"]}
    assert ("as-written", "checkpoints/epoch=0-step=2.ckpt") in written


@pytest.mark.slow
def test_fabric_launch_under_python_plays_its_launcher_on_the_default_line(
        work: Path) -> None:
    """``fabric_ddp.py``: Fabric(strategy="ddp", devices=4).launch(), the seal's default
    line: rank 0 and the last rank run, none as a process of its own; Fabric's checkpoint
    goes into the overlay."""
    done, result, processes = dpprof_run(work, ["--steps", "5", "--ranks", "last"],
                                         "fabric_ddp.py", ["--out", "checkpoints"],
                                         namespace=True)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert script_processes(processes, "fabric_ddp.py") == [], processes
    assert result["seal"]["subprocesses"] == []
    assert result["config"]["ranks"] == {
        "world": 4, "run": [0, 3], "taken_as": 3,
        "started_by": "Lightning's Fabric (its _SubprocessScriptLauncher)"}
    assert result["config"]["steps_done"] == {"as-written": 5, "as-written rank 3": 5}
    (ddp,) = result["scenarios"]
    assert ddp["name"] == "ddp" and ddp["status"] == "ok", ddp
    assert [d["batch_rows"] for d in ddp["devices"]] == [16] * 4
    # Linear(32, 512), Linear(512, 512), Linear(512, 1); Adam's two moments
    sizes = (32 * 512, 512, 512 * 512, 512, 512, 1)
    params_bytes = sum(r512(4 * n) for n in sizes)
    for d in ddp["devices"]:
        b = d["breakdown_bytes"]
        assert b["parameters"] == params_bytes and b["gradients"] == params_bytes, d
        assert b["optimizer_state"] == 2 * params_bytes
    assert output.count("rows per rank: 16, world size: 4") == 1, output
    written = {(w["run"], w["path"]) for w in result["writes"]}
    assert ("as-written", "checkpoints/step-4.ckpt") in written


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_notebook"])
def test_fabric_spawn_strategies_run_their_ranks_in_place_to_the_script_s_end(
        work: Path, strategy: str) -> None:
    """``ddp_spawn`` / ``ddp_notebook`` (mp.start_processes, spawn or fork) with a script
    that ends before --steps: each rank's process ends with its function (rank 3's run
    does not wait for rank 0's results); no process runs the script."""
    done, result, processes = dpprof_run(
        work, ["--steps", "50", "--ranks", "last"], "fabric_ddp.py",
        ["--strategy", strategy, "--steps", "6", "--out", "checkpoints"], namespace=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert script_processes(processes, "fabric_ddp.py") == [], processes
    assert result["config"]["ranks"] == {"world": 4, "run": [0, 3], "taken_as": 3}
    assert result["config"]["steps_done"] == {"as-written": 6, "as-written rank 3": 6}
    (ddp,) = result["scenarios"]
    assert ddp["status"] == "ok" and len({d["peak_allocated_bytes"]
                                          for d in ddp["devices"]}) == 1, ddp
    assert output.count("done after 6 steps") == 1, output
    assert [n for n in ddp["notes"] if n.startswith(
        "the ranks are started by torch.multiprocessing.start_processes with lightning.fabric."
        "strategies.launchers.multiprocessing's _MultiProcessingLauncher._wrapping_function "
        f"(start method {'spawn' if strategy == 'ddp_spawn' else 'fork'})")], ddp["notes"]


HYDRA_APP = '''\
import os

import hydra
import lightning as L
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(16, 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@hydra.main(version_base=None, config_path=None, config_name=None)
def main(cfg: DictConfig) -> None:
    with open("where.txt", "a") as f:  # in Hydra's run folder (hydra.job.chdir=True)
        f.write(f"{os.environ.get('LOCAL_RANK', '0')} {os.getcwd()}\\n")
    data = TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
    trainer = L.Trainer(strategy="ddp", devices=4, accelerator="gpu", max_steps=3,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Lit(), DataLoader(data, batch_size=16))


if __name__ == "__main__":
    main()
'''


def test_a_hydra_app_s_ranks_run_as_lightning_starts_them(tmp_path: Path) -> None:
    """Under Hydra, Lightning starts each child in Hydra's original working directory with
    Hydra's run folder and a job name of its own (``train_ddp_process_<local rank>``):
    rank 3's run is started so, in the run folder rank 0 ran in (where it logs its job as
    rank 3's, not as the first child's)."""
    if importlib.util.find_spec("hydra") is None or importlib.util.find_spec("lightning") is None:
        pytest.skip("hydra-core and lightning are not installed (the test and zoo extras)")
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(HYDRA_APP)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "from torchvision_shim import import_torchvision\nimport_torchvision()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(Path(__file__).parent)])}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, "-m", "dpprof", "run", "-q", "--gpus", "4",
                           "--no-ladder", "--ranks", "last", "-o", str(out), "--", "python",
                           "train.py", "hydra.job.chdir=True", "hydra.run.dir=outputs/run1"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["config"]["ranks"]["run"] == [0, 3]
    writes = {(w["run"], w["path"]) for w in result["writes"] if w["kind"] == "file"}
    assert ("as-written", "outputs/run1/where.txt") in writes
    assert {p for r, p in writes if r == "as-written rank 3"} == {
        "outputs/run1/where.txt", "outputs/run1/train_ddp_process_3.log"}
    assert sorted(os.listdir(work)) == ["train.py"]


@pytest.mark.slow
def test_fabric_model_parallel_built_on_meta_runs_every_rank_of_its_2d_mesh(
        work: Path) -> None:
    """``fabric_model_parallel.py``: Fabric's ModelParallelStrategy over a 2x2 mesh, the
    model built under ``init_module(empty_init=True)`` and sharded by tensor parallelism,
    then FSDP2. The model is on meta until Fabric materialises it on each GPU (it was built
    on the host before: Lightning's 7B example was killed at 24 GB of host memory), and
    ranks 2 and 3, whose tensor-parallel group is not rank 0's, run to the end (they
    were handed rank 0's group by DTensor's caches). Each GPU holds a quarter of every
    weight, and AdamW's two moments of that quarter."""
    done, result, processes = dpprof_run(work, ["--steps", "3", "--ranks", "all"],
                                         "fabric_model_parallel.py", [], namespace=True)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert script_processes(processes, "fabric_model_parallel.py") == [], processes
    assert result["config"]["ranks"]["run"] == [0, 1, 2, 3]
    assert "failed" not in result["config"]["ranks"]
    (s,) = result["scenarios"]
    assert s["status"] == "ok", s
    # up: Linear(256, 1024) by columns, down: Linear(1024, 256) by rows over the tensor-
    # parallel pair (down's bias whole), each then halved by FSDP2 over the other pair
    quarter = (r512(4 * 256 * 256) + r512(4 * 256)          # up's weight and bias
               + r512(4 * 128 * 512) + r512(4 * 128))        # down's weight and bias
    peaks = set()
    for d in s["devices"]:
        assert d["breakdown_bytes"]["optimizer_state"] == 2 * quarter, d
        peaks.add(d["peak_allocated_bytes"])
    assert len(peaks) == 1
