"""``dpprof run`` leaves the script's host side, files and errors as they are.

* The host is real: host-side scripts print under ``dpprof run`` exactly what they print
  under plain Python (a differential test over scripts that read values back from CPU
  tensors, index memmaps with ``int()`` offsets and branch on host values).
* Nothing of the user's is lost: a checkpoint of emulated tensors never reaches the user's
  file; an alternative's run writes nothing the user sees and prints nothing.
* The script's errors are the script's: its traceback and status, one line from dpprof,
  never an internal error; an interrupted run writes what it measured, marked partial.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dpprof.cli.app import app
from dpprof.errors import Interrupted
from dpprof.script.session import ScriptConfig, parse_command, run_command

runner = CliRunner()

# Host-side scripts: every value printed comes from CPU tensors (and NumPy), as a data
# loader, a metric or a schedule computes them while the model trains on a GPU.
HOST_SCRIPTS = {
    "scalars": """
        import torch
        a = torch.tensor(13); b = torch.tensor(5)
        print(int(a), int(b), int(a + b), float(torch.tensor(2.5)), float(torch.tensor(7.25)))
        print(int(torch.arange(10).sum()), torch.arange(6).view(2, 3).sum(0).tolist())
        print(bool(torch.tensor(3) > 4), bool(torch.tensor(5) > 4))
    """,
    "seeded_random": """
        import torch
        torch.manual_seed(1337)
        x = torch.randn(4, 3)
        print([round(v, 5) for v in x.sum(1).tolist()], round(x.max().item(), 5))
        print(torch.randint(0, 100, (6,)).tolist())
    """,
    "memmap_loader": """
        # nanoGPT's get_batch: random offsets into a memmap of token ids
        import os, tempfile
        import numpy as np
        import torch
        path = os.path.join(tempfile.mkdtemp(), "train.bin")
        np.arange(1000, dtype=np.uint16).tofile(path)
        torch.manual_seed(0)
        data = np.memmap(path, dtype=np.uint16, mode="r")
        block_size, batch_size = 8, 4
        ix = torch.randint(len(data) - block_size, (batch_size,))
        x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64))
                         for i in ix])
        print(x.shape, y.shape, int(x[0, 0]), int(y[-1, -1]), [int(i) for i in ix])
    """,
    "host_branches": """
        import torch
        lr = 0.0
        for it in range(5):
            warm = torch.tensor(it) < 2
            lr = 0.1 * (it + 1) / 2 if bool(warm) else lr * 0.5
            print(it, round(lr, 6))
        counts = torch.bincount(torch.tensor([0, 1, 1, 3, 3, 3]))
        print(counts.tolist(), counts.argmax().item(), torch.unique(torch.tensor([3, 1, 3])).tolist())
    """,
    "model_init_then_random": """
        # a model built on the host draws its initial weights from the host's generator:
        # what the script draws next depends on it
        import torch
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Dropout(0.1))
        print(round(model[0].weight.sum().item(), 5), torch.randn(3).tolist())
    """,
    "nanogpt_get_batch": """
        # nanoGPT's poor man's loader, as its train.py calls it: a fresh memmap per batch,
        # int() offsets from torch.randint, a lr schedule from host arithmetic
        import math, os, tempfile
        import numpy as np
        import torch
        d = tempfile.mkdtemp()
        np.random.default_rng(1).integers(0, 65, 3000, dtype=np.uint16).tofile(os.path.join(d, "train.bin"))
        torch.manual_seed(1337)
        def get_batch(block_size=16, batch_size=4):
            data = np.memmap(os.path.join(d, "train.bin"), dtype=np.uint16, mode="r")
            ix = torch.randint(len(data) - block_size, (batch_size,))
            x = torch.stack([torch.from_numpy((data[int(i):int(i) + block_size]).astype(np.int64)) for i in ix])
            return x, ix
        for it in range(3):
            x, ix = get_batch()
            lr = 6e-4 * 0.5 * (1.0 + math.cos(math.pi * it / 3))
            print(it, ix.tolist(), int(x.sum()), x[:, -1].tolist(), f"{lr:.6e}")
    """,
    "seeded_sampler": """
        # a shuffling sampler and a DataLoader from a seeded generator, and random_split
        import torch
        from torch.utils.data import DataLoader, RandomSampler, TensorDataset, random_split
        g = torch.Generator().manual_seed(42)
        ds = TensorDataset(torch.arange(20), torch.arange(20) % 3)
        print(list(RandomSampler(ds, generator=g))[:8])
        train, val = random_split(ds, [15, 5], generator=torch.Generator().manual_seed(0))
        print(sorted(val.indices))
        loader = DataLoader(train, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
        print([b[0].tolist() for b in loader])
        print(torch.randperm(10, generator=torch.Generator().manual_seed(3)).tolist())
    """,
    "host_metric": """
        # accuracy, a confusion matrix and an F1 computed on the host from predictions
        import torch
        torch.manual_seed(5)
        logits = torch.randn(32, 4)
        target = torch.randint(0, 4, (32,))
        pred = logits.argmax(1)
        acc = (pred == target).float().mean().item()
        conf = torch.zeros(4, 4, dtype=torch.long)
        conf.index_put_((target, pred), torch.ones(32, dtype=torch.long), accumulate=True)
        tp = conf.diag().float()
        f1 = (2 * tp / (conf.sum(0) + conf.sum(1)).clamp(min=1)).mean()
        top2 = logits.topk(2, 1).indices.eq(target[:, None]).any(1).float().mean()
        print(f"{acc:.4f}", conf.tolist(), f"{f1.item():.4f}", f"{top2.item():.4f}")
    """,
    "branch_on_host_value": """
        # early stopping and a skipped step decided on host values (NaN, a threshold)
        import torch
        torch.manual_seed(2)
        best, patience = float("inf"), 0
        for epoch in range(6):
            val = torch.rand(8).mean() + (0.5 if epoch == 3 else 0.0)
            if torch.isnan(val).any() or not torch.isfinite(val):
                print("skip"); continue
            if val.item() < best - 0.01:
                best, patience = val.item(), 0
            else:
                patience += 1
            print(epoch, round(best, 5), patience, "stop" if patience >= 2 else "go")
        x = torch.tensor([1.0, float("nan"), 3.0])
        print(torch.nan_to_num(x).tolist(), x[~torch.isnan(x)].tolist(), bool(x.isnan().any()))
    """,
    "numpy_interop": """
        # numpy in and out: from_numpy shares memory, .numpy() of host tensors, np ops on them
        import numpy as np
        import torch
        a = np.arange(12, dtype=np.float32).reshape(3, 4)
        t = torch.from_numpy(a)
        t.mul_(2)
        print(a.sum(), t.numpy().mean(), np.asarray(t[1]).tolist())
        b = torch.tensor(np.linspace(0, 1, 5)).numpy()
        print(b.dtype, b.round(3).tolist(), np.stack([t.numpy(), a]).shape)
        idx = np.array([2, 0])
        print(t[torch.as_tensor(idx)].tolist(), torch.as_tensor(a).data_ptr() == t.data_ptr())
    """,
    "linalg": """
        # every torch.linalg function on host tensors, printed to the last bit (a composite
        # such as svdvals decides its path by whether a dispatch mode is active)
        import torch
        L = torch.linalg
        torch.manual_seed(0)
        a = torch.randn(7, 4); b = torch.randn(7, 2); sq = torch.randn(5, 5)
        spd = sq @ sq.T + 5 * torch.eye(5)
        c = torch.randn(4, 4, dtype=torch.complex64)
        d = torch.randn(6, 6, dtype=torch.float64)
        print(L.svdvals(a).tolist(), L.svdvals(c).tolist(), L.svdvals(d).tolist())
        print(L.svdvals(a.requires_grad_()).tolist()); a.requires_grad_(False)
        print(L.svd(a, full_matrices=False)[1].tolist(), torch.svd(a, compute_uv=False)[1].tolist())
        print(L.eigvalsh(spd).tolist(), L.eigh(spd)[0].tolist(), L.eigvals(sq).tolist())
        print(L.eig(sq)[0].tolist(), L.eigvals(c).tolist())
        print(L.matrix_norm(a, ord=2).item(), L.matrix_norm(a, ord=-2).item(),
              L.matrix_norm(a, ord="nuc").item(), L.matrix_norm(a).item(), L.norm(a, ord=2).item())
        print(L.cond(sq).item(), L.cond(sq, "fro").item(), L.matrix_rank(a).item(),
              L.matrix_rank(spd, hermitian=True).item())
        print(L.pinv(a).sum().item(), L.pinv(spd, hermitian=True).sum().item())
        print([L.lstsq(a, b, driver=drv).solution.tolist() for drv in ("gels", "gelsd", "gelss")])
        print(L.solve(sq, b[:5]).tolist(), L.inv(sq).sum().item(), L.det(sq).item(),
              L.slogdet(sq)[1].item(), torch.logdet(spd).item())
        print(L.cholesky(spd).sum().item(), L.qr(a)[1].tolist(), L.lu_factor(sq)[0].sum().item())
        print(L.matrix_exp(sq / 4).sum().item(), L.matrix_power(sq, 3).sum().item(),
              L.vector_norm(a, ord=3).item(), L.multi_dot([a, a.T, a]).sum().item())
        print(L.solve_triangular(spd.tril(), b[:5], upper=False).tolist(),
              L.householder_product(*torch.geqrf(a)).sum().item(), L.vander(a[:, 0]).sum().item())
        print(torch.norm(a, p="nuc").item(), torch.pinverse(a).sum().item(),
              torch.cdist(a, a).sum().item(), L.ldl_factor(spd)[0].sum().item())
    """,
    "fft": """
        # torch.fft and the spectral ops on the host, to the last bit
        import torch
        torch.manual_seed(0)
        x = torch.randn(4, 16); z = torch.randn(8, dtype=torch.complex64)
        F = torch.fft
        print(F.fft(x).abs().sum().item(), F.ifft(z).tolist(), F.rfft(x)[0].tolist())
        print(F.irfft(F.rfft(x)).sum().item(), F.fft2(x).abs().sum().item(),
              F.fftn(x, s=(8, 8)).abs().sum().item(), F.rfftn(x).abs().sum().item())
        print(F.hfft(z).tolist(), F.ihfft(x[0]).tolist(), F.fftshift(x).sum().item(),
              F.fftfreq(9).tolist(), F.rfftfreq(8, d=0.1).tolist())
        w = torch.hann_window(16)
        s = torch.stft(torch.randn(256), 32, hop_length=8, window=torch.hann_window(32),
                       return_complex=True)
        print(s.abs().sum().item(), torch.istft(s, 32, hop_length=8,
                                                window=torch.hann_window(32)).sum().item())
        print((F.ifft(F.fft(x) * F.fft(x.flip(1)))).real.sum().item(), w.tolist())
    """,
    "numpy_linalg_interop": """
        # tensors through NumPy's linalg and fft and back, and np arrays into torch's
        import numpy as np
        import torch
        torch.manual_seed(3)
        a = torch.randn(6, 4, dtype=torch.float64)
        n = a.numpy()
        print(np.linalg.svd(n, compute_uv=False).tolist(), np.linalg.norm(n, 2))
        print(torch.from_numpy(np.linalg.pinv(n)).sum().item(), np.fft.rfft(n, axis=0)[1].tolist())
        q, r = np.linalg.qr(n)
        print(torch.linalg.svdvals(torch.from_numpy(r)).tolist(), torch.as_tensor(q.T @ q).trace().item())
        rng = np.random.default_rng(0)
        m = rng.standard_normal((5, 5)).astype(np.float32)
        print(torch.linalg.eigvalsh(torch.from_numpy(m @ m.T)).tolist(),
              np.asarray(torch.fft.fft(torch.from_numpy(m))).real.sum())
        t = torch.tensor(np.arange(12.0).reshape(3, 4)).float()
        print(torch.linalg.matrix_norm(t, ord=2).item(), (t.numpy() @ t.numpy().T).tolist())
    """,
    "cpu_model_kernels": """
        # a model trained on the host (nanoGPT's --device=cpu): attention, dropout and
        # rms_norm run the CPU's kernels, whatever GPU the emulation plays
        import torch
        import torch.nn.functional as F
        torch.manual_seed(0)
        q = torch.randn(2, 2, 8, 8)
        print(round(float(F.scaled_dot_product_attention(q, q, q, is_causal=True).sum()), 4))
        print(round(float(F.dropout(torch.ones(1000), 0.5).sum()), 1))
        print(round(float(F.rms_norm(torch.randn(4, 8), (8,)).sum()), 4))
    """,
}


def _plain(path: Path) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(path), run_name="__main__")
    return out.getvalue()


@pytest.mark.parametrize("compute", [False, True], ids=["meta", "compute"])
@pytest.mark.parametrize("name", sorted(HOST_SCRIPTS))
def test_host_side_scripts_print_what_plain_python_prints(name: str, compute: bool,
                                                          tmp_path: Path) -> None:
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(HOST_SCRIPTS[name]))
    expected = _plain(script)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run_command(ScriptConfig(launch=parse_command(["python", str(script)], 4),
                                 compute=compute))
    assert out.getvalue() == expected


def test_the_script_sees_its_path_as_python_gives_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python ../train.py``: ``__file__`` is absolute (the working directory joined to the
    path as typed), ``sys.argv[0]`` as typed, so ``os.chdir(os.path.dirname(__file__))``
    works; compared with a real Python process."""
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import os, sys
        print(__file__, sys.argv[0])
        os.chdir(os.path.dirname(__file__))
        print(os.getcwd())
    """))
    (tmp_path / "sub").mkdir()
    expected = subprocess.run([sys.executable, "../train.py"], cwd=tmp_path / "sub",
                              capture_output=True, text=True, check=True).stdout
    assert expected.startswith(f"{tmp_path}/sub/../train.py ../train.py\n")
    monkeypatch.chdir(tmp_path / "sub")
    _, main = run_command(ScriptConfig(launch=parse_command(["python", "../train.py"], 1),
                                       gpus=1), False)
    assert main.exit_status == 0, main.script_traceback
    assert capsys.readouterr().out == expected


def test_torch_compile_in_every_spelling_runs_eagerly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import torch
        model = torch.nn.Linear(4, 2).cuda()
        model.compile()
        fast = torch.compile(model, mode="max-autotune")

        @torch.compile(fullgraph=True)
        def loss_of(out):
            return out.sum()

        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            loss_of(fast(torch.randn(8, 4).cuda())).backward(); opt.step(); opt.zero_grad()
        print(fast is model)
    """))
    result, main = run_command(ScriptConfig(launch=parse_command(["python", "train.py"], 1),
                                            gpus=1, steps=5), False)
    assert main.exit_status == 0, main.script_traceback
    assert capsys.readouterr().out == "True\n"
    assert ("torch.compile at train.py:4, train.py:5, train.py:7: run eagerly"
            in " ".join(result.scenarios[0].notes))


