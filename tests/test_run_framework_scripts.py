"""``dpprof run --gpus 4`` on training scripts written in the style of the frameworks'
own examples (tests/scripts/): timm's ``train.py`` (timm's registry, dataset, loader,
optimizer factory and ``CheckpointSaver``; DataParallel) and torchvision's classification
reference (``ImageFolder``, ``torchvision.models``, ``save_on_master``; DDP under
torchrun, DataParallel otherwise), each over an image folder of PNGs the test draws.

Each run goes through the command line from a working folder outside the repository, with
a checkpoint of the user's already in the output folder: it exits 0, the script's own
output is shown once, the working folder (images and checkpoint) and the scripts' folder
are byte-identical after, and the parameters', gradients' and optimizer state's bytes are
counted by hand from the model's parameter shapes: float32, each storage rounded up to
512 B as the CUDA caching allocator rounds it; DataParallel's copies between GPUs are
flat buffers of at most 10 MiB (``comm.broadcast_coalesced`` / ``reduce_add_coalesced``
with ``DataParallel``'s ``buffer_size``), each rounded so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_seal_run import digest_tree
from typer.testing import CliRunner

from dpprof.cli.app import app

SCRIPTS = Path(__file__).parent / "scripts"
COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200)]
DATA_PARALLEL_BUFFER_BYTES = 10 * 1024 * 1024  # nn.DataParallel's comm buffer_size


def r512(n: int) -> int:
    return -(-n // 512) * 512


def per_storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Each tensor in its own block, as ``.to("cuda")`` and ``zeros_like`` allocate them."""
    return sum(r512(t.numel() * t.element_size()) for t in tensors)


def flat_chunks_bytes(tensors: list[torch.Tensor]) -> int:
    """The flat buffers ``torch._utils._take_tensors`` packs the tensors into, in order, a
    new one started when the next tensor would take it past DataParallel's buffer size."""
    chunks, current = [], 0
    for t in tensors:
        size = t.numel() * t.element_size()
        if current and current + size > DATA_PARALLEL_BUFFER_BYTES:
            chunks.append(current)
            current = 0
        current += size
    return sum(r512(c) for c in [*chunks, current] if c)


