"""``dpprof run`` over a corpus of scripts in the styles of the public ones (tests/scripts/):
nanoGPT's train.py (one process and torchrun: a memmap loader with ``torch.randint``
offsets, gradient accumulation, autocast, a checkpoint each eval), pytorch/examples'
ImageNet script (``--dummy``, ``torch.accelerator``, DataParallel, ``save_checkpoint``), a
Hugging Face ``Trainer`` that wraps the model in DataParallel itself, and a script that
resumes from its checkpoint and writes it after every step. Each is checked as a user would:
its exit status, the kind of run, each GPU's peak against a count from the script's shapes,
the alternatives and what they save, the user's files, and its own output, shown once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dpprof.backends.script import ScriptConfig, parse_command, run_command
from dpprof.result import RunResult

SCRIPTS = Path(__file__).parent / "scripts"


def r512(n: int) -> int:
    return -(-n // 512) * 512


def params_bytes(*shapes: tuple[int, ...]) -> int:
    return sum(r512(4 * int(np.prod(s))) for s in shapes)


def run(cmd: list[str], gpus: int = 4, steps: int = 3, alternatives: bool = True,
        compute: bool = False) -> tuple[RunResult, int]:
    result, main = run_command(ScriptConfig(launch=parse_command(cmd, gpus), gpus=gpus,
                                            steps=steps, compute=compute), alternatives)
    return result, main.exit_status


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


# ---- nanoGPT ---------------------------------------------------------------------------

V, C, T, LAYERS = 65, 64, 32, 2  # nanogpt_train.py's defaults (vocab of shakespeare_char)
GPT_SHAPES = [(V, C), (T, C), (C,)] + LAYERS * [(C,), (3 * C, C), (C, C), (C,), (4 * C, C),
                                                (C, 4 * C)]  # lm_head is tied to wte


@pytest.fixture
def nanogpt_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """prepare.py's output (uint16 token ids in train.bin / val.bin) and a checkpoint of
    the user's own in out/."""
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    rng.integers(0, V, 4000, dtype=np.uint16).tofile(data / "train.bin")
    rng.integers(0, V, 1000, dtype=np.uint16).tofile(data / "val.bin")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "ckpt.pt").write_bytes(b"yesterday's run")
    return tmp_path