@pytest.mark.parametrize(("spelling", "noted"), [
    ('mode="reduce-overhead"', True), ('mode="max-autotune"', True),
    ('options={"triton.cudagraphs": True}', True), ('mode="max-autotune-no-cudagraphs"', False),
    ("", False)])
def test_a_compile_that_captures_cuda_graphs_says_their_pool_is_left_out(
        spelling: str, noted: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(textwrap.dedent(f"""
        import torch
        model = torch.compile(torch.nn.Linear(4, 2).cuda(), {spelling})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            model(torch.randn(8, 4).cuda()).sum().backward(); opt.step(); opt.zero_grad()
    """))
    result, main = run_command(ScriptConfig(launch=parse_command(["python", "train.py"], 1),
                                            gpus=1, steps=5), False)
    assert main.exit_status == 0, main.script_traceback
    said = [n for n in result.scenarios[0].notes if "asks for CUDA graphs" in n]
    assert bool(said) == noted
    if noted:
        assert said[0].startswith("torch.compile at train.py:3 asks for CUDA graphs")


TRAIN_AND_SAVE = """
    import torch
    model = torch.nn.Linear(4, 2).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        model(torch.randn(8, 4).cuda()).sum().backward(); opt.step(); opt.zero_grad()
        torch.save(model.state_dict(), "ckpt.pt")
        torch.save({"model": model, "optimizer": opt.state_dict(), "step": step}, "full.pt")
        torch.save({"step": step}, "progress.pt")
    print("saved")
"""


@pytest.mark.parametrize("compute", [False, True], ids=["meta", "compute"])
def test_a_checkpoint_of_emulated_tensors_never_reaches_the_users_file(
        compute: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN_AND_SAVE))
    (tmp_path / "ckpt.pt").write_bytes(b"the user's own checkpoint")
    args = ["run", "--steps", "5", "-o", str(tmp_path / "r.json"), "-q"]
    res = runner.invoke(app, [*args, *(["--compute"] if compute else []), "--",
                              "python", "train.py"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "ckpt.pt").read_bytes() == b"the user's own checkpoint"
    # every write went into the run's overlay, host values too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "r.json", "train.py"]
    result = json.loads((tmp_path / "r.json").read_text())
    notes = " ".join(result["scenarios"][0]["notes"])
    assert "torch.save ckpt.pt at train.py:7 x3" in notes
    assert "torch.save full.pt at train.py:8 x3" in notes
    written = {w["path"]: w for w in result["writes"]}
    assert written["ckpt.pt"]["replaced"] and written["ckpt.pt"]["emulated_values"]
    assert written["full.pt"]["emulated_values"] and not written["full.pt"]["replaced"]
    assert written["progress.pt"]["kind"] == "file"
    assert result["seal"]["changed"] == []



def test_folders_the_script_makes_are_made_in_its_overlay(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # pytorch/examples' FSDP2 Checkpointer: os.makedirs(checkpoints/<time>), then torch.save
    # into it; a folder left behind reads as a checkpoint to the next run, which fails to
    # load it: no folder is made in the user's, each is listed with what it holds
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kept").mkdir()
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import os, pathlib, torch
        model = torch.nn.Linear(4, 2).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            model(torch.randn(8, 4).cuda()).sum().backward(); opt.step(); opt.zero_grad()
        os.makedirs("checkpoints/dtensor_api/1700000000000", exist_ok=True)
        torch.save(model.state_dict(), "checkpoints/dtensor_api/1700000000000/model.pt")
        pathlib.Path("kept/run1").mkdir()
        torch.save(model.state_dict(), "kept/run1/model.pt")
        os.makedirs("logs/run1")
        with open("logs/run1/log.txt", "w") as f:
            f.write("trained")
        os.makedirs("logs/run1/ckpt")
        torch.save(model.state_dict(), "logs/run1/ckpt/model.pt")
        assert sorted(os.listdir("logs/run1")) == ["ckpt", "log.txt"]
        assert open("logs/run1/log.txt").read() == "trained"
    """))
    res = runner.invoke(app, ["run", "--steps", "5", "-o", str(tmp_path / "r.json"), "-q",
                              "--", "python", "train.py"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept", "r.json", "train.py"]
    assert list((tmp_path / "kept").iterdir()) == []
    written = {w["path"]: w["kind"] for w in json.loads((tmp_path / "r.json").read_text())[
        "writes"]}
    assert written == {
        "checkpoints": "folder", "checkpoints/dtensor_api": "folder",
        "checkpoints/dtensor_api/1700000000000": "folder",
        "checkpoints/dtensor_api/1700000000000/model.pt": "file",
        "kept/run1": "folder", "kept/run1/model.pt": "file", "logs": "folder",
        "logs/run1": "folder", "logs/run1/ckpt": "folder", "logs/run1/ckpt/model.pt": "file",
        "logs/run1/log.txt": "file"}


def test_an_fsdp2_checkpoint_leaves_the_users_folder_as_it_was(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    script = Path(__file__).parent / "scripts" / "fsdp2_meta_init.py"
    res = runner.invoke(app, ["run", "--steps", "10", "-o", str(tmp_path / "r.json"), "-q",
                              "--ranks", "last",
                              "--", "torchrun", "--nproc-per-node", "4", str(script)])
    assert res.exit_code == 0, res.output
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    result = json.loads((tmp_path / "r.json").read_text())
    # the script ran to its end, as rank 0 and as the last rank (each run its own key)
    assert result["config"]["steps_done"] == {"as-written": 4, "as-written rank 3": 4}


DDP_TUTORIAL_CHECKPOINT = """
    import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
    from torch.nn.parallel import DistributedDataParallel as DDP
    CHECKPOINT_PATH = sys.argv[1]

    def demo(rank, world_size, checkpoint):
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        model = torch.nn.Linear(10, 5).to(rank)
        ddp_model = DDP(model, device_ids=[rank])
        if checkpoint:
            if rank == 0:
                torch.save(ddp_model.state_dict(), CHECKPOINT_PATH)
            dist.barrier()
            map_location = {"cuda:%d" % 0: "cuda:%d" % rank}
            state = torch.load(CHECKPOINT_PATH, map_location=map_location)
            print("loaded", sorted(state), state["module.weight"].shape,
                  state["module.weight"].device, torch.cuda.memory_allocated(rank))
            ddp_model.load_state_dict(state)
        optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.001)
        optimizer.zero_grad()
        ddp_model(torch.randn(20, 10)).sum().backward()
        optimizer.step()
        if checkpoint and rank == 0:
            os.remove(CHECKPOINT_PATH)
        dist.destroy_process_group()

    for world_size, checkpoint in ((4, False), (4, True), (2, False)):
        mp.spawn(demo, args=(world_size, checkpoint), nprocs=world_size, join=True)
        print("after the job", torch.cuda.memory_allocated(0))
"""


@pytest.mark.parametrize("users_file", [False, True], ids=["no-file", "users-file"])
def test_a_checkpoint_saved_then_loaded_back_reads_what_the_run_saved(
        users_file: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # the DDP tutorial's demo_checkpoint: rank 0 saves, every rank loads it back with
    # map_location, rank 0 removes it; the save goes into the run's overlay (a stand-in
    # checkpoint of the emulated tensors), so the load reads what the run saved, never a
    # file of the user's there, and the removal leaves the user's file as it was
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tutorial.py").write_text(textwrap.dedent(DDP_TUTORIAL_CHECKPOINT))
    ckpt = tmp_path / "model.checkpoint"
    if users_file:
        ckpt.write_bytes(b"the user's own file")
    res = runner.invoke(app, ["run", "--steps", "10", "--ranks", "none", "-o",
                              str(tmp_path / "r.json"), "--", "python", "tutorial.py", str(ckpt)])
    out = capsys.readouterr().out + res.output
    assert res.exit_code == 0, out
    # rank 0's model (2 parameter blocks), DDP's bucket (1) and the state loaded (2 more)
    assert "loaded ['module.bias', 'module.weight'] torch.Size([5, 10]) cuda:0 2560" in out
    assert (ckpt.read_bytes() == b"the user's own file") if users_file else not ckpt.exists()
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["seal"]["changed"] == []
    # what is left of the run's writes: the checkpoint removed (in the run's view only)
    # where the user had one; nothing where the user had none
    left = [(w["path"], w["kind"]) for w in result["writes"] if w["run"] == "as-written"]
    assert left == ([("model.checkpoint", "removed")] if users_file else []), left
    notes = " ".join(result["scenarios"][0]["notes"])
    assert "read back as the run saved it" in notes
    assert "torch.load model.checkpoint at tutorial.py:15" in notes


def test_a_finished_mp_spawn_job_leaves_nothing_on_its_gpus(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # each job's processes end with it on a GPU: its model, DDP's buckets and the
    # optimizer are gone before the next job starts
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tutorial.py").write_text(textwrap.dedent(DDP_TUTORIAL_CHECKPOINT))
    res = runner.invoke(app, ["run", "--steps", "10", "--ranks", "none", "-o",
                              str(tmp_path / "r.json"), "--", "python", "tutorial.py", str(tmp_path / "model.checkpoint")])
    out = capsys.readouterr().out + res.output
    assert res.exit_code == 0, out
    assert out.count("after the job 0") == 3, out
    result = json.loads((tmp_path / "r.json").read_text())
    # the script's largest job ran 4 ranks (the last one 2)
    assert [d["rank"] for d in result["scenarios"][0]["devices"]] == [0, 1, 2, 3]


def test_a_writer_bound_by_name_before_the_run_is_patched_for_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a library imported before the script runs (transformers, imported first, binds
    # safetensors' save_file by name): its name must not write emulated tensors either
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "early_saver.py").write_text("from torch import save as keep\n")
    monkeypatch.delitem(sys.modules, "early_saver", raising=False)
    import early_saver  # type: ignore[import-not-found]

    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import torch, early_saver
        model = torch.nn.Linear(4, 2).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            model(torch.randn(8, 4).cuda()).sum().backward(); opt.step(); opt.zero_grad()
            early_saver.keep(model.state_dict(), "ckpt.pt")
    """))
    (tmp_path / "ckpt.pt").write_bytes(b"the user's own checkpoint")
    res = runner.invoke(app, ["run", "-o", str(tmp_path / "r.json"), "-q", "--",
                              "python", "train.py"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "ckpt.pt").read_bytes() == b"the user's own checkpoint"
    assert early_saver.keep is torch.serialization.save  # restored after the run
    monkeypatch.delitem(sys.modules, "early_saver")


def test_numpy_save_of_values_read_from_a_virtual_gpu_goes_into_the_overlay(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import numpy as np, torch
        out = torch.nn.Linear(4, 2).cuda()(torch.randn(8, 4).cuda())
        np.save("preds.npy", out.detach().cpu().numpy())
        np.save("host.npy", np.arange(3))
    """))
    (tmp_path / "preds.npy").write_bytes(b"earlier predictions")
    result, _ = run_command(ScriptConfig(launch=parse_command(["python", "train.py"], 2),
                                         gpus=2))
    assert (tmp_path / "preds.npy").read_bytes() == b"earlier predictions"
    assert not (tmp_path / "host.npy").exists()
    written = {w.path: w for w in result.writes}
    # the predictions were read back from a virtual GPU (a stand-in host copy)
    assert written["preds.npy"].emulated_values and written["preds.npy"].replaced
    assert written["preds.npy"].size_bytes == 128 + 8 * 2 * 4  # .npy header + 8x2 float32


def test_a_host_tensor_copied_from_a_virtual_gpu_is_not_saved_as_real(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``host.copy_(gpu)`` (load_state_dict of a GPU state dict into a model on the host)
    reads values the GPU does not have: the host tensor holds stand-ins, and a save of it
    keeps the user's file; small tensors that follow from host values keep their values."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import torch
        m = torch.nn.Linear(512, 512)
        state = {k: v.cuda() * 2 for k, v in m.state_dict().items()}
        host = torch.nn.Linear(512, 512)
        host.load_state_dict(state)
        print(torch.equal(host.bias, m.bias * 2))  # 2 KiB: followed, real
        torch.save(host.state_dict(), "weights.pt")
    """))
    (tmp_path / "weights.pt").write_bytes(b"the user's weights")
    result, status = run_command(ScriptConfig(launch=parse_command(["python", "train.py"], 1),
                                              gpus=1), False)
    assert status.exit_status == 0, status.script_traceback
    assert (tmp_path / "weights.pt").read_bytes() == b"the user's weights"
    notes = " ".join(result.scenarios[0].notes)
    assert "torch.save weights.pt at train.py:8" in notes
    # the 1 MiB weight; the site named as typed (python train.py), not by its absolute path
    assert "(host copy x1): train.py:6 (host copy) x1" in notes
    assert capsys.readouterr().out == "True\n"


