"""``dpprof run`` is sealed, checked on programs hypothesis writes: a training script (on one
GPU or under DataParallel) that then writes a value (read back from a virtual GPU, or the
host's own) with one of the ordinary writers (``torch.save``, ``pickle``, ``np.save``,
``tobytes``, ``np.savetxt``, ``tofile``, JSON of ``tolist()``, a CSV line appended, Pillow),
to a path of one kind (relative, nested new folders, absolute, ``~/.cache``, the temporary
folder), through a buffer (none, ``BytesIO``, gzip, a ``mkstemp`` file renamed into place),
then renamed, replaced, copied or moved, over a file of the user's or none; the script
reads its file back and checks it holds what it wrote, as on a GPU.

For every program: the script's own checks pass (save-then-load and the rename work as on
a GPU), the folder under test (working directory, home, temporary folder) is byte for byte
as it was, and the result lists the final file, with emulated values exactly where the
value came from a virtual GPU."""

from __future__ import annotations

import hashlib
import multiprocessing.util
import os
import shutil
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dpprof.script.session import ScriptConfig, parse_command, run_command

USER_BYTES = b"the user's own file, from an earlier run"

# writer -> (code writing `arr` / `value` into the binary file object `f`, code reading the
# final path `final` back into `back`, the check that `back` is what was written)
WRITERS: dict[str, tuple[str, str, str]] = {
    "torch.save": ("torch.save(value_gpu if from_gpu else value, f)",
                   "back = torch.load(final)",
                   "assert tuple(back.shape) == tuple(value.shape)"),
    "pickle": ("pickle.dump(value.tolist(), f)",
               "back = pickle.load(open(final, 'rb'))",
               "assert back == value.tolist()"),
    "np.save": ("np.save(f, arr)", "back = np.load(final)", "assert (back == arr).all()"),
    "tobytes": ("f.write(arr.tobytes())",
                "back = np.frombuffer(open(final, 'rb').read(), dtype=arr.dtype)",
                "assert (back == arr.ravel()).all()"),
    "np.savetxt": ("np.savetxt(f, arr)", "back = np.loadtxt(final, ndmin=2)",
                   "assert np.allclose(back, arr)"),
    "tofile": ("arr.tofile(f)", "back = np.fromfile(final, dtype=arr.dtype)",
               "assert (back == arr.ravel()).all()"),
    "json": ("f.write(json.dumps(arr.tolist()).encode())",
             "back = json.load(open(final))", "assert back == arr.tolist()"),
    "pil": ("Image.fromarray((arr * 0 + 7).astype(np.uint8)).save(f, format='PNG')",
            "back = np.asarray(Image.open(final))", "assert (back == 7).all()"),
}
# buffers: how the bytes reach `path` (code around WRITERS' code, which writes into `f`)
BUFFERS = {
    "none": "with open(path, 'wb') as f:\n    {write}\n",
    "bytesio": ("buf = io.BytesIO()\nf = buf\n{write}\n"
                "open(path, 'wb').write(buf.getvalue())\n"),
    "bytesio-pathlib": ("buf = io.BytesIO()\nf = buf\n{write}\n"
                        "Path(path).write_bytes(buf.getvalue())\n"),
    "mkstemp": ("fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))\n"
                "with os.fdopen(fd, 'wb') as f:\n    {write}\nos.replace(tmp, path)\n"),
    "named-temporary": ("with tempfile.NamedTemporaryFile(dir=os.path.dirname(path), "
                        "delete=False) as f:\n    {write}\nos.rename(f.name, path)\n"),
}
PATHS = {
    "relative": "'out.bin'",
    "nested": "'runs/exp1/ckpt/out.bin'",
    "absolute": "os.path.abspath('out.bin')",
    "cache": "os.path.expanduser('~/.cache/proj/out.bin')",
    "tmp": "os.path.join(tempfile.gettempdir(), 'out.bin')",
}
FINISH = {
    "none": "final = path\n",
    "replace": "final = path + '.final'\nos.replace(path, final)\n",
    "rename": "final = path + '.final'\nos.rename(path, final)\n",
    "copy": "final = path + '.final'\nshutil.copy(path, final)\nassert os.path.exists(path)\n",
    "move": "final = path + '.final'\nshutil.move(path, final)\n",
    "pathlib-rename": "final = path + '.final'\nPath(path).rename(final)\n",
}


def script(writer: str, buffer: str, path: str, finish: str, from_gpu: bool,
           data_parallel: bool) -> str:
    write, read, check = WRITERS[writer]
    body = BUFFERS[buffer].format(write=write)
    return textwrap.dedent(f"""\
        import gzip, io, json, os, pickle, shutil, tempfile
        from pathlib import Path
        import numpy as np
        import torch
        from PIL import Image

        model = torch.nn.Linear(4, 3).cuda()
        {"model = torch.nn.DataParallel(model)" if data_parallel else ""}
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            model(torch.randn(8, 4).cuda()).sum().backward()
            opt.step()
            opt.zero_grad()
        from_gpu = {from_gpu}
        value_gpu = model(torch.ones(2, 4).cuda()).detach()
        value = value_gpu.cpu() if from_gpu else torch.arange(6.0).view(2, 3)
        arr = value.numpy()
        path = {PATHS[path]}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        """) + body + FINISH[finish] + textwrap.dedent(f"""\
        {read}
        {check}
        print("checked", final)
        """)