def test_nanogpt_on_one_gpu(nanogpt_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result, status = run(["python", str(SCRIPTS / "nanogpt_train.py"), "--data_dir=data",
                          "--out_dir=out"])
    assert status == 0
    (s,) = result.scenarios
    assert s.name == "single" and s.status == "ok" and s.batch == 8
    d0 = s.devices[0].breakdown_bytes
    assert d0["parameters"] == params_bytes(*GPT_SHAPES)
    # fused AdamW: exp_avg and exp_avg_sq, and each parameter's step on the GPU
    assert d0["optimizer_state"] == 2 * params_bytes(*GPT_SHAPES) + 512 * len(GPT_SHAPES)
    assert d0["inputs"] >= 2 * r512(8 * T * 8)  # X and Y: int64 token ids from the memmap
    assert not any(d.used for d in s.devices[1:])
    # the checkpoint of step 2 held emulated tensors: the user's file is as it was
    assert (nanogpt_dir / "out" / "ckpt.pt").read_bytes() == b"yesterday's run"
    assert "torch.save ckpt.pt at nanogpt_train.py" in " ".join(s.notes)
    out = capsys.readouterr().out
    assert out.count("tokens per iteration will be: 1,024") == 1  # 4 x 8 x 32, once
    assert out.count("saving checkpoint to out") == 1


def test_nanogpt_dropout_as_a_gpu_runs_it(nanogpt_dir: Path) -> None:
    """nanoGPT's dropout (nn.Dropout after the embeddings and in each block's two residual
    branches, SDPA's dropout_p) under bfloat16 autocast: a GPU runs flash attention, whose
    dropout keeps no seq x seq mask, and the fused dropout, a one-byte mask per element; a
    CPU or meta build would keep the attention weights and masks of the input's dtype."""
    peaks = {}
    for p in ("0.0", "0.2"):
        result, status = run(["python", str(SCRIPTS / "nanogpt_train.py"), "--data_dir=data",
                              "--out_dir=out", "--dtype=bfloat16", f"--dropout={p}"])
        assert status == 0
        (s,) = result.scenarios
        assert s.status == "ok", s.message
        notes = " ".join(s.notes)
        assert "kernels as on a GPU of compute capability 8.0:" in notes
        assert "sdpa:flash" in notes and "sdpa:math" not in notes
        peaks[p] = s.devices[0].peak_allocated_bytes
    batch = 8
    masks = 1 + 2 * LAYERS  # transformer.drop; each block's resid_dropout and mlp dropout
    assert peaks["0.2"] - peaks["0.0"] == masks * r512(batch * T * C)


def test_nanogpt_resumes_from_a_real_checkpoint(nanogpt_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """--init_from=resume: the checkpoint of a CPU run, loaded onto the GPU
    (map_location=device), into a model still on the host (load_state_dict copies each
    tensor to the host): values read from the GPU, given as stand-ins, the run goes on."""
    script = str(SCRIPTS / "nanogpt_train.py")
    monkeypatch.setattr(sys, "argv", [script, "--data_dir=data", "--out_dir=out",
                                      "--device=cpu", "--max_iters=2"])
    runpy.run_path(script, run_name="__main__")  # the user's run, on the CPU: step 2 saved
    capsys.readouterr()
    before = digest(nanogpt_dir / "out" / "ckpt.pt")
    result, status = run(["python", script, "--data_dir=data", "--out_dir=out",
                          "--init_from=resume", "--max_iters=8"])
    assert status == 0
    (s,) = result.scenarios
    assert s.name == "single" and s.status == "ok", s.message
    d0 = s.devices[0].breakdown_bytes
    assert d0["parameters"] == params_bytes(*GPT_SHAPES)
    notes = " ".join(s.notes)
    # the state dict's tensors: wte, wpe, 6 per block, ln_f, and lm_head (tied to wte, a
    # key of its own)
    tensors = 2 + LAYERS * 6 + 2
    lines = Path(script).read_text().splitlines()
    load = lines.index("    model.load_state_dict(checkpoint['model'])") + 1
    assert f"nanogpt_train.py:{load} (host copy) x{tensors}" in notes
    assert digest(nanogpt_dir / "out" / "ckpt.pt") == before
    out = capsys.readouterr().out
    assert out.count("Resuming training from out") == 1
    assert "step 2: train loss" in out  # the checkpoint's iter_num


def test_nanogpt_compiled_runs_eagerly_and_says_so(nanogpt_dir: Path) -> None:
    """nanoGPT compiles by default (compile = True): the model runs eagerly, measured as
    without --compile, and the report says the peaks are the eager model's."""
    peaks = []
    for flag in ("False", "True"):
        result, status = run(["python", str(SCRIPTS / "nanogpt_train.py"), "--data_dir=data",
                              "--out_dir=out", f"--compile={flag}"])
        assert status == 0
        (s,) = result.scenarios
        assert s.status == "ok", s.message
        peaks.append([d.peak_allocated_bytes for d in s.devices])
    assert peaks[0] == peaks[1]
    lines = (SCRIPTS / "nanogpt_train.py").read_text().splitlines()
    at = lines.index("    model = torch.compile(model)") + 1
    assert f"torch.compile at {SCRIPTS / 'nanogpt_train.py'}:{at}: run eagerly" in " ".join(
        s.notes)


@pytest.mark.torchrun
def test_nanogpt_under_torchrun(nanogpt_dir: Path) -> None:
    result, status = run(["torchrun", "--standalone", "--nproc_per_node=4",
                          str(SCRIPTS / "nanogpt_train.py"), "--data_dir=data",
                          "--out_dir=out"])
    assert status == 0
    (s,) = result.scenarios
    assert s.name == "ddp" and s.status == "ok", s.message
    assert [d.rank for d in s.devices] == [0, 1, 2, 3]
    for d in s.devices:
        assert d.breakdown_bytes["parameters"] == params_bytes(*GPT_SHAPES)
        assert d.breakdown_bytes["communication"] >= 4 * sum(int(np.prod(x))
                                                             for x in GPT_SHAPES)
        assert d.peak_allocated_bytes == s.devices[0].peak_allocated_bytes
    assert (nanogpt_dir / "out" / "ckpt.pt").read_bytes() == b"yesterday's run"


# ---- the ImageNet example --------------------------------------------------------------


@pytest.mark.slow
def test_imagenet_example_with_dummy_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from torchvision_shim import import_torchvision

    try:
        tv = import_torchvision()
    except Exception as e:  # pragma: no cover - no torchvision installed
        pytest.skip(f"torchvision unavailable: {e}")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoint.pth.tar").write_bytes(b"epoch 41 of a real run")
    result, status = run(["python", str(SCRIPTS / "imagenet_dummy.py"), "--dummy", "-b", "32"])
    assert status == 0
    assert [s.name for s in result.scenarios] == ["dp-loss-primary", "dp-loss-forward", "ddp"]
    dp = result.scenarios[0]
    assert dp.status == "ok" and dp.batch == 32
    assert [d.batch_rows for d in dp.devices] == [8, 8, 8, 8]
    net = tv.models.resnet18()
    resnet = [tuple(p.shape) for p in net.parameters()]
    buffers = sum(r512(b.numel() * b.element_size()) for b in net.buffers())  # BatchNorm's
    d0 = dp.devices[0].breakdown_bytes
    assert d0["parameters"] == params_bytes(*resnet) + buffers  # moved with the model
    assert d0["optimizer_state"] == params_bytes(*resnet)  # SGD momentum, on cuda:0
    assert d0["outputs"] == 32 * 1000 * 4  # the gathered logits
    assert all(dp.devices[0].peak_allocated_bytes > d.peak_allocated_bytes
               for d in dp.devices[1:])
    fixes = {f.name: f for f in result.fixes}
    assert set(fixes) == {"loss-in-forward", "ddp", "gradient-as-bucket-view"}
    ddp = result.scenario("ddp")
    assert ddp is not None and ddp.batch == 8
    assert fixes["ddp"].saves_bytes == (dp.devices[0].peak_allocated_bytes
                                        - ddp.devices[0].peak_allocated_bytes)
    # accuracy() reads the gathered outputs: the alternative keeps them, and says so
    fwd = result.scenario("dp-loss-forward")
    assert fwd is not None and "also uses the outputs" in " ".join(fwd.notes)
    assert (tmp_path / "checkpoint.pth.tar").read_bytes() == b"epoch 41 of a real run"
    assert not (tmp_path / "model_best.pth.tar").exists()
    out = capsys.readouterr().out
    assert out.count("=> Dummy data is used!") == 1 and out.count("Epoch: [0][1/2]") == 1


# ---- Hugging Face Trainer --------------------------------------------------------------


@pytest.mark.slow
def test_hugging_face_trainer_wraps_data_parallel_itself(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    for module in ("transformers", "accelerate"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[zoo]')")
    from torchvision_shim import import_torchvision

    import_torchvision()  # transformers imports torchvision when it is installed
    monkeypatch.chdir(tmp_path)
    saved = tmp_path / "out" / "checkpoint-2"
    saved.mkdir(parents=True)
    (saved / "model.safetensors").write_bytes(b"weights of an earlier run")
    result, status = run(["python", str(SCRIPTS / "hf_trainer.py"), "--output_dir", "out"])
    assert status == 0
    dp = result.scenarios[0]
    assert dp.name == "dp-loss-primary" and dp.status == "ok", dp.message
    # Trainer saw 4 GPUs: batch 8 per device, 32 scattered in 4 chunks
    assert dp.batch == 32 and [d.batch_rows for d in dp.devices] == [8, 8, 8, 8]
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128,
                        max_position_embeddings=64, num_labels=3)
    bert = BertForSequenceClassification(config)
    shapes = [tuple(p.shape) for p in bert.parameters()]
    buffers = sum(r512(b.numel() * b.element_size()) for b in bert.buffers())  # position ids
    d0 = dp.devices[0].breakdown_bytes
    assert d0["parameters"] == params_bytes(*shapes) + buffers
    assert d0["optimizer_state"] >= 2 * params_bytes(*shapes)  # AdamW, on cuda:0 only
    assert all("optimizer_state" not in d.breakdown_bytes for d in dp.devices[1:])
    ddp = result.scenario("ddp")
    assert ddp is not None and ddp.status == "ok" and ddp.batch == 8
    assert {f.name for f in result.fixes} == {"ddp", "gradient-as-bucket-view"}
    # the checkpoint's tensors and the GPU's generator state are emulated: not written
    assert (saved / "model.safetensors").read_bytes() == b"weights of an earlier run"
    notes = " ".join(dp.notes)
    assert "model.safetensors" in notes and "rng_state.pth" in notes
    assert not (saved / "rng_state.pth").exists()
    assert capsys.readouterr().out.count("n_gpu 4 train batch 32") == 1


# ---- a checkpoint after every step ----------------------------------------------------


def test_a_script_that_resumes_and_checkpoints_every_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    script = str(SCRIPTS / "checkpoint_every_step.py")
    # the user's checkpoint, from a run of the script on the CPU (plain Python, no GPU)
    monkeypatch.setattr(sys, "argv", [script, "--steps", "2"])
    runpy.run_path(script, run_name="__main__")
    capsys.readouterr()
    before = digest(tmp_path / "checkpoint.pt")
    result, status = run(["python", script])
    assert status == 0
    assert [s.name for s in result.scenarios] == ["dp-loss-primary", "dp-loss-forward", "ddp"]
    mlp = [(256, 32), (256,), (1000, 256), (1000,)]
    d0 = result.scenarios[0].devices[0].breakdown_bytes
    assert d0["parameters"] == params_bytes(*mlp)
    # the momentum loaded from the file (map_location=device) is the optimizer's state
    assert d0["optimizer_state"] == params_bytes(*mlp)
    # the loaded state dict stays alive on cuda:0 beside the batch
    assert d0["inputs"] == params_bytes(*mlp) + r512(64 * 32 * 4) + r512(64 * 8)
    assert {f.name: f.saves_bytes for f in result.fixes}["loss-in-forward"] == 64 * 1000 * 4
    assert digest(tmp_path / "checkpoint.pt") == before  # every run, every step
    assert "torch.save checkpoint.pt at checkpoint_every_step.py:44 x2" in " ".join(
        result.scenarios[0].notes)
    out = capsys.readouterr().out
    assert out == "resumed from checkpoint.pt at step 2\nstep 2 saved\nstep 3 saved\n"


# ---- --compute counts what meta counts -------------------------------------------------


@pytest.mark.parametrize("script", ["dp_loss_outside.py", "single_gpu.py"])
def test_compute_counts_every_gpu_as_meta_does(script: str) -> None:
    """Over CPU tensors the host's storages are not tracked (they are the host's); every
    virtual GPU's peak and breakdown are those of the meta run."""
    meta, _ = run(["python", str(SCRIPTS / script)], alternatives=False)
    cpu, _ = run(["python", str(SCRIPTS / script)], alternatives=False, compute=True)
    for a, b in zip(meta.scenarios, cpu.scenarios, strict=True):
        assert a.name == b.name
        assert ([(d.peak_allocated_bytes, d.breakdown_bytes) for d in a.devices]
                == [(d.peak_allocated_bytes, d.breakdown_bytes) for d in b.devices])
    assert torch.zeros(1).device.type == "cpu"