DP_WITH_SIDE_EFFECTS = """
    import logging, os
    import torch
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.makedirs("out", exist_ok=True)
    model = torch.nn.DataParallel(torch.nn.Linear(16, 4).cuda())
    criterion = torch.nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
    loader = torch.utils.data.DataLoader(ds, batch_size=16)
    with open("out/log.txt", "a") as log:
        for step, (x, y) in enumerate(loader):
            outputs = model(x.cuda())
            loss = criterion(outputs, y.cuda())
            opt.zero_grad(); loss.backward(); opt.step()
            print("step", step, loss.item())  # what the model computes: a stand-in
            logging.info("logged %d", step)
            log.write(f"{step}\\n")
            torch.save({"step": step}, "out/progress.pt")
"""


def test_the_alternatives_write_and_print_nothing_the_user_sees_or_another_run_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(textwrap.dedent(DP_WITH_SIDE_EFFECTS))
    result, _ = run_command(ScriptConfig(launch=parse_command(["python", "train.py"], 4)))
    names = [s.name for s in result.scenarios]
    assert names == ["dp-loss-primary", "dp-loss-forward", "ddp"]  # both alternatives ran
    captured = capsys.readouterr()
    assert captured.out == "step 0 1.0\nstep 1 1.0\n"  # the run as written only, once
    assert list(tmp_path.iterdir()) == [tmp_path / "train.py"]
    # each run wrote its own log into its own overlay: none saw another's lines
    logs = {(w.run, w.path): w.size_bytes for w in result.writes if w.path == "out/log.txt"}
    assert logs == {(run, "out/log.txt"): 4 for run in ("as-written", "loss-in-forward", "ddp")}


