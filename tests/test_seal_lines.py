"""The seal's lines beyond Python's file calls, ``dpprof run`` as a user runs it (a process of
its own):

* the kernel line (a mount namespace, where the machine allows one): writers that never go
  through Python -- C's stdio through ctypes, a shell started by the script -- write into
  the run's overlay;
* without it, the check after the run finds what such a writer changed, says so loudly and
  exits 1; a write around Python's line that Python can see (``_io.FileIO``, ``posix.open``)
  is stopped before it happens, naming the path;
* code that opens paths outside Python (safetensors, h5py, sqlite3), imported by the
  script, is handed the overlay's path; where another such reader does not find a file
  the run wrote, dpprof says why (a C library's own open, not a missing file);
* logging services get no stand-in values; ``--keep-writes`` keeps the writes; the reports
  list them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpprof.cli.app import app
from dpprof.script import namespace
from dpprof.script.session import ScriptConfig, parse_command, run_command

runner = CliRunner()

C_WRITERS = """
    import ctypes, subprocess, torch
    model = torch.nn.Linear(4, 2).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(8, 4).cuda()).sum().backward(); opt.step(); opt.zero_grad()
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.fwrite.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    f = libc.fopen(b"stdio.bin", b"wb")
    libc.fwrite(b"written by C", 1, 12, f)
    libc.fclose(f)
    subprocess.run(["sh", "-c", "echo from a shell > shell.txt"], check=True)
    assert open("stdio.bin", "rb").read() == b"written by C"
    assert open("shell.txt").read() == "from a shell\\n"
    print("checked")
"""


def digest_tree(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[os.path.relpath(os.path.join(dirpath, name), root)] = "dir"
        for name in filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def dpprof(args: list[str], cwd: Path, namespace: bool) -> subprocess.CompletedProcess[str]:
    """``python -m dpprof run ARGS`` in a process of its own, in ``cwd``."""
    env = {k: v for k, v in os.environ.items() if k != "DPPROF_NO_NAMESPACE"}
    if not namespace:
        env["DPPROF_NO_NAMESPACE"] = "1"
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run([sys.executable, "-m", "dpprof", "run", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def kernel_line() -> str | None:
    """None where this machine gives dpprof a mount namespace, else why not."""
    env = {k: v for k, v in os.environ.items() if k != "DPPROF_NO_NAMESPACE"}
    out = subprocess.run([sys.executable, "-c", "from dpprof.script import namespace as n; "
                          "print(n.enter(), n.why_not())"], env=env, capture_output=True,
                         text=True, timeout=120).stdout.strip()
    return None if out.startswith("True") else out


def test_writers_outside_python_write_into_the_kernels_overlay(tmp_path: Path) -> None:
    why = kernel_line()
    if why is not None:
        pytest.skip(f"no mount namespace on this machine: {why}")
    (tmp_path / "train.py").write_text(textwrap.dedent(C_WRITERS))
    (tmp_path / "stdio.bin").write_bytes(b"the user's own file")
    before = digest_tree(tmp_path)
    res = dpprof(["-q", "-o", "r.json", "--", "python", "train.py"], tmp_path, namespace=True)
    assert res.returncode == 0, res.stderr
    assert "checked" in res.stdout
    after = digest_tree(tmp_path)
    assert after.pop("r.json")
    assert after == before
    result = json.loads((tmp_path / "r.json").read_text())
    written = {w["path"]: w for w in result["writes"]}
    assert written["stdio.bin"]["replaced"] and written["stdio.bin"]["size_bytes"] == 12
    assert written["shell.txt"]["size_bytes"] == len("from a shell\n")
    assert result["seal"]["lines"] == ["python", "kernel"] and result["seal"]["changed"] == []


def test_without_a_namespace_the_check_finds_what_they_changed(tmp_path: Path) -> None:
    """The audit hook cannot see C's stdio or a shell: the check after the run finds both,
    says so loudly, and the exit status is 1."""
    (tmp_path / "train.py").write_text(textwrap.dedent(C_WRITERS))
    (tmp_path / "stdio.bin").write_bytes(b"the user's own file")
    res = dpprof(["-q", "-o", "r.json", "--", "python", "train.py"], tmp_path,
                 namespace=False)
    assert res.returncode == 1, res.stderr
    assert "SEAL BROKEN: 2 file(s) of yours changed" in res.stderr
    assert "shell.txt: created after the as-written run" in res.stderr
    assert "stdio.bin: changed after the as-written run" in res.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["seal"]["lines"] == ["python", "audit hook"]
    assert any("sh -c echo from a shell" in c for c in result["seal"]["subprocesses"])


@pytest.mark.parametrize("around", [
    "import _io\nf = _io.FileIO('ckpt.pt', 'w')\nf.write(b'x')\n",
    "import posix\nfd = posix.open('ckpt.pt', posix.O_WRONLY | posix.O_TRUNC)\n",
], ids=["FileIO", "posix.open"])
def test_a_write_around_pythons_line_is_stopped_before_it_happens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, around: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt.pt").write_bytes(b"the user's own checkpoint")
    (tmp_path / "train.py").write_text("import torch\nx = torch.zeros(4, device='cuda')\n"
                                       + around + "print('not reached')\n")
    result, main = run_command(ScriptConfig(launch=parse_command(["python", "train.py"], 1),
                                            gpus=1), False)
    assert (tmp_path / "ckpt.pt").read_bytes() == b"the user's own checkpoint"
    assert main.exit_status == 1
    (s,) = result.scenarios
    assert s.status == "error"
    assert s.message.startswith(f"the script wrote to {tmp_path / 'ckpt.pt'} ")
    assert "dpprof stopped the run before the write reached your file" in s.message


OUTSIDE_PYTHON = """
    import sqlite3, torch, h5py, numpy as np
    from safetensors.torch import load_file, save_file
    model = torch.nn.Linear(4, 2).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(8, 4).cuda()).sum().backward(); opt.step(); opt.zero_grad()
    save_file({"w": torch.arange(6.0)}, "host.safetensors")  # host values: saved by Rust
    assert load_file("host.safetensors")["w"].tolist() == [0, 1, 2, 3, 4, 5]
    save_file(model.state_dict(), "model.safetensors")  # the GPU's: a stand-in
    assert load_file("model.safetensors", device="cuda:0")["weight"].shape == (2, 4)
    with h5py.File("data.h5", "a") as f:
        f["new"] = np.arange(3)
    with h5py.File("data.h5", "r") as f:
        assert sorted(f) == ["new", "old"] and f["old"][()].tolist() == [7, 7]
    db = sqlite3.connect("runs.db")
    db.execute("insert into runs values (2)"); db.commit()
    assert [r for (r,) in db.execute("select * from runs")] == [1, 2]
    db.close()
    print("checked")
