"""The ways of writing a file that emptied, zeroed or faked a user's file before ``dpprof
run`` was sealed (issue 30's list), one test each, under plain ``.cuda()`` and under
``nn.DataParallel``: the folder is byte for byte as it was, and the script, which reads back
what it wrote, runs as on a GPU (save then load, the atomic rename, a copy). Each is also run
with the seal off, to show that the case does change the user's file there: the test holds
only because of the seal. Sealed, each runs as a user runs it (``dpprof run -o r.json``), and
the JSON result and the terminal report list what the script wrote -- the user's path, in
place of their file, holding values of the virtual GPUs -- where they once said nothing."""

from __future__ import annotations

import hashlib
import json
import multiprocessing.util
import os
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpprof.cli.app import app
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
    "named-temporary-file-rename": ("""
        with tempfile.NamedTemporaryFile(dir=".", suffix=".tmp", delete=False) as f:
            torch.save(sd, f)
        os.rename(f.name, "ckpt.pt")
        assert set(torch.load("ckpt.pt")) == keys
    """, ("ckpt.pt",)),
    "mkstemp-replace": ("""
        fd, tmp = tempfile.mkstemp(dir=".")
        with os.fdopen(fd, "wb") as f:
            torch.save(sd, f)
        os.replace(tmp, "ckpt.pt")
        assert set(torch.load("ckpt.pt")) == keys and not os.path.exists(tmp)
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


def prepare_case(tmp_path: Path, case: str, placement: str) -> dict[str, str]:
    """The case's script and the user's files it writes over, in ``tmp_path``; the folder's
    digests."""
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
    return digest_tree(tmp_path)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.mark.parametrize("placement", ["cuda", "data-parallel"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_users_files_are_untouched_and_the_report_lists_what_the_script_wrote(
        tmp_path: Path, case: str, placement: str) -> None:
    before = prepare_case(tmp_path, case, placement)
    reports = tmp_path.parent / f"{tmp_path.name}-reports"
    reports.mkdir()
    res = CliRunner().invoke(app, ["run", "--gpus", "2", "--steps", "10",
                                   "-o", str(reports / "r.json"), "--", "python", "train.py"])
    assert res.exit_code == 0, f"{case}: {res.output}"
    assert digest_tree(tmp_path) == before, case
    result = json.loads((reports / "r.json").read_text())
    assert result["seal"]["changed"] == [], case
    # every run (as written, and each alternative under nn.DataParallel) wrote the case's
    # file, in place of the user's, with values read back from a virtual GPU
    written = {(w["run"], w["path"]): w for w in result["writes"]}
    runs = {w["run"] for w in result["writes"]}
    assert "as-written" in runs, case
    if placement == "data-parallel":
        assert len(runs) > 1, f"{case}: only {runs} listed writes"
    for run in runs:
        for name in CASES[case][1]:
            if name.startswith("runs/"):  # TensorBoard names its own file beside the user's
                new = [w for (r, p), w in written.items() if r == run and p.startswith("runs/")]
                assert new and all(w["emulated_values"] and not w["replaced"] for w in new), \
                    (case, run, result["writes"])
                continue
            w = written.get((run, name))
            assert w is not None, (case, run, name, result["writes"])
            assert w["kind"] == "file" and w["size_bytes"] > 0, (case, w)
            assert w["replaced"] and w["emulated_values"], (case, w)
    # the terminal wraps the summary and the notes at its width (80 columns here)
    printed = " ".join(res.output.split())
    assert "your files are as they were after every run" in printed, case
    assert "in place of your file" in printed or case == "tensorboard-scalars", case
    shown = CASES[case][1][0]
    assert shown.startswith("runs/") or shown in printed, case


@pytest.mark.parametrize("case", sorted(CASES))
def test_without_the_seal_the_case_changes_the_users_file(tmp_path: Path, case: str) -> None:
    before = prepare_case(tmp_path, case, "cuda")
    run_command(ScriptConfig(launch=parse_command(["python", "train.py"], 2), gpus=2,
                             steps=10, seal=False), False)
    assert digest_tree(tmp_path) != before, f"{case}: the case never touched the user's file"


LONG_PATHS = """\
import os
import torch
import torch.nn as nn

model = nn.Linear(64, 64).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
folder = "outputs/run-2026-11-29/checkpoint-2/pytorch_model_fsdp_0"
os.makedirs(folder, exist_ok=True)
torch.save(model.state_dict(), os.path.join(folder, "model_weights.pt"))
"""


def test_at_80_columns_a_long_path_folds_and_the_note_is_whole(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """The terminal's list of what the script wrote, 80 columns wide: a checkpoint's path as
    Hugging Face's Trainer names them left the note "values of the virtual GPUs" a column
    of "virtu…" and "(stan…"; the path folds now, and every word of the note is there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(LONG_PATHS)
    res = CliRunner().invoke(app, ["run", "--gpus", "1", "--steps", "10", "-o",
                                   str(tmp_path.parent / f"{tmp_path.name}.json"), "--",
                                   "python", "train.py"])
    assert res.exit_code == 0, res.output
    table = res.output[res.output.index("the script wrote"):]
    assert "…" not in table
    words = " ".join(table.split())
    # the note's lines sit beside the folded path's
    assert "values of the virtual GPUs" in words and "(stand-ins)" in words
    assert "/model_weights.pt" in words and "point-2/" in words  # the path, folded