@pytest.mark.parametrize(("source", "expected"), [
    ("def f(:\n", "SyntaxError: invalid syntax"),
    ("import torch\nraise RuntimeError('my own error')\n", "RuntimeError: my own error"),
    ("import datasets_that_are_not_installed\n",
     "ModuleNotFoundError: No module named 'datasets_that_are_not_installed'"),
], ids=["syntax", "raises", "import"])
def test_the_scripts_error_is_shown_as_the_script_would_show_it(
        source: str, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(source)
    res = runner.invoke(app, ["run", "--", "python", "train.py"])
    assert res.exit_code == 1
    assert expected in res.stderr
    assert "internal error" not in res.output
    assert "nothing was measured; no report written to dpprof-reports/run-" in res.stderr
    assert not list(tmp_path.glob("dpprof-reports/*"))
    if "SyntaxError" not in expected:
        # the script's own frame, named as Python names it
        assert f'File "{tmp_path / "train.py"}", line' in res.stderr
        assert "dpprof/" not in res.stderr.split("Traceback", 1)[-1]


def test_an_error_without_a_message_is_named_without_an_empty_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(
        "import torch\nx = torch.ones(4, device='cuda')\nraise EOFError()\n")
    result, main = run_command(ScriptConfig(launch=parse_command(["python", "train.py"], 4)),
                               False)
    assert main.exit_status == 1
    assert result.scenarios[0].message == "the script raised EOFError"  # not "EOFError: "


def test_a_module_that_does_not_exist_says_what_python_says(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["run", "--", "python", "-m", "no_such_module_here"])
    assert res.exit_code == 1
    assert f"{sys.executable}: No module named no_such_module_here" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_script_that_never_touches_cuda_says_nothing_was_measured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """README's exit table: 1 where nothing was measured, with the line saying why."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nogpu.py").write_text("print('hello')\n")
    res = runner.invoke(app, ["run", "-o", "r.json", "--", "python", "nogpu.py"])
    assert res.exit_code == 1, res.output
    assert res.stdout.startswith("hello\n")
    assert ("dpprof: the script ended without putting anything on a GPU (no tensor or module "
            "moved to cuda): nothing was measured; no report written to r.json (exit status 1)"
            ) in res.stderr
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("source", [
    "import sys\nprint('done')\nsys.exit(0)\n",
    "import torch\nprint(torch.cuda.is_available(), torch.cuda.device_count())\n",
    "import torch\nx = torch.empty(0, device='cuda:0')\n",  # no byte on a GPU
], ids=["sys-exit-0", "asks-only", "empty-tensor"])
def test_every_run_that_measured_nothing_exits_1(
        source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(source)
    res = runner.invoke(app, ["run", "-q", "-o", "r.json", "--", "python", "train.py"])
    assert res.exit_code == 1, res.output
    assert "nothing was measured; no report written to r.json (exit status 1)" in res.stderr


def test_a_script_that_trains_on_the_host_is_said_to_be_stopped_not_ended(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nanoGPT's --device=cpu: its steps run on the host; dpprof stops it after --steps."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import torch
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(10):
            model(torch.randn(8, 4)).sum().backward(); opt.step(); opt.zero_grad()
            print("step", step)
    """))
    res = runner.invoke(app, ["run", "--steps", "2", "--", "python", "train.py"])
    assert res.exit_code == 1, res.output  # nothing was measured
    assert res.stdout.startswith("step 0\n")
    assert "step 2" not in res.stdout
    assert ("dpprof: the script ran its 2 optimizer step(s) (--steps; stopped there) without "
            "putting anything on a GPU") in res.stderr


