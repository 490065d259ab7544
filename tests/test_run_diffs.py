"""Every change ``dpprof run --ladder`` offers for a DataParallel script runs as given: its
code is a unified diff of the user's own file that applies to it, the patched file compiles,
every name it uses is defined and every module it imports exists, and run under ``dpprof
run`` the way the diff says (``torchrun`` where it makes the script DDP ranks), it peaks as
the fix promised, to the byte on every GPU.

The scripts are the suite's causal-LM loops (tests/scripts/): one fed by a DataLoader whose
dataset is written inline, one making its batches by hand in the loop, 30 rows that 4 GPUs
do not divide; both have repeated blocks, so every rung is offered."""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import json
import re
import shutil
import subprocess
import symtable
from pathlib import Path
from typing import Any

import pytest
from test_script_rewrite import apply_diff
from typer.testing import CliRunner

from dpprof.cli.app import app

SCRIPTS = Path(__file__).parent / "scripts"
FIXES = ("loss-in-forward", "ddp", "gradient-as-bucket-view", "ladder-bf16",
         "ladder-checkpoint", "ladder-bf16-checkpoint")
CASES = [(script, fix) for script in ("dp_causal_lm.py", "dp_causal_lm_shifted.py")
         for fix in FIXES]


def _run(args: list[str], out: Path) -> dict[str, Any]:
    r = CliRunner().invoke(app, ["run", "--gpus", "4", "-q", "-o", str(out), *args])
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def offered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Each script's result under ``dpprof run --ladder`` (run once per script)."""
    out = {}
    for script in sorted({s for s, _ in CASES}):
        work = tmp_path_factory.mktemp("ladder")
        out[script] = _run(["--ladder", "--", "python", str(SCRIPTS / script)],
                           work / "r.json")
    return out


def undefined_names(source: str) -> list[str]:
    """The names the file reads that nothing defines: not bound in its scope or an
    enclosing function's, not a module-level name, not a builtin (symtable's resolution,
    as Python's compiler makes it)."""
    top = symtable.symtable(source, "patched.py", "exec")
    module_names = {s.get_name() for s in top.get_symbols()
                    if s.is_assigned() or s.is_imported()}
    missing: list[str] = []

    def visit(table: symtable.SymbolTable) -> None:
        for sym in table.get_symbols():
            if not sym.is_referenced() or sym.is_free():
                continue
            local = (sym.is_assigned() or sym.is_imported() or sym.is_parameter()
                     or sym.is_namespace())
            if (table is top or sym.is_global()) and not local:
                name = sym.get_name()
                if name not in module_names and not hasattr(builtins, name):
                    missing.append(f"{table.get_name()}: {name}")
        for child in table.get_children():
            visit(child)

    visit(top)
    return missing


def unresolved_imports(source: str) -> list[str]:
    """The patched file's imports that do not resolve (a module not found, a name its
    module lacks)."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            bad += [a.name for a in node.names if importlib.util.find_spec(a.name) is None]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            module = importlib.import_module(node.module)
            bad += [f"{node.module}.{a.name}" for a in node.names
                    if not hasattr(module, a.name)
                    and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
    return bad


def launcher(diff: str, name: str) -> list[str]:
    """The command the diff says to run the patched script with (its ``# torchrun ...``
    line), else ``python``."""
    said = re.search(r"^\+\s*# (torchrun --nproc-per-node \d+ \S+)$", diff, re.M)
    if said is None:
        return ["python", name]
    command = said.group(1).split()
    assert command[-1] == name
    return command


@pytest.mark.parametrize(("script", "fix_name"), CASES)
def test_every_change_offered_applies_compiles_and_peaks_as_promised(
        script: str, fix_name: str, offered: dict[str, dict[str, Any]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    result = offered[script]
    fixes = {f["name"]: f for f in result["fixes"]}
    assert set(fixes) == set(FIXES), sorted(fixes)  # each offered fix is one of the cases
    fix = fixes[fix_name]
    code = fix["code"]
    assert code.startswith(f"--- {script} (as written)\n+++ {script} ("), code[:300]
    original = (SCRIPTS / script).read_text()
    patched = apply_diff(original, code)
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    if shutil.which("patch"):  # the diff as a user applies it
        (fixed / script).write_text(original)
        diff = "\n".join(line for line in code.splitlines() if not line.startswith("# "))
        done = subprocess.run(["patch", "-s", script], cwd=fixed, input=diff + "\n",
                              text=True, capture_output=True, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        assert (fixed / script).read_text() == patched
    (fixed / script).write_text(patched)
    compile(patched, script, "exec", dont_inherit=True)
    assert undefined_names(patched) == []
    assert unresolved_imports(patched) == []

    monkeypatch.chdir(fixed)
    command = launcher(code, script)
    assert (command[0] == "torchrun") == (fix_name != "loss-in-forward")
    again = _run(["--", *command], tmp_path / "again.json")
    ran = again["scenarios"][0]
    assert ran["status"] == "ok", ran
    assert ran["name"] == ("dp-loss-forward" if fix_name == "loss-in-forward" else "ddp")
    peaks = [d["peak_allocated_bytes"] for d in ran["devices"]]
    assert peaks[0] == fix["primary_peak_bytes"], (peaks, fix["primary_peak_bytes"])
    assert max(peaks) == fix["max_peak_bytes"], (peaks, fix["max_peak_bytes"])


def test_the_name_checks_catch_what_the_issue_found() -> None:
    """The checks above fail on code that uses a name nothing defines (an undefined
    ``make_optimizer``, ``contextlib`` never imported) or imports what does not exist."""
    source = ("import torch\n"
              "def train(model):\n"
              "    opt = make_optimizer(model.parameters())\n"
              "    with contextlib.nullcontext():\n"
              "        return opt, torch.zeros(1), len([])\n")
    assert undefined_names(source) == ["train: make_optimizer", "train: contextlib"]
    assert undefined_names("import contextlib\n" + source.replace(
        "make_optimizer", "torch.optim.SGD")) == []
    assert unresolved_imports("from torch.utils.data import NoSuchSampler\n") == [
        "torch.utils.data.NoSuchSampler"]