"""


def test_code_that_opens_paths_outside_python_is_given_the_overlays(tmp_path: Path) -> None:
    """safetensors (Rust), h5py (HDF5's C) and sqlite3 (C) open the path they are given;
    imported by the script (after the seal is in place), they are handed the overlay's
    path: each file of the user's is as it was, and the script reads back what it wrote."""
    for module in ("safetensors", "h5py"):
        pytest.importorskip(module)
    import sqlite3

    import h5py
    import numpy as np

    with h5py.File(tmp_path / "data.h5", "w") as f:
        f["old"] = np.array([7, 7])
    db = sqlite3.connect(tmp_path / "runs.db")
    db.execute("create table runs (n int)")
    db.execute("insert into runs values (1)")
    db.commit()
    db.close()
    (tmp_path / "model.safetensors").write_bytes(b"the user's own weights")
    (tmp_path / "train.py").write_text(textwrap.dedent(OUTSIDE_PYTHON))
    before = digest_tree(tmp_path)
    res = dpprof(["-q", "-o", "r.json", "--", "python", "train.py"], tmp_path,
                 namespace=False)
    assert res.returncode == 0, res.stderr
    assert "checked" in res.stdout
    after = digest_tree(tmp_path)
    assert after.pop("r.json")
    assert after == before
    written = {w["path"] for w in json.loads((tmp_path / "r.json").read_text())["writes"]}
    assert {"host.safetensors", "model.safetensors", "data.h5", "runs.db"} <= written


C_READER = """
    import ctypes, errno, os
    with open("made.bin", "wb") as f:  # through Python's open: into the run's overlay
        f.write(b"tokens")
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    if not libc.fopen(b"made.bin", b"rb"):  # a C library opens the path itself
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), "made.bin")
"""


@pytest.mark.parametrize("why", ["overlayfs refused", namespace.THREADED])
def test_a_file_the_run_wrote_that_a_c_reader_misses_is_explained(
        why: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a mount namespace, a C library that opens a file the run wrote through
    Python looks on the real filesystem and fails: the script's FileNotFoundError is not the
    user's missing file, and dpprof says so (pyarrow's reader of the cache that datasets
    wrote, in transformers' run_clm.py, failed so), with what to do: where the machine
    refused the namespace, a machine that allows it; where threads started before dpprof
    (a sitecustomize importing torch, as torchtitan's shim did), a start without them."""
    (tmp_path / "train.py").write_text(textwrap.dedent(C_READER))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(namespace, "why_not", lambda: why)
    res = runner.invoke(app, ["run", "-q", "--", "python", "train.py"])
    assert res.exit_code == 1, res.output
    said = " ".join(res.output.split())
    opened = f"it failed to open {tmp_path / 'made.bin'}, which the run itself had made: "
    if why == namespace.THREADED:
        assert (opened + "without a mount namespace (the process was running threads before "
                "dpprof started)") in said, said
        assert "run dpprof without what imports a threaded library" in said
    else:
        assert opened + "without a mount namespace on this machine" in said, said
        assert "kernel.unprivileged_userns_clone=1" in said
    assert not (tmp_path / "made.bin").exists()


C_WRITER = """
    import ctypes, os
    os.makedirs("out")  # through Python: into the run's overlay
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    if not libc.fopen(b"out/tokenizer.json", b"wb"):  # a Rust or C writer opens it itself
        raise Exception("No such file or directory (os error 2)")  # as Rust's io::Error says
"""


def test_a_writer_outside_python_into_a_folder_the_run_made_is_explained(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a mount namespace, Hugging Face tokenizers' Rust ``Tokenizer.save`` into the
    folder ``save_pretrained`` made through Python failed with "No such file or directory
    (os error 2)", no path named, reported as the script's own error; dpprof now says it
    was the folder the run made, and what to do."""
    (tmp_path / "train.py").write_text(textwrap.dedent(C_WRITER))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(namespace, "why_not", lambda: namespace.THREADED)
    res = runner.invoke(app, ["run", "-q", "--", "python", "train.py"])
    assert res.exit_code == 1, res.output
    said = " ".join(res.output.split())
    assert (f"it failed to open a file in {tmp_path / 'out'}, which the run itself had made: "
            "without a mount namespace") in said, said
    assert not (tmp_path / "out").exists()


def test_a_library_s_own_message_naming_the_file_is_read_too() -> None:
    """pyarrow's reader raises FileNotFoundError with the path in its message only, and a
    library may raise its own error from it; under the kernel line the overlay is every
    reader's, so such an error is the script's own."""
    from dpprof.script.seal import SealedWrite
    from dpprof.script.sealed_run import SealOutcome, written_but_missing

    arrow = "/cache/text/default/0.0.0/text-train.arrow"
    outcome = SealOutcome(writes=[SealedWrite(path=arrow, kind="file")])
    try:
        try:
            raise FileNotFoundError(f"[Errno 2] Failed to open local file '{arrow}'. "
                                    "Detail: [errno 2] No such file or directory")
        except FileNotFoundError as e:
            raise RuntimeError("could not load the dataset") from e
    except RuntimeError as error:
        assert written_but_missing(error, outcome) == arrow
        outcome.kernel = True
        assert written_but_missing(error, outcome) is None
    other = FileNotFoundError(2, "No such file or directory", "/data/never-written.bin")
    assert written_but_missing(other, SealOutcome(writes=outcome.writes)) is None


LOGGING = """
    import os, torch
    x = torch.zeros(4, device="cuda")
    for var in ("WANDB_MODE", "COMET_START_ONLINE", "NEPTUNE_MODE", "CLEARML_OFFLINE_MODE",
                "SWANLAB_MODE", "MLFLOW_TRACKING_URI"):
        print(var, os.environ.get(var))
"""


def test_logging_services_get_no_stand_in_values(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """wandb and SwanLab disabled, Comet, Neptune and ClearML offline, MLflow into a local
    store (the overlay's): the user's own settings (an MLflow server) for the run only."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    monkeypatch.setenv("WANDB_MODE", "online")
    (tmp_path / "train.py").write_text(textwrap.dedent(LOGGING))
    run_command(ScriptConfig(launch=parse_command(["python", "train.py"], 1), gpus=1), False)
    seen = dict(line.split(" ", 1) for line in capsys.readouterr().out.splitlines())
    assert seen == {"WANDB_MODE": "disabled", "COMET_START_ONLINE": "0",
                    "NEPTUNE_MODE": "offline", "CLEARML_OFFLINE_MODE": "1",
                    "SWANLAB_MODE": "disabled",
                    "MLFLOW_TRACKING_URI": f"file://{tmp_path}/mlruns"}
    assert os.environ["MLFLOW_TRACKING_URI"] == "http://mlflow.example:5000"
    assert os.environ["WANDB_MODE"] == "online"


KEPT = """
    import os, torch
    model = torch.nn.Linear(4, 2).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(8, 4).cuda()).sum().backward(); opt.step(); opt.zero_grad()
    os.makedirs("out", exist_ok=True)
    torch.save(model.state_dict(), "out/ckpt.pt")
    open("out/log.txt", "w").write("step 2\\n")
    os.remove("old.txt")
"""


def test_keep_writes_keeps_each_runs_overlay_and_the_reports_list_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(textwrap.dedent(KEPT))
    (tmp_path / "old.txt").write_text("the user's")
    res = runner.invoke(app, ["run", "--keep-writes", "kept", "-o", "r.json", "-o", "r.html",
                              "--", "python", "train.py"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "old.txt").read_text() == "the user's"
    assert not (tmp_path / "out").exists()
    kept = tmp_path / "kept" / "as-written" / str(tmp_path).lstrip("/")
    assert (kept / "out" / "log.txt").read_text() == "step 2\n"
    assert (kept / "out" / "ckpt.pt").read_bytes().startswith(b"DPPROF-EMULATED\n")
    listing = (tmp_path / "kept" / "as-written" / "writes.txt").read_text()
    assert f"removed\t0\t{tmp_path / 'old.txt'}" in listing
    result = json.loads((tmp_path / "r.json").read_text())
    assert [(w["path"], w["kind"]) for w in result["writes"]] == [
        ("old.txt", "removed"), ("out", "folder"), ("out/ckpt.pt", "file"),
        ("out/log.txt", "file")]
    assert result["seal"]["kept_in"] == str(tmp_path / "kept")
    html = (tmp_path / "r.html").read_text()
    assert "id='writes'" in html and "out/ckpt.pt" in html and "out/log.txt" in html
    assert "out/ckpt.pt" in res.output  # the terminal lists them too
    # the terminal wraps the summary at its width (80 columns here)
    assert "your files are as they were after every run" in " ".join(res.output.split())


def test_keep_writes_refuses_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print(1)\n")
    (tmp_path / "kept").write_text("a file")
    res = runner.invoke(app, ["run", "--keep-writes", "kept", "--", "python", "train.py"])
    assert res.exit_code == 2
    assert "--keep-writes kept: not a folder" in res.output


@pytest.mark.parametrize("how", ["redirect", "tee"])
@pytest.mark.parametrize("namespace", [True, False], ids=["kernel", "audit-hook"])
def test_output_sent_to_a_file_in_the_working_folder_is_not_a_broken_seal(
        tmp_path: Path, namespace: bool, how: str) -> None:
    """``dpprof run -- python train.py > log.txt 2>&1`` (or ``| tee log.txt``) in the
    script's folder, as users keep a run's output (``nohup`` writes ``nohup.out`` there):
    the script's prints and dpprof's lines go to the file the user named, and the check
    after each run does not count that file as one of theirs the run changed (it did: exit
    1, "SEAL BROKEN")."""
    if namespace and (why := kernel_line()) is not None:
        pytest.skip(f"no mount namespace on this machine: {why}")
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import torch
        model = torch.nn.DataParallel(torch.nn.Linear(4, 2).cuda())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            model(torch.randn(8, 4).cuda()).sum().backward(); opt.step(); opt.zero_grad()
            print("step", step, flush=True)
    """))
    (tmp_path / "data.txt").write_text("the user's own file")
    env = {k: v for k, v in os.environ.items() if k != "DPPROF_NO_NAMESPACE"}
    if not namespace:
        env["DPPROF_NO_NAMESPACE"] = "1"
    env.pop("CUDA_VISIBLE_DEVICES", None)
    command = [sys.executable, "-m", "dpprof", "run", "--gpus", "4", "-o",
               str(tmp_path.parent / f"{tmp_path.name}.json"), "--", "python", "train.py"]
    if how == "tee":  # the shell's status is dpprof's (pipefail)
        done = subprocess.run(["bash", "-o", "pipefail", "-c",
                               " ".join(map(shlex.quote, command)) + " 2>&1 | tee log.txt"],
                              cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, timeout=300)
    else:
        with open(tmp_path / "log.txt", "w") as log:
            done = subprocess.run(command, cwd=tmp_path, env=env, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=300)
    text = (tmp_path / "log.txt").read_text()
    assert done.returncode == 0, text
    assert "SEAL BROKEN" not in text and "step 1" in text
    assert (tmp_path / "data.txt").read_text() == "the user's own file"
    result = json.loads((tmp_path.parent / f"{tmp_path.name}.json").read_text())
    assert result["seal"]["changed"] == []