def test_a_rank_of_mp_spawn_that_raises_shows_its_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import torch
        import torch.multiprocessing as mp

        def main(rank, world_size):
            model = torch.nn.Linear(4, 4).to(rank)
            raise ValueError(f"rank {rank} cannot find its data")

        if __name__ == "__main__":
            mp.spawn(main, args=(2,), nprocs=2, join=True)
    """))
    res = runner.invoke(app, ["run", "--gpus", "2", "-o", str(tmp_path / "r.json"), "--",
                              "python", "train.py"])
    assert res.exit_code == 1
    assert "ValueError: rank 0 cannot find its data" in res.stderr
    assert "internal error" not in res.output
    assert os.path.exists(tmp_path / "r.json")  # its parameters reached the GPU: measured


def test_an_interrupted_run_writes_what_it_measured_marked_partial(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import torch
        model = torch.nn.Linear(4, 2).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(10):
            model(torch.randn(8, 4).cuda()).sum().backward(); opt.step(); opt.zero_grad()
            if step == 1:
                raise KeyboardInterrupt  # what Ctrl-C raises in the script's loop
    """))
    with pytest.raises(Interrupted) as caught:
        run_command(ScriptConfig(launch=parse_command(["python", "train.py"], 4), steps=5))
    assert caught.value.signum == signal.SIGINT
    partial = caught.value.partial
    assert partial.interrupted == "SIGINT"
    assert partial.scenarios[0].devices[0].peak_allocated_bytes > 0
    res = runner.invoke(app, ["run", "--steps", "5", "-o", str(tmp_path / "r.json"), "--",
                              "python", "train.py"])
    assert res.exit_code == 130
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["interrupted"] == "SIGINT"
    assert saved["comparison"]["verdict"].startswith("Partial result: interrupted by SIGINT")


