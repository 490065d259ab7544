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

from dpprof.result import RunResult
from dpprof.script.session import ScriptConfig, parse_command, run_command

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
    assert ddp is not None and ddp.batch == 32  # global: 8 rows on each of 4 ranks
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
    # the model computes its loss in each replica and returns it beside its logits
    assert dp.name == "dp-loss-forward" and dp.status == "ok", dp.message
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
    assert ddp is not None and ddp.status == "ok" and ddp.batch == 32  # 4 ranks of 8
    assert {f.name for f in result.fixes} == {"ddp", "gradient-as-bucket-view"}
    # the checkpoint's tensors and the GPU's generator state are emulated: written into
    # the run's overlay, listed, never into the user's folder
    assert (saved / "model.safetensors").read_bytes() == b"weights of an earlier run"
    assert not (saved / "rng_state.pth").exists()
    written = {w.path: w for w in result.writes if w.run == "as-written"}
    shown = "out/checkpoint-2/"
    assert written[shown + "model.safetensors"].replaced, sorted(written)
    assert written[shown + "model.safetensors"].emulated_values
    assert shown + "rng_state.pth" in written and not written[shown + "rng_state.pth"].replaced
    assert result.seal is not None and result.seal.changed == ()
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


# ---- a whole model written through the script's own open(), and read back --------------


@pytest.mark.parametrize("existed", [True, False])
def test_a_save_into_a_file_the_script_opened_leaves_the_file_as_it_was(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existed: bool) -> None:
    """word_language_model's ``with open(args.save, "wb") as f: torch.save(model, f)``: the
    open and the save go into the run's overlay (a stand-in checkpoint of the emulated
    tensors); the file the user had is byte for byte as it was, none is made where there was
    none, and the result lists the write, in place of the user's file where there was one."""
    monkeypatch.chdir(tmp_path)
    if existed:
        (tmp_path / "model.pt").write_bytes(b"the model of an earlier run")
    # no optimizer: a step per backward; enough of them for the script to end by itself
    result, status = run(["python", str(SCRIPTS / "lm_save_whole_model.py")], steps=100,
                         alternatives=False)
    assert status == 0
    (s,) = result.scenarios
    assert s.status == "ok", s.message
    assert "torch.save model.pt at lm_save_whole_model.py:" in " ".join(s.notes)
    if existed:
        assert (tmp_path / "model.pt").read_bytes() == b"the model of an earlier run"
    else:
        assert not (tmp_path / "model.pt").exists()
    (w,) = [w for w in result.writes if w.path == "model.pt"]
    assert (w.kind, w.emulated_values, w.replaced) == ("file", True, existed)
    assert w.size_bytes > 0
    assert result.seal is not None and result.seal.changed == ()
    # it ended by itself after its 14 backward passes, each a step (peaks from the second)
    assert s.notes[0].startswith(
        "the script ended after 14 backward pass(es); it makes no optimizer and updates its "
        "parameters itself, a step per backward pass; the first is the warm-up")


def test_a_file_the_script_writes_itself_goes_into_the_overlay(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host data written through ``open(path, "wb")``, and a host tensor's ``torch.save``
    into it, go into the run's overlay: the user's older log stays as it was, and the
    result lists both writes with their bytes (no emulated values in either: written before
    any value was read from a virtual GPU)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "log.bin").write_bytes(b"an older log, longer than the new one")
    script = tmp_path / "writes.py"
    script.write_text(
        "import torch\n"
        "m = torch.nn.Linear(2, 2).cuda()\n"
        "with open('log.bin', 'wb') as f:\n"
        "    f.write(b'new')\n"
        "with open('host.pt', 'wb') as f:\n"
        "    torch.save(torch.arange(3), f)\n"
        "assert open('log.bin', 'rb').read() == b'new'\n"
        "assert torch.load('host.pt').tolist() == [0, 1, 2]\n")
    result, status = run(["python", str(script)], alternatives=False)
    assert status == 0
    assert (tmp_path / "log.bin").read_bytes() == b"an older log, longer than the new one"
    assert not (tmp_path / "host.pt").exists()
    written = {(w.path, w.kind, w.replaced, w.emulated_values): w.size_bytes
               for w in result.writes}
    assert written[("log.bin", "file", True, False)] == 3
    assert ("host.pt", "file", False, False) in written
    assert result.seal is not None and result.seal.changed == ()