def image_folder(root: Path, splits: dict[str, int]) -> None:
    """Three classes of solid-colour 40x40 PNGs, ``splits[name]`` per class."""
    from PIL import Image

    for split, per_class in splits.items():
        for c, colour in enumerate(COLOURS):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(per_class):
                shade = tuple(x + 10 * i for x in colour)
                Image.new("RGB", (40, 40), shade).save(folder / f"{i}.png")


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working folder outside the repository, torchvision importable in this process
    (its C ops do not load over a CPU torch; the scripts import it, or timm does)."""
    from torchvision_shim import import_torchvision

    try:
        import_torchvision()
    except Exception as e:  # pragma: no cover - no torchvision installed
        pytest.skip(f"torchvision unavailable: {e}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    folder = tmp_path / "work"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


def run_cli(work: Path, command: list[str]) -> tuple[dict, str]:  # type: ignore[type-arg]
    """``dpprof run --gpus 4 --steps 3 -o r.json -- command``: the result and the output."""
    out = work.parent / "r.json"
    before = digest_tree(work), digest_tree(SCRIPTS)
    r = CliRunner().invoke(app, ["run", "--gpus", "4", "--steps", "3", "--ranks", "none",
                                 "-o", str(out), "--", *command])
    assert r.exit_code == 0, r.output
    assert (digest_tree(work), digest_tree(SCRIPTS)) == before
    return json.loads(out.read_text()), r.output


def scenario(result: dict, name: str) -> dict:  # type: ignore[type-arg]
    (s,) = [s for s in result["scenarios"] if s["name"] == name]
    assert s["status"] == "ok", s
    return s  # type: ignore[no-any-return]


def breakdowns(s: dict) -> list[dict[str, int]]:  # type: ignore[type-arg]
    return [d["breakdown_bytes"] for d in s["devices"]]


def test_a_timm_style_train_py_under_data_parallel(work: Path) -> None:
    import timm

    pytest.importorskip("PIL")
    image_folder(work / "data", {"train": 6, "validation": 2})
    (work / "output").mkdir()
    (work / "output" / "last.pth.tar").write_bytes(b"the user's checkpoint of yesterday")
    result, output = run_cli(work, ["python", str(SCRIPTS / "timm_style_train.py"),
                                    "--data-dir", "data", "-b", "8", "--img-size", "64",
                                    "-j", "0"])
    # the script's own lines, once (not once per alternative run)
    assert output.count("Model test_resnet created, param count: 372979") == 1, output
    assert output.count("Train: 0 [   0/2]") == 1 and output.count("epoch 0: train loss") == 1
    assert [s["name"] for s in result["scenarios"]] == ["dp-loss-primary", "dp-loss-forward",
                                                       "ddp"]
    assert result["batch"] == 8
    model = timm.create_model("test_resnet", pretrained=False, num_classes=3)
    params = list(model.parameters())
    params_bytes = per_storage_bytes(params)
    model_bytes = params_bytes + per_storage_bytes(list(model.buffers()))
    for name in ("dp-loss-primary", "dp-loss-forward"):
        cuda0, *replicas = breakdowns(scenario(result, name))
        # cuda:0 holds the model (BatchNorm's running statistics with it), SGD's momentum,
        # the parameters' .grad and the flat buffer the replicas' gradients are summed into
        assert cuda0["parameters"] == model_bytes
        assert cuda0["optimizer_state"] == params_bytes
        assert cuda0["gradients"] == params_bytes + flat_chunks_bytes(params)
        for replica in replicas:
            # the parameters broadcast as one flat buffer (plus the running statistics);
            # no optimizer state
            assert (flat_chunks_bytes(params) <= replica["parameters"]
                    <= flat_chunks_bytes(params) + model_bytes - params_bytes)
            assert "optimizer_state" not in replica
    ddp = scenario(result, "ddp")
    assert ddp["batch"] == 8 and [d["batch_rows"] for d in ddp["devices"]] == [2] * 4
    for rank in breakdowns(ddp):
        assert rank["parameters"] == model_bytes
        assert rank["gradients"] == params_bytes and rank["optimizer_state"] == params_bytes


@pytest.mark.parametrize("launcher", [["torchrun", "--nproc-per-node", "4"], ["python"]])
def test_a_torchvision_reference_style_train_py(work: Path, launcher: list[str]) -> None:
    import torchvision

    pytest.importorskip("PIL")
    image_folder(work / "data", {"train": 6, "val": 2})
    (work / "out").mkdir()
    (work / "out" / "checkpoint.pth").write_bytes(b"the user's checkpoint of yesterday")
    per_gpu = 2 if launcher[0] == "torchrun" else 8
    result, output = run_cli(work, [*launcher, str(SCRIPTS / "tv_reference_train.py"),
                                    "--data-path", "data", "-b", str(per_gpu), "-j", "0",
                                    "--train-crop-size", "64", "--val-resize-size", "72",
                                    "--val-crop-size", "64", "--epochs", "2",
                                    "--print-freq", "1", "--output-dir", "out"])
    assert output.count("Start training") == 1, output
    assert output.count("Epoch: [0] [0/") == 1, output
    model = torchvision.models.resnet18(num_classes=3)
    params = list(model.parameters())
    params_bytes = per_storage_bytes(params)
    model_bytes = params_bytes + per_storage_bytes(list(model.buffers()))
    if launcher[0] == "torchrun":
        assert [s["name"] for s in result["scenarios"]] == ["ddp"]
    else:
        assert [s["name"] for s in result["scenarios"]] == ["dp-loss-primary",
                                                           "dp-loss-forward", "ddp"]
        for name in ("dp-loss-primary", "dp-loss-forward"):
            cuda0, *replicas = breakdowns(scenario(result, name))
            assert cuda0["parameters"] == model_bytes
            assert cuda0["optimizer_state"] == params_bytes
            # resnet18's 44.7 MB of gradients are summed in 10 MiB flat buffers
            assert cuda0["gradients"] == params_bytes + flat_chunks_bytes(params)
            assert all("optimizer_state" not in replica for replica in replicas)
    ddp = scenario(result, "ddp")
    assert ddp["batch"] == 8 and [d["batch_rows"] for d in ddp["devices"]] == [2] * 4
    for rank in breakdowns(ddp):
        assert rank["parameters"] == model_bytes
        assert rank["gradients"] == params_bytes and rank["optimizer_state"] == params_bytes


@pytest.mark.slow
def test_a_lightning_module_under_trainer_strategy_ddp_that_checkpoints(work: Path) -> None:
    """Lightning starts the other ranks itself (``Trainer(strategy="ddp", devices=4)`` from
    a plain ``python``): each rank its own process on its own GPU, ModelCheckpoint writing
    into the run's overlay, never over the user's ``last.ckpt``."""
    pytest.importorskip("lightning")
    (work / "checkpoints").mkdir()
    (work / "checkpoints" / "last.ckpt").write_bytes(b"the user's checkpoint of yesterday")
    # in a process of its own, as a user runs it (dpprof plays Lightning's launcher: no
    # process starts; tests/test_run_lightning_launch.py holds that), the torchvision shim
    # through sitecustomize, as torchmetrics imports torchvision
    site = work.parent / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "from torchvision_shim import import_torchvision\nimport_torchvision()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(Path(__file__).parent)])}
    before = digest_tree(work), digest_tree(SCRIPTS)
    out = work.parent / "r.json"
    done = subprocess.run([sys.executable, "-m", "dpprof", "run", "--gpus", "4", "--steps", "3",
                           "--ranks", "none", "-o", str(out), "--", "python",
                           str(SCRIPTS / "lightning_ddp.py"),
                           "--batch-size", "32"], env=env, capture_output=True, text=True,
                          timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert (digest_tree(work), digest_tree(SCRIPTS)) == before
    result = json.loads(out.read_text())
    assert output.count("first batch: (32, 64) per rank, 4 ranks") == 1, output
    assert [s["name"] for s in result["scenarios"]] == ["ddp"]
    ddp = scenario(result, "ddp")
    assert ddp["batch"] == 128 and [d["batch_rows"] for d in ddp["devices"]] == [32] * 4
    # LitClassifier's three Linear layers, float32, each storage in its own block
    params_bytes = sum(r512(4 * n) for n in (64 * 256, 256, 256 * 256, 256, 256 * 10, 10))
    for rank in breakdowns(ddp):
        assert rank["parameters"] == params_bytes and rank["gradients"] == params_bytes
        assert rank["optimizer_state"] == 2 * params_bytes  # AdamW's exp_avg, exp_avg_sq
    # rank 0 saved its checkpoint at step 2, into the overlay (the user's last.ckpt stands:
    # the folder's digest above)
    written = {(w["run"], w["path"]): w for w in result["writes"]}
    assert written["as-written", "checkpoints/epoch=0-step=2.ckpt"]["emulated_values"]


@pytest.mark.parametrize("launcher", [["torchrun", "--nproc-per-node", "4"], ["python"]])
def test_the_wrappers_a_library_took_before_the_run_are_emulated(
        work: Path, launcher: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A library imported before the run holds torch's own ``DistributedDataParallel`` and
    ``DataParallel`` (Lightning's DDP strategy, imported by pytest's process or a user's
    notebook): the classes it calls are emulated all the same, and torch's are torch's
    again after the run."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import wrapper_library

    real_inits = (torch.nn.DataParallel.__init__,
                  torch.nn.parallel.DistributedDataParallel.__init__)
    assert wrapper_library.DistributedDataParallel is torch.nn.parallel.DistributedDataParallel
    result, output = run_cli(work, [*launcher, str(SCRIPTS / "library_wrapped.py")])
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 100))
    params_bytes = per_storage_bytes(list(model.parameters()))
    if launcher[0] == "torchrun":
        # the script's own type(...).__name__: torch's class name, as on a GPU
        assert output.count("wrapped in DistributedDataParallel") == 1, output
        ddp = scenario(result, "ddp")
        assert [d["batch_rows"] for d in ddp["devices"]] == [128] * 4
    else:
        assert output.count("wrapped in DataParallel") == 1, output
        primary = scenario(result, "dp-loss-primary")
        assert [d["batch_rows"] for d in primary["devices"]] == [32] * 4
        ddp = scenario(result, "ddp")
    # each rank's peak is inside a backward (the first layer's gradients not made yet)
    for rank in breakdowns(ddp):
        assert rank["parameters"] == params_bytes and 0 < rank["gradients"] <= params_bytes
        assert rank["optimizer_state"] == 2 * params_bytes  # AdamW's exp_avg, exp_avg_sq
    assert (torch.nn.DataParallel.__init__,
            torch.nn.parallel.DistributedDataParallel.__init__) == real_inits


def test_a_script_started_by_accelerate_launch_from_the_command_line(work: Path) -> None:
    """``dpprof run -- accelerate launch --num_processes 4 train.py``, as accelerate's users
    start every script: four DDP ranks, accelerate's loaders sharding the batches,
    ``save_state`` and ``save_model`` writing into the run's overlay, never over the user's
    ``model.safetensors`` (run_cli: every file of the folder hashed before and after)."""
    pytest.importorskip("accelerate")
    (work / "out").mkdir()
    (work / "out" / "model.safetensors").write_bytes(b"the user's model of yesterday")
    result, output = run_cli(work, ["accelerate", "launch", "--num_processes", "4",
                                    str(SCRIPTS / "accelerate_train.py"),
                                    "--output_dir", "out", "--batch_size", "64"])
    # 2,048 rows in batches of 64, each rank every fourth: 8 batches a rank; torch's own
    # class name, as accelerate wraps the model
    assert output.count("4 processes, DistributedDataParallel, 8 steps an epoch") == 1, output
    assert [s["name"] for s in result["scenarios"]] == ["ddp"]
    ddp = scenario(result, "ddp")
    assert ddp["batch"] == 4 * 64 and [d["batch_rows"] for d in ddp["devices"]] == [64] * 4
    params_bytes = sum(r512(4 * n) for n in (128 * 1024, 1024, 1024 * 10, 10))
    for rank in breakdowns(ddp):
        assert rank["parameters"] == params_bytes
        assert rank["optimizer_state"] == 2 * params_bytes  # AdamW's exp_avg, exp_avg_sq
    # accelerate's save_state at step 2, into the overlay (the user's file stands: the
    # folder's digest in run_cli)
    written = {w["path"] for w in result["writes"] if w["run"] == "as-written"}
    assert {f"out/step_2/{name}" for name in ("model.safetensors", "optimizer.bin",
                                              "scheduler.bin")} <= written