def test_an_interrupt_before_the_first_batch_leaves_a_partial_result_that_renders(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C after DataParallel's model is on the GPUs and before its first batch: the
    partial result holds the model's memory and no batch; no fix is read off a step never
    taken, and ``dpprof report`` renders it (its fixes read from its scenarios: none)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        model = nn.DataParallel(nn.Linear(8, 8).cuda())
        raise KeyboardInterrupt  # what Ctrl-C raises before the loop
    """))
    res = runner.invoke(app, ["run", "-o", "r.json", "--", "python", "train.py"])
    assert res.exit_code == 130, res.output
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["interrupted"] == "SIGINT" and saved["batch"] == 0
    assert saved["config"]["interrupted_in"] == "the script as written"
    assert saved["scenarios"][0]["devices"][0]["peak_allocated_bytes"] > 0
    assert saved["fixes"] == []
    res = runner.invoke(app, ["report", "r.json", "-o", "r.html"])
    assert res.exit_code == 0, res.output
    assert "interrupted by SIGINT" in (tmp_path / "r.html").read_text()


SMALL_VALUES = """
    import torch
    labels = torch.tensor([3, 1, 2, 0]).cuda()
    mask = torch.ones(2, 8, dtype=torch.long).to("cuda")
    print("mask", bool(mask.all()), "labels", int(labels.sum()), labels.tolist(),
          labels.cpu().numpy().tolist(), int((labels == 2).nonzero()[0, 0]))
    model = torch.nn.Linear(4, 4).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = torch.zeros((), device="cuda")
    total = torch.zeros(4, device="cuda")
    for step in range(3):
        out = model(torch.randn(2, 4).cuda())
        total.add_(out[0].detach())  # now follows the model's arithmetic: no values
        out.sum().backward(); opt.step(); opt.zero_grad()
        seen += 1
        print("seen", int(seen), "total", total.sum().item())
"""


def test_small_values_from_host_data_are_read_back_real(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(textwrap.dedent(SMALL_VALUES))
    result, _ = run_command(ScriptConfig(launch=parse_command(["python", "train.py"], 2),
                                         gpus=2, steps=5))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "mask True labels 6 [3, 1, 2, 0] [3, 1, 2, 0] 2"
    # the counter is real; the sum of model outputs is a stand-in (1.0), never a stale 0
    assert lines[1:] == ["seen 1 total 1.0", "seen 2 total 1.0", "seen 3 total 1.0"]
    notes = " ".join(result.scenarios[0].notes)
    assert "3 value(s) read from emulated tensors answered with stand-ins (item x3)" in notes


def test_a_library_branching_on_a_stand_in_is_named() -> None:
    from dpprof.script.notes import library_branches

    lib = "/opt/py/site-packages"
    sites = {f"{lib}/transformers/masking_utils.py:292 (bool)": 3,
             "/home/me/train.py:40 (bool)": 1, f"{lib}/timm/layers.py:9 (item)": 2}
    (note,) = library_branches(sites)
    assert "transformers/masking_utils.py:292" in note
    assert "train.py" not in note and "timm" not in note
    assert "may take the other path" in note


def test_hugging_face_reads_an_all_ones_attention_mask_as_a_gpu_would(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parent))
    from torchvision_shim import import_torchvision

    import_torchvision()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=64)
        model = LlamaForCausalLM(config).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(3):
            ids = torch.randint(0, 128, (2, 16)).cuda()
            mask = torch.ones(2, 16, dtype=torch.long).cuda()
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
            loss.backward(); optimizer.step(); optimizer.zero_grad()
    """))
    result, _ = run_command(ScriptConfig(launch=parse_command(["python", "train.py"], 1),
                                         gpus=1))
    notes = " ".join(result.scenarios[0].notes)
    assert result.scenarios[0].devices[0].peak_allocated_bytes > 0
    assert "stand-in" not in notes  # the mask's values are real: no branch guessed