def test_a_whole_model_saved_on_a_gpu_is_loaded_onto_the_virtual_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``torch.load`` of a pickled module with no ``map_location``: on a GPU machine its
    tensors come back on the GPU they were saved from, so the script's cuda inputs meet
    cuda weights."""
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Sequential(torch.nn.LSTM(8, 16), torch.nn.Linear(16, 4))
    with monkeypatch.context() as m:  # what a run on a GPU wrote: every storage on cuda:0
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(model, tmp_path / "model.pt")
    result, status = run(["python", str(SCRIPTS / "load_gpu_checkpoint.py")],
                         alternatives=False)
    assert status == 0
    (s,) = result.scenarios
    assert s.name == "single" and s.status == "ok", s.message
    assert capsys.readouterr().out.count("loaded on cuda:0") == 1
    shapes = [tuple(p.shape) for p in model.parameters()]
    d0 = s.devices[0].breakdown_bytes
    assert d0["parameters"] == params_bytes(*shapes)  # each storage once, on cuda:0
    assert not any(d.used for d in s.devices[1:])


# ---- images of the GPU's values (torchvision's save_image) ------------------------------


def test_images_of_emulated_values_are_not_written(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The VAE's and dcgan's ``save_image``: an image made from the GPU's values, or from
    what the host computed out of a stand-in copy of them, goes into the run's overlay, not
    over the user's picture of an earlier run, and is listed as holding emulated values;
    an image of the host's own data goes there too."""
    pytest.importorskip("PIL")
    monkeypatch.chdir(tmp_path)
    for name in ("reconstruction.png", "sample.png", "host.png"):
        (tmp_path / name).write_bytes(b"a picture of an earlier run")
    result, status = run(["python", str(SCRIPTS / "vae_samples.py")], steps=10,
                         alternatives=False)  # the script ends by itself, after 3
    assert status == 0
    (s,) = result.scenarios
    assert s.status == "ok", s.message
    assert (tmp_path / "reconstruction.png").read_bytes() == b"a picture of an earlier run"
    assert (tmp_path / "sample.png").read_bytes() == b"a picture of an earlier run"
    assert (tmp_path / "host.png").read_bytes() == b"a picture of an earlier run"
    written = {w.path: w for w in result.writes}
    for name in ("reconstruction.png", "sample.png", "host.png"):
        assert written[name].kind == "file" and written[name].replaced
        assert written[name].size_bytes > 0
    assert written["reconstruction.png"].emulated_values
    assert written["sample.png"].emulated_values


def test_a_warning_torch_raises_for_the_scripts_call_names_the_scripts_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        recwarn: pytest.WarningsRecorder) -> None:
    """time_sequence_prediction's ``torch.load`` with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD set:
    torch warns at its caller's line (stacklevel=2), which is the script's, as under plain
    Python, not dpprof's wrapper of ``torch.load``."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    script = tmp_path / "loads.py"
    script.write_text("import torch\n"
                      "torch.save({'step': 3}, 'state.pt')\n"
                      "state = torch.load('state.pt')\n"
                      "x = torch.zeros(2, device='cuda')\n")
    _, status = run(["python", str(script)], alternatives=False)
    assert status == 0
    found = [w for w in recwarn if "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD" in str(w.message)]
    assert [(w.filename, w.lineno) for w in found] == [(str(script), 3)]


def test_the_script_knows_its_own_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """``python train.py`` gives ``__main__`` the absolute path: a script that changes folder
    and then reads a file beside ``__file__`` finds it, as under plain Python."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "vocab.txt").write_text("the a of\n")
    (tmp_path / "logs").mkdir()
    (tmp_path / "train.py").write_text(
        "import os\n"
        "import torch\n"
        "x = torch.zeros(2, device='cuda')\n"
        "os.chdir('logs')\n"
        "print(open(os.path.join(os.path.dirname(__file__), 'vocab.txt')).read().split())\n")
    _, status = run(["python", "train.py"], alternatives=False)
    assert status == 0
    assert "['the', 'a', 'of']" in capsys.readouterr().out


def test_an_rnn_on_a_virtual_gpu_says_nothing_about_the_hosts_cudnn(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        recwarn: pytest.WarningsRecorder) -> None:
    """An LSTM moved to the GPU asks whether cuDNN takes its weights; the CPU build's
    warning that it has no cuDNN is not the user's GPU machine's to print."""
    monkeypatch.chdir(tmp_path)
    _, status = run(["python", str(SCRIPTS / "lm_save_whole_model.py")], alternatives=False)
    assert status == 0
    assert not [str(w.message) for w in recwarn if "cuDNN" in str(w.message)]


def test_under_compute_images_of_the_gpus_values_are_not_written_either(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--compute``: the virtual GPUs hold real numbers, and what the script reads back to
    the host (``.cpu()``) and computes from it is still the emulation's, not a run's: the
    user's pictures stay, and the images are listed as holding emulated values."""
    pytest.importorskip("PIL")
    monkeypatch.chdir(tmp_path)
    for name in ("reconstruction.png", "sample.png", "host.png"):
        (tmp_path / name).write_bytes(b"a picture of an earlier run")
    result, status = run(["python", str(SCRIPTS / "vae_samples.py")], steps=10,
                         alternatives=False, compute=True)
    assert status == 0
    assert (tmp_path / "reconstruction.png").read_bytes() == b"a picture of an earlier run"
    assert (tmp_path / "sample.png").read_bytes() == b"a picture of an earlier run"
    assert (tmp_path / "host.png").read_bytes() == b"a picture of an earlier run"
    written = {w.path: w for w in result.writes}
    assert written["reconstruction.png"].emulated_values
    assert written["sample.png"].emulated_values


def test_a_script_without_an_optimizer_is_stopped_after_steps_backward_passes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """word_language_model updates its parameters itself (``p.data.add_``): no optimizer
    step ever comes, so each backward begins a step; --steps 3 stops it at the fourth
    (it ran all its epochs under emulation before), peaks over the second and third."""
    monkeypatch.chdir(tmp_path)
    result, main = run_command(ScriptConfig(
        launch=parse_command(["python", str(SCRIPTS / "lm_save_whole_model.py")], 4),
        gpus=4, steps=3), False)
    assert main.exit_status == 0 and main.ended == "steps"
    assert (main.steps_done, main.backwards) == (0, 4)
    (s,) = result.scenarios
    assert s.status == "ok", s.message
    assert "stopped after 3 backward pass(es) (--steps 3: the script makes no optimizer" in (
        " ".join(s.notes))
    assert "end of epoch" not in capsys.readouterr().out  # 7 batches an epoch: not reached
    assert not (tmp_path / "model.pt").exists()
