"""The ways of writing a file that emptied, zeroed or faked a user's file before ``dpprof
run`` was sealed (issue 30's list), one test each, under plain ``.cuda()`` and under
``nn.DataParallel``: the folder is byte for byte as it was, and the script, which reads back
what it wrote, runs as on a GPU (save then load, the atomic rename, a copy). Each is also run
with the seal off, to show that the case does change the user's file there: the test holds
only because of the seal."""

from __future__ import annotations

import hashlib
import multiprocessing.util
import os
import textwrap
from pathlib import Path

import pytest

from dpprof.script.session import ScriptConfig, parse_command, run_command

HEAD = """
import gzip, io, json, os, pickle, shutil, tempfile
from pathlib import Path
import numpy as np
import torch

model = torch.nn.Linear(4, 3).cuda()
if PLACEMENT == "data-parallel":
    model = torch.nn.DataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    loss = model(torch.randn(8, 4).cuda()).sum()
    loss.backward(); opt.step(); opt.zero_grad()
sd = model.state_dict()
keys = set(sd)
a = model(torch.ones(2, 4).cuda()).detach().cpu().numpy()  # read back from the GPU
"""

# case -> (the script's lines after HEAD, the user's files it writes over)
CASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "bytesio-written-out": ("""
        buf = io.BytesIO(); torch.save(sd, buf)
        open("ckpt.pt", "wb").write(buf.getvalue())
        assert set(torch.load("ckpt.pt")) == keys
    """, ("ckpt.pt",)),
    "bytesio-write-bytes": ("""
        buf = io.BytesIO(); torch.save(sd, buf)
        Path("ckpt.pt").write_bytes(buf.getvalue())
        assert set(torch.load("ckpt.pt")) == keys
    """, ("ckpt.pt",)),
    "bytesio-gzip": ("""
        buf = io.BytesIO(); torch.save(sd, buf)
        with gzip.open("ckpt.pt", "wb") as f:
            f.write(buf.getvalue())
        with gzip.open("ckpt.pt", "rb") as f:
            assert set(torch.load(f)) == keys
    """, ("ckpt.pt",)),
    "named-temporary-file-replace": ("""
        with tempfile.NamedTemporaryFile(dir=".", delete=False) as f:
            torch.save(sd, f)
        os.replace(f.name, "ckpt.pt")
        assert set(torch.load("ckpt.pt")) == keys and not os.path.exists(f.name)
    """, ("ckpt.pt",)),
    "mkstemp-rename": ("""
        fd, tmp = tempfile.mkstemp(dir=".", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            torch.save(sd, f)
        os.rename(tmp, "ckpt.pt")
        assert set(torch.load("ckpt.pt")) == keys
    """, ("ckpt.pt",)),
    "os-open-fdopen": ("""
        fd = os.open("ckpt.pt", os.O_WRONLY | os.O_TRUNC)
        with os.fdopen(fd, "wb") as f:
            torch.save(sd, f)
        assert set(torch.load("ckpt.pt")) == keys
    """, ("ckpt.pt",)),
    "pickle-dump": ("""
        with open("sd.pkl", "wb") as f:
            pickle.dump(model.state_dict(), f)
        with open("sd.pkl", "rb") as f:
            back = pickle.load(f)
        assert set(back) == keys and back[sorted(keys)[-1]].shape == (3, 4)
    """, ("sd.pkl",)),
    "np-save": ("""
        np.save("arr.npy", a * 2.0)
        assert (np.load("arr.npy") == a * 2.0).all()
    """, ("arr.npy",)),
    "tobytes": ("""
        with open("arr.bin", "wb") as f:
            f.write(a.tobytes())
        assert open("arr.bin", "rb").read() == a.tobytes()
    """, ("arr.bin",)),
    "np-savetxt": ("""
        np.savetxt("arr.txt", a)
        assert np.allclose(np.loadtxt("arr.txt", ndmin=2), a)
    """, ("arr.txt",)),
    "pil-save": ("""
        from PIL import Image
        Image.fromarray((a * 255).astype(np.uint8)).save("img.png")
        assert Image.open("img.png").size == (3, 2)
    """, ("img.png",)),
    "json-tolist": ("""
        json.dump(torch.from_numpy(a).tolist(), open("t.json", "w"))
        assert json.load(open("t.json")) == a.tolist()
    """, ("t.json",)),
    "csv-of-loss-item-appended": ("""
        with open("log.csv", "a") as log:
            log.write(f"2,{loss.item()}\\n")
        assert open("log.csv").read().endswith(f"2,{loss.item()}\\n")
    """, ("log.csv",)),
    "tensorboard-scalars": ("""
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter("runs")
        writer.add_scalar("loss", loss.item(), 2)
        writer.close()
        assert any(n.startswith("events.out") for n in os.listdir("runs"))
    """, ("runs/events.out.tfevents.users",)),
    "save-then-replace": ("""
        torch.save(sd, "x.tmp")
        os.replace("x.tmp", "x")
        assert set(torch.load("x")) == keys and not os.path.exists("x.tmp")
    """, ("x",)),
    "copy-after-save": ("""
        torch.save(sd, "ckpt.pt")
        shutil.copy("ckpt.pt", "best.pt")
        assert set(torch.load("best.pt")) == keys
    """, ("ckpt.pt", "best.pt")),
}


def digest_tree(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[os.path.relpath(os.path.join(dirpath, name), root)] = "dir"
        for name in filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def run_case(tmp_path: Path, case: str, placement: str, sealed: bool) -> tuple[dict[str, str],
                                                                             dict[str, str], int]:
    """The folder's digests before and after the case's script, and its exit status."""
    multiprocessing.util.get_temp_dir()  # the process's own, made before the test's folder
    if case == "pil-save":
        pytest.importorskip("PIL")
    if case == "tensorboard-scalars":
        pytest.importorskip("tensorboard")
    body, users = CASES[case]
    for name in users:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"the user's own file\n")
    (tmp_path / "train.py").write_text(f"PLACEMENT = {placement!r}\n" + HEAD
                                       + textwrap.dedent(body))
    before = digest_tree(tmp_path)
    _, main = run_command(ScriptConfig(launch=parse_command(["python", "train.py"], 2),
                                       gpus=2, steps=10, seal=sealed), False)
    return before, digest_tree(tmp_path), main.exit_status


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.mark.parametrize("placement", ["cuda", "data-parallel"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_users_files_are_untouched_and_the_script_runs_as_on_a_gpu(
        tmp_path: Path, case: str, placement: str) -> None:
    before, after, status = run_case(tmp_path, case, placement, sealed=True)
    assert status == 0, case
    assert after == before, case


@pytest.mark.parametrize("case", sorted(CASES))
def test_without_the_seal_the_case_changes_the_users_file(tmp_path: Path, case: str) -> None:
    before, after, _ = run_case(tmp_path, case, "cuda", sealed=False)
    assert after != before, f"{case}: the case never touched the user's file"