def test_the_bucket_view_alternative_is_what_ddp_with_the_option_allocates(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """run's third answer, DDP(gradient_as_bucket_view=True), is followed in a ledger while
    the DDP alternative runs plain: it must equal running that alternative with the option."""
    import dataclasses
    import functools

    from dpprof.script import wrappers
    from dpprof.script.runner import run_script
    from dpprof.script.strategy_registry import alternative_named

    script = str(Path(__file__).parent / "scripts" / "dp_loss_outside.py")
    cfg = ScriptConfig(launch=parse_command(["python", script], 4),
                       alternative=alternative_named("ddp"))
    followed = run_script(cfg)
    assert followed.alternative_state.bucket_view_peak_bytes is not None
    plain_peak = followed.scenario.devices[0].peak_allocated_bytes
    monkeypatch.setattr(wrappers, "EmulatedDDP", functools.partial(
        wrappers.EmulatedDDP, gradient_as_bucket_view=True))
    with_option = run_script(dataclasses.replace(cfg))
    assert with_option.scenario.devices[0].peak_allocated_bytes == \
        followed.alternative_state.bucket_view_peak_bytes
    assert followed.alternative_state.bucket_view_peak_bytes <= plain_peak
    result, _ = run_command(ScriptConfig(launch=parse_command(["python", script], 4)))
    fix = next(f for f in result.fixes if f.name == "gradient-as-bucket-view")
    assert fix.max_peak_bytes == followed.alternative_state.bucket_view_peak_bytes
    assert "device_ids=[rank], gradient_as_bucket_view=True)" in fix.code
