"""Which files are an installed package's: pip's own records decide, wherever the package was
installed (``pip install --target`` on ``PYTHONPATH``, not only site-packages), and a
DataParallel wrapped by such a library gets no diff of the library's file."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpprof.cli.app import app
from dpprof.script.installed_code import installed_site, is_installed

SCRIPTS = Path(__file__).parent / "scripts"


def _pip_install_target(tmp_path: Path) -> Path:
    """``pip install --target`` of a wheel holding tests/scripts/wrapper_library.py (a
    top-level module) and a package ``wrapped_pkg``: pip writes the records."""
    wheel = tmp_path / "wrapper_library-1.0-py3-none-any.whl"
    info = "wrapper_library-1.0.dist-info"
    files = {
        "wrapper_library.py": (SCRIPTS / "wrapper_library.py").read_text(),
        "wrapped_pkg/__init__.py": "",
        "wrapped_pkg/core.py": "X = 1\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: wrapper-library\nVersion: 1.0\n",
        f"{info}/WHEEL": ("Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                          "Tag: py3-none-any\n"),
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    target = tmp_path / "target"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--no-compile", "--disable-pip-version-check", "--target", str(target),
                    str(wheel)], check=True)
    return target


def test_pips_records_name_a_librarys_files_wherever_it_was_installed(tmp_path: Path) -> None:
    target = _pip_install_target(tmp_path)
    assert installed_site(str(target / "wrapper_library.py")) == "wrapper_library.py"
    assert installed_site(str(target / "wrapped_pkg" / "core.py")) == "wrapped_pkg/core.py"
    # a file put beside them by hand, and a package in a folder of the user's (an editable
    # install records no source file) are the user's
    (target / "notes.py").write_text("")
    mine = tmp_path / "src" / "mypkg"
    mine.mkdir(parents=True)
    (mine / "__init__.py").write_text("")
    (mine / "train.py").write_text("")
    assert not is_installed(str(target / "notes.py"))
    assert not is_installed(str(mine / "train.py"))
    # this interpreter's own packages, by their path in site-packages
    import torch.nn.parallel.comm as comm

    assert installed_site(comm.__file__) == "torch/nn/parallel/comm.py"


def test_a_library_on_pythonpath_that_wraps_data_parallel_gets_no_diff_of_its_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The library's file was rewritten as if it were the script's: a diff of
    ``wrapper_library.py`` handed to the user, who runs it from pip."""
    target = _pip_install_target(tmp_path)
    monkeypatch.syspath_prepend(str(target))
    monkeypatch.delitem(sys.modules, "wrapper_library", raising=False)
    work = tmp_path / "work"
    work.mkdir()
    script = work / "train.py"
    script.write_text((SCRIPTS / "library_wrapped.py").read_text())
    monkeypatch.chdir(work)
    out = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["run", "--gpus", "2", "--steps", "3", "--ranks", "none",
                                 "-o", str(out), "--", "python", str(script)])
    assert r.exit_code == 0, r.output
    result = json.loads(out.read_text())
    fixes = {f["name"]: f for f in result["fixes"]}
    code = fixes["ddp"]["code"]
    assert "wrapped by a library's code (wrapper_library.py:" in code, code
    assert "+++" not in code  # no diff of the library's lines
    # and what it costs is the launcher alone, not a process group and a sampler to write
    why = next(a["why"] for a in result["recommended"]["fixes"] if a["fix"] == "ddp")
    assert "Cost: a launcher: torchrun --nproc-per-node 2 (where the library" in why, why