def gzip_script(from_gpu: bool) -> str:
    """A gzip'd checkpoint of ``torch.save``, and a CSV of ``loss.item()`` appended to the
    user's log: the two writers whose buffer is their own."""
    return textwrap.dedent(f"""\
        import gzip, torch
        model = torch.nn.Linear(4, 3).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            loss = model(torch.randn(8, 4).cuda()).sum()
            loss.backward(); opt.step(); opt.zero_grad()
            with open("log.csv", "a") as log:
                log.write(f"{{step}},{{loss.item() if {from_gpu} else 0.5}}\\n")
        with gzip.open("ckpt.pt.gz", "wb") as f:
            torch.save(model.state_dict(), f)
        with gzip.open("ckpt.pt.gz", "rb") as f:
            back = torch.load(f)
        assert sorted(back) == ["bias", "weight"] and back["weight"].shape == (3, 4)
        lines = open("log.csv").read().splitlines()
        assert lines[0] == "the user's log" and len(lines) == 3, lines
        print("checked")
        """)


def digest_tree(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[os.path.relpath(os.path.join(dirpath, name), root)] = "dir"
        for name in filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The folder under test: the working directory, the home folder and the temporary
    folder the script sees, all inside it."""
    multiprocessing.util.get_temp_dir()  # the process's own, made once, before the test
    for sub in ("work", "home/.cache", "tmp"):
        (tmp_path / sub).mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return tmp_path


def run_sealed(world: Path, text: str, **kw: Any) -> tuple[Any, Any]:
    (world / "work" / "train.py").write_text(text)
    return run_command(ScriptConfig(launch=parse_command(["python", "train.py"], 2), gpus=2,
                                    steps=10, **kw), False)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(writer=st.sampled_from(sorted(WRITERS)), buffer=st.sampled_from(sorted(BUFFERS)),
       path=st.sampled_from(sorted(PATHS)), finish=st.sampled_from(sorted(FINISH)),
       from_gpu=st.booleans(), data_parallel=st.booleans(), users_file=st.booleans())
def test_every_write_program_leaves_the_folder_byte_identical(
        world: Path, capsys: pytest.CaptureFixture[str], writer: str, buffer: str, path: str,
        finish: str, from_gpu: bool, data_parallel: bool, users_file: bool) -> None:
    assume(not (writer == "tofile" and buffer.startswith("bytesio")))  # tofile needs a fileno
    for sub in ("work", "home", "tmp"):  # hypothesis runs every example in one fixture
        shutil.rmtree(world / sub)
        (world / sub).mkdir()
    (world / "home" / ".cache").mkdir()
    os.chdir(world / "work")
    text = script(writer, buffer, path, finish, from_gpu, data_parallel)
    if users_file:  # a file of the user's at the path and at the final path
        target = {"relative": world / "work" / "out.bin", "nested": None,
                  "absolute": world / "work" / "out.bin",
                  "cache": world / "home" / ".cache" / "out.bin",
                  "tmp": world / "tmp" / "out.bin"}[path]
        if target is not None:
            target.write_bytes(USER_BYTES)
            Path(str(target) + ".final").write_bytes(USER_BYTES)
    (world / "work" / "train.py").write_text(text)
    before = digest_tree(world)
    result, main = run_sealed(world, text)
    out = capsys.readouterr().out
    assert main.exit_status == 0, f"{main.script_traceback}\n{text}"
    assert "checked" in out, text
    assert digest_tree(world) == before, text
    final = [w for w in result.writes if w.kind == "file" and (
        w.path.endswith(".final") or (finish == "none" and w.path.endswith("out.bin")))]
    assert len(final) == 1, (result.writes, text)
    assert final[0].emulated_values == from_gpu, (final[0], text)
    assert result.seal is not None and result.seal.changed == ()


@pytest.mark.parametrize("from_gpu", [True, False])
def test_a_gzip_checkpoint_and_a_csv_appended_to_the_users_log(
        world: Path, from_gpu: bool, capsys: pytest.CaptureFixture[str]) -> None:
    (world / "work" / "log.csv").write_text("the user's log\n")
    text = gzip_script(from_gpu)
    (world / "work" / "train.py").write_text(text)
    before = digest_tree(world)
    result, main = run_sealed(world, text)
    assert main.exit_status == 0, main.script_traceback
    assert "checked" in capsys.readouterr().out
    assert digest_tree(world) == before
    written = {w.path: w for w in result.writes}
    assert written["log.csv"].replaced and written["log.csv"].emulated_values == from_gpu
    assert written["log.csv"].size_bytes == len("the user's log\n") + len(
        "0,1.0\n1,1.0\n" if from_gpu else "0,0.5\n1,0.5\n")
    assert written["ckpt.pt.gz"].emulated_values  # a stand-in of the GPU's tensors
