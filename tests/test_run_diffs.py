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
import os
import re
import shutil
import subprocess
import symtable
import sys
from collections.abc import Callable
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
    r = CliRunner().invoke(app, ["run", "--gpus", "4", "-q", "--ranks", "none", "-o", str(out),
                                 *args])
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def offered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Each script's result under ``dpprof run --ladder`` (run once per script), run in a
    folder of its own: the seal watches the working folder, and in the repository's the
    other test workers write Python's bytecode caches while the script runs."""
    out = {}
    before = Path.cwd()
    for script in sorted({s for s, _ in CASES}):
        work = tmp_path_factory.mktemp("ladder")
        os.chdir(work)
        try:
            out[script] = _run(["--ladder", "--", "python", str(SCRIPTS / script)],
                               work / "r.json")
        finally:
            os.chdir(before)
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
            bad += [a.name for a in node.names if not module_found(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            module = importlib.import_module(node.module)
            bad += [f"{node.module}.{a.name}" for a in node.names
                    if not hasattr(module, a.name)
                    and not module_found(f"{node.module}.{a.name}")]
    return bad


def module_found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:  # loaded, and put itself in sys.modules without a spec (as
        return name in sys.modules  # torch.backends.cudnn puts its PropModule)


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
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    check_the_change(script, [], fixes[fix_name], fixed, tmp_path / "again.json", monkeypatch)


def check_the_change(script: str, args: list[str], fix: dict[str, Any], fixed: Path,
                     out: Path, monkeypatch: pytest.MonkeyPatch, one_gpu: bool = False,
                     dpprof_args: tuple[str, ...] = (), command: list[str] | None = None
                     ) -> None:
    """``fix``'s diff applied to ``script`` (as ``patch`` applies it) in the folder
    ``fixed``; the patched file compiles, uses no undefined name, imports what exists; run
    there under ``dpprof run`` as the diff says (``args`` the script's own), or as
    ``command`` (what a note beside the diff says, or the script's own launcher), it peaks
    as ``fix`` promised, to the byte (``one_gpu``: a one-GPU script's rung, run by python)."""
    code = fix["code"]
    assert code.startswith(f"--- {script} (as written)\n+++ {script} ("), code[:300]
    original = (SCRIPTS / script).read_text()
    patched = apply_diff(original, code)
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
    if command is None:
        command = launcher(code, script)
        assert (command[0] == "torchrun") == (fix["name"] != "loss-in-forward" and not one_gpu)
    again = _run([*dpprof_args, "--", *command, *args], out)
    ran = again["scenarios"][0]
    assert ran["status"] == "ok", ran
    assert ran["name"] == ("single" if one_gpu else "dp-loss-forward"
                           if fix["name"] == "loss-in-forward" else "ddp")
    peaks = [d["peak_allocated_bytes"] for d in ran["devices"]]
    print(f"{script} {fix['name']}: promised {fix['primary_peak_bytes']} B on GPU 0, "
          f"{fix['max_peak_bytes']} B at most; the patched script {peaks} B")  # pytest -rP
    assert peaks[0] == fix["primary_peak_bytes"], (peaks, fix["primary_peak_bytes"])
    assert max(peaks) == fix["max_peak_bytes"], (peaks, fix["max_peak_bytes"])


@pytest.mark.parametrize("fix_name", ["ddp", "gradient-as-bucket-view"])
def test_a_loader_with_its_own_sampler_gets_a_ddp_diff_that_peaks_as_promised(
        fix_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A DataLoader given a sampler of its own (dp_own_sampler.py: a WeightedRandomSampler,
    30 rows a batch): the DDP alternative divided its batch_size at run time and kept its
    sampler; the diff divides the batch_size the same way and gives each rank its share of
    the sampler's indices, and applied with ``patch`` and run under torchrun, every rank
    peaks where the alternative promised, to the byte (left as written, each rank would load
    all 30 rows)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    script = "dp_own_sampler.py"
    result = _run(["--", "python", str(SCRIPTS / script)], tmp_path / "r.json")
    fixes = {f["name"]: f for f in result["fixes"]}
    fix = fixes[fix_name]
    assert "batch_size=(30 + 3) // 4" in fix["code"]
    assert "sampler=RankShare(WeightedRandomSampler(" in fix["code"]
    assert "by hand" not in fix["code"], fix["code"]
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    check_the_change(script, [], fix, fixed, tmp_path / "again.json", monkeypatch)


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


# The framework-style scripts (tests/scripts/) that DataParallel runs in one process: each
# with the arguments and files it needs in its working folder, and the changes it is offered
DP_FIXES = ("loss-in-forward", "ddp", "gradient-as-bucket-view")
TV_ARGS = ["--data-path", "data", "-j", "0", "--train-crop-size", "64", "--val-resize-size",
           "72", "--val-crop-size", "64", "--epochs", "1", "--print-freq", "1",
           "--output-dir", "out"]
FRAMEWORK_SCRIPTS: dict[str, list[str]] = {
    "imagenet_dummy.py": ["--dummy", "-b", "16", "--epochs", "1"],
    "timm_style_train.py": ["--data-dir", "data", "-b", "8", "--img-size", "64", "-j", "0"],
    # the torchvision reference's style: DataParallel under plain python, its own DDP path
    # (a process group, DistributedDataParallel, DistributedSampler) under torchrun
    "tv_reference_train.py": ["-b", "8", *TV_ARGS],
    # Hugging Face's Trainer wraps DataParallel itself, in transformers' own code
    "hf_trainer.py": ["--output_dir", "out"],
}
# the ladder's rungs, run on the DDP alternative: the script patched with a rung's diff is
# DDP ranks under torchrun, its blocks checkpointed, its forward to backward() under autocast
RUNGS = ("ladder-bf16", "ladder-checkpoint", "ladder-bf16-checkpoint")
# run under ``--ladder`` (one run each, for every change it offers)
LADDER_SCRIPTS = ("imagenet_dummy.py", "timm_style_train.py", "tv_reference_train.py",
                  "hf_trainer.py")
# the changes each is offered (Trainer computes the loss inside the model's forward)
OFFERED = {script: DP_FIXES + RUNGS for script in LADDER_SCRIPTS} | {
    "hf_trainer.py": ("ddp", "gradient-as-bucket-view", *RUNGS)}


def _line(script: str, text: str) -> int:
    """The first line of ``script`` (tests/scripts/) that holds ``text``."""
    lines = (SCRIPTS / script).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


NO_REWRITE = "# no rewrite of the script's lines: "
TV_OWN_DDP = (f"{NO_REWRITE}the script starts its own process group (line "
              f"{_line('tv_reference_train.py', 'init_process_group(')}) and wraps "
              "DistributedDataParallel itself (line "
              f"{_line('tv_reference_train.py', 'DistributedDataParallel(model')}): run it as "
              "DDP ranks with `torchrun --nproc-per-node 4 tv_reference_train.py` rather than "
              "change its lines, each rank's DataLoader batch_size 2 (DataParallel's 8 rows // "
              "4, as the DDP alternative ran it)")
# the changes dpprof cannot give as a diff of the script's lines, and what it prints
NOT_A_DIFF = {
    ("timm_style_train.py", "loss-in-forward"):
        f"{NO_REWRITE}`loss_fn` is not defined where the model is wrapped",
    ("tv_reference_train.py", "ddp"): TV_OWN_DDP,
    ("tv_reference_train.py", "gradient-as-bucket-view"):
        f"{TV_OWN_DDP}; give its DistributedDataParallel gradient_as_bucket_view=True",
    ("hf_trainer.py", "ddp"): f"{NO_REWRITE}DataParallel is wrapped by a library's code (",
    ("hf_trainer.py", "gradient-as-bucket-view"):
        f"{NO_REWRITE}DataParallel is wrapped by a library's code (",
}
# timm's create_loader makes its DataLoader: the DDP diff divides that call's batch_size
# (where the DDP alternative divided the loader it made), so each rank of the patched
# script loads the 2 rows the alternative measured, not 8
# (Trainer's rungs under DataParallel: the test of a library's wrap below)
FRAMEWORK_CASES = [(script, fix) for script in FRAMEWORK_SCRIPTS for fix in OFFERED[script]
                   if not (script == "hf_trainer.py" and fix in RUNGS)]


def framework_folder(folder: Path, script: str) -> Path:
    """``folder`` with what ``script`` reads there (an image folder for timm's style)."""
    from test_run_framework_scripts import image_folder

    if script == "timm_style_train.py":
        image_folder(folder / "data", {"train": 6, "validation": 2})
    if script == "tv_reference_train.py":
        image_folder(folder / "data", {"train": 6, "val": 2})
    return folder


@pytest.fixture(scope="module")
def framework_offered(
        tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Any]]:
    """A framework-style script's result under ``dpprof run`` (``--ladder`` where its rungs
    are checked), run once per script when a test first asks, and once in the whole session:
    pytest-xdist's workers share it through the session's temporary folder (the first to
    ask runs it while the others wait on its lock: CI's 2 workers each ran every script's
    ladder before); torchvision importable in this process (its C ops do not load over a
    CPU torch)."""
    from filelock import FileLock  # torch's own dependency
    from torchvision_shim import import_torchvision

    import_torchvision()
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    results: dict[str, dict[str, Any]] = {}

    def offered(script: str) -> dict[str, Any]:
        if script not in results:
            ran = shared / f"framework-offered-{script}.json"
            with FileLock(f"{ran}.lock"):
                if not ran.exists():
                    work = framework_folder(tmp_path_factory.mktemp("work"), script)
                    with pytest.MonkeyPatch.context() as mp:
                        mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)
                        mp.chdir(work)
                        ladder = ["--ladder"] if script in LADDER_SCRIPTS else []
                        _run([*ladder, "--", "python", str(SCRIPTS / script),
                              *FRAMEWORK_SCRIPTS[script]], work.parent / f"{work.name}.json")
                    # shared once it passed: a failed run is each worker's own failure
                    (work.parent / f"{work.name}.json").rename(ran)
                results[script] = json.loads(ran.read_text())
        return results[script]

    return offered


@pytest.mark.slow
@pytest.mark.parametrize(("script", "fix_name"), FRAMEWORK_CASES)
def test_every_change_offered_for_a_framework_script_runs_as_promised(
        script: str, fix_name: str, framework_offered: Callable[[str], dict[str, Any]],
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fixes = {f["name"]: f for f in framework_offered(script)["fixes"]}
    assert set(fixes) == set(OFFERED[script]), sorted(fixes)
    code = fixes[fix_name]["code"]
    if (script, fix_name) in NOT_A_DIFF:  # said so, in place of a diff that would not apply
        assert code.startswith(NOT_A_DIFF[script, fix_name]) and "\n@@ " not in code, code
        return
    # both scripts make DataLoaders (timm's style through create_loader): none is denied
    assert "without a DataLoader" not in code, code
    assert "by hand" not in code, code  # a rung too is a diff of the script's own lines
    fixed = framework_folder(tmp_path / "fixed", script)
    fixed.mkdir(exist_ok=True)
    args, command = FRAMEWORK_SCRIPTS[script], None
    if script == "tv_reference_train.py" and fix_name in RUNGS:
        # the script's own DDP path: the rung's edits are a diff, the DDP change the note
        # beside it, done as it says (torchrun, each rank's batch 2 with the script's -b)
        assert code.endswith(f"\n# also: DDP: {TV_OWN_DDP.removeprefix(NO_REWRITE)}"), code
        command, args = ["torchrun", "--nproc-per-node", "4", script], ["-b", "2", *TV_ARGS]
    check_the_change(script, args, fixes[fix_name], fixed, tmp_path / "again.json",
                     monkeypatch, command=command)


@pytest.mark.slow
@pytest.mark.parametrize("fix_name", ["ddp", "gradient-as-bucket-view"])
def test_what_the_note_says_for_a_script_with_its_own_ddp_path_peaks_as_promised(
        fix_name: str, framework_offered: Callable[[str], dict[str, Any]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The torchvision reference's style starts its own process group under torchrun, so
    the DDP change is a note, not a diff (a second ``init_process_group`` would fail): done
    as the note says (torchrun, each rank's batch 2 with the script's own ``-b``, its
    DistributedDataParallel given the fix's flag), every rank peaks as the fix promised, to
    the byte."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    script = "tv_reference_train.py"
    fix = {f["name"]: f for f in framework_offered(script)["fixes"]}[fix_name]
    assert fix["code"] == NOT_A_DIFF[script, fix_name], fix["code"]
    fixed = framework_folder(tmp_path / "fixed", script)
    source = (SCRIPTS / script).read_text()
    if fix_name == "gradient-as-bucket-view":  # "give its DistributedDataParallel ..."
        wrap = "DistributedDataParallel(model, device_ids=[args.gpu])"
        assert source.count(wrap) == 1
        source = source.replace(wrap, wrap[:-1] + ", gradient_as_bucket_view=True)")
    (fixed / script).write_text(source)
    monkeypatch.chdir(fixed)
    again = _run(["--", "torchrun", "--nproc-per-node", "4", script, "-b", "2", *TV_ARGS],
                 tmp_path / "again.json")
    (ran,) = again["scenarios"]
    assert ran["name"] == "ddp" and ran["status"] == "ok", ran
    assert [d["batch_rows"] for d in ran["devices"]] == [2] * 4
    peaks = [d["peak_allocated_bytes"] for d in ran["devices"]]
    assert peaks == [fix["max_peak_bytes"]] * 4 and peaks[0] == fix["primary_peak_bytes"]


@pytest.mark.slow
def test_the_note_for_a_library_that_wraps_data_parallel_names_its_line(
        framework_offered: Callable[[str], dict[str, Any]]) -> None:
    """Hugging Face's Trainer wraps DataParallel in transformers' code: the DDP changes are
    notes that name that line (it holds the wrap) and the share each rank would load (8 of
    Trainer's 32 scattered rows), not a diff of the library's file."""
    import sysconfig

    for fix in framework_offered("hf_trainer.py")["fixes"]:
        if fix["name"] in RUNGS:  # the settings diff, the test below
            continue
        said = re.match(r"# no rewrite of the script's lines: DataParallel is wrapped by a "
                        r"library's code \((transformers/\S+\.py):(\d+)\), not by the "
                        r"script's lines: .* start the script with `torchrun "
                        r"--nproc-per-node 4`, each rank loading 8 rows \(DataParallel's "
                        r"32 // 4\)(.*)$", fix["code"], re.S)
        assert said is not None, fix["code"]
        library = Path(sysconfig.get_paths()["purelib"]) / said.group(1)
        assert "DataParallel(" in library.read_text().splitlines()[int(said.group(2)) - 1]
        flag = ("" if fix["name"] == "ddp" else
                ", its DistributedDataParallel given gradient_as_bucket_view=True")
        assert said.group(3).startswith(f"{flag}; the library's DDP has options of its own")


# a ladder rung given to Hugging Face's Trainer: its TrainingArguments' keywords
TRAINER_SETTINGS = {
    "ladder-bf16": ("bf16=True",),
    "ladder-checkpoint": ("activation_checkpointing=True",
                          'activation_checkpointing_kwargs={"use_reentrant": False}'),
    "ladder-bf16-checkpoint": ("bf16=True", "activation_checkpointing=True",
                               'activation_checkpointing_kwargs={"use_reentrant": False}'),
}


@pytest.mark.slow
def test_a_library_s_data_parallel_gets_its_rungs_as_trainer_settings_beside_the_ddp_note(
        framework_offered: Callable[[str], dict[str, Any]]) -> None:
    """Hugging Face's Trainer under DataParallel: each rung is the Trainer's own settings,
    a diff of the script's TrainingArguments(...) (no loop of the script's to put under
    autocast, no blocks of its own to wrap), with the DDP change as the note beside it (start
    it under torchrun), not the generic loop a user would have to map to Trainer by hand."""
    pytest.importorskip("transformers")
    fixes = {f["name"]: f for f in framework_offered("hf_trainer.py")["fixes"]}
    original = (SCRIPTS / "hf_trainer.py").read_text()
    for name, settings in TRAINER_SETTINGS.items():
        code = fixes[name]["code"]
        diff, _, note = code.partition("\n# also: DDP: ")
        assert note.startswith("DataParallel is wrapped by a library's code (transformers/"
                               ), code
        patched = apply_diff(original, diff)
        made = patched[patched.index("TrainingArguments("):patched.index("trainer = ")]
        assert [k for k in settings if k not in made] == [], made
        compile(patched, "hf_trainer.py", "exec", dont_inherit=True)


@pytest.mark.slow
def test_a_trainer_under_data_parallel_that_asks_for_bf16_is_told_it_runs_none(
        framework_offered: Callable[[str], dict[str, Any]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Hugging Face's Trainer leaves autocast to accelerate, which does not prepare a model
    the Trainer wrapped in DataParallel: a script whose TrainingArguments ask for bf16 runs
    in float32 there, to the byte as without it, and the report says so (not a rung of
    bf16 that the script believes it has)."""
    pytest.importorskip("transformers")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    source = (SCRIPTS / "hf_trainer.py").read_text()
    asked = source.replace("        disable_tqdm=True,\n",
                           "        disable_tqdm=True,\n        bf16=True,\n")
    assert asked != source
    work = tmp_path / "work"
    work.mkdir()
    (work / "hf_trainer.py").write_text(asked)
    monkeypatch.chdir(work)
    result = _run(["--", "python", "hf_trainer.py", *FRAMEWORK_SCRIPTS["hf_trainer.py"]],
                  tmp_path / "r.json")
    main = result["scenarios"][0]
    plain = framework_offered("hf_trainer.py")["scenarios"][0]
    assert main["name"] == plain["name"] == "dp-loss-forward"  # the model's own loss
    assert [d["peak_allocated_bytes"] for d in main["devices"]] == \
        [d["peak_allocated_bytes"] for d in plain["devices"]]
    said = " ".join(" ".join(main["notes"]).split())
    assert ("the script's TrainingArguments ask for bf16=True, but under DataParallel "
            "Hugging Face's Trainer ran no autocast") in said, said
    assert "as DDP ranks (torchrun --nproc-per-node 4) it runs in bf16" in said
    assert not any("TrainingArguments ask" in n for n in plain["notes"])


def nanogpt_folder(folder: Path) -> Path:
    """``folder`` with nanoGPT's prepared data (uint16 token ids in data/train.bin and
    data/val.bin, a vocabulary of 65 as shakespeare_char's)."""
    import numpy as np

    (folder / "data").mkdir(parents=True)
    rng = np.random.default_rng(0)
    rng.integers(0, 65, 4000, dtype=np.uint16).tofile(folder / "data" / "train.bin")
    rng.integers(0, 65, 1000, dtype=np.uint16).tofile(folder / "data" / "val.bin")
    return folder


# the one-GPU scripts (tests/scripts/) and the rungs ``--ladder`` offers them
ONE_GPU_SCRIPTS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    # nanoGPT's style (DDP only under torchrun; bf16 autocast of its own)
    "nanogpt_train.py": (["--data_dir=data", "--out_dir=out"], ("ladder-checkpoint",)),
    # torch.accelerator's device, a two-layer MLP (no repeated blocks to checkpoint)
    "accelerator.py": ([], ("ladder-bf16",)),
}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(ONE_GPU_SCRIPTS))
def test_every_rung_offered_for_a_one_gpu_framework_script_runs_as_promised(
        script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-GPU script's rungs under ``--ladder``, each applied and run by python, peak as
    promised. nanoGPT's style names a checkpoint dict ``checkpoint``, so the diff calls
    torch's checkpoint by its path, and its last ``model = ...`` is in an ``if ddp:`` the
    run did not take, so the blocks are wrapped after that branch, on whichever model was
    made."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    args, offered = ONE_GPU_SCRIPTS[script]
    work = nanogpt_folder(tmp_path / "work")
    monkeypatch.chdir(work)
    result = _run(["--ladder", "--", "python", str(SCRIPTS / script), *args],
                  tmp_path / "r.json")
    fixes = {f["name"]: f for f in result["fixes"]}
    assert set(fixes) == set(offered), sorted(fixes)
    if script == "nanogpt_train.py":
        code = fixes["ladder-checkpoint"]["code"]
        assert "torch.utils.checkpoint.checkpoint(forward, " in code, code
        assert 'getattr(model, "module", model).transformer.h' in code, code
    for name, fix in fixes.items():
        check_the_change(script, args, fix, nanogpt_folder(tmp_path / name),
                         tmp_path / f"{name}.json", monkeypatch, one_gpu=True)


# the DDP scripts in the frameworks' styles (no fix offered: they are DDP ranks already): how
# each is started and its own arguments (batches large enough that the activations autocast
# halves move the peak); ``--ladder`` offers them mixed precision (no repeated blocks)
DDP_FRAMEWORK_SCRIPTS: dict[str, tuple[list[str], list[str]]] = {
    # accelerate's examples: started by `accelerate launch`, `accelerator.backward(loss)`
    "accelerate_train.py": (["accelerate", "launch", "--num_processes", "4"],
                            ["--output_dir", "out", "--batch_size", "256"]),
    # Lightning's Trainer(strategy="ddp") from a plain python: Lightning calls the model and
    # backward(), so the rung is Lightning's own precision setting
    "lightning_ddp.py": (["python"], ["--batch-size", "128"]),
    # Hugging Face's Trainer under torchrun wraps DDP itself (find_unused_parameters=True,
    # False once the model checkpoints): each rung is its TrainingArguments' keywords
    "hf_trainer.py": (["torchrun", "--nproc-per-node", "4"], ["--output_dir", "out"]),
}
# the rungs each is offered (the BERT of hf_trainer.py has repeated blocks)
DDP_FRAMEWORK_RUNGS = {"accelerate_train.py": ("ladder-bf16",),
                       "lightning_ddp.py": ("ladder-bf16",), "hf_trainer.py": RUNGS}
DDP_RUNG_CODE = {
    "accelerate_train.py": '+            with torch.autocast("cuda", dtype=torch.bfloat16):\n'
                           "+                loss = nn.functional.cross_entropy(model(x), y)\n"
                           "             accelerator.backward(loss)",
    "lightning_ddp.py": 'enable_model_summary=True, precision="bf16-mixed")\n'
                        "     trainer.fit(model, train, val)",
    "hf_trainer.py": "         disable_tqdm=True,\n+        bf16=True,\n     )",
}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(DDP_FRAMEWORK_SCRIPTS))
def test_every_rung_offered_for_a_ddp_framework_script_runs_as_promised(
        script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A framework's DDP script under ``--ladder`` (one run): its rung is a diff of the
    script's own lines, though the library calls backward() (accelerate's
    ``accelerator.backward``: autocast around the script's forward and loss before that
    line) or the model too (Lightning: its Trainer given ``precision="bf16-mixed"``;
    Hugging Face's: its TrainingArguments given ``bf16=True`` and activation checkpointing,
    which also turns its DDP's ``find_unused_parameters`` off, so DDP rebuilds its buckets:
    the rung run by the Trainer's own settings counts that), and applied and started as
    the user started it, it peaks as promised, to the byte."""
    from torchvision_shim import import_torchvision

    # first: torchmetrics, under Lightning, imports torchvision
    if importlib.util.find_spec("torchvision") is not None:
        import_torchvision()
    pytest.importorskip({"accelerate_train.py": "accelerate",
                         "hf_trainer.py": "transformers"}.get(script, "lightning"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    launch, args = DDP_FRAMEWORK_SCRIPTS[script]
    steps = ("--steps", "3")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    result = _run([*steps, "--ladder", "--", *launch, str(SCRIPTS / script), *args],
                  tmp_path / "r.json")
    assert [s["name"] for s in result["scenarios"]] == ["ddp"]
    fixes = {f["name"]: f for f in result["fixes"]}
    assert set(fixes) == set(DDP_FRAMEWORK_RUNGS[script]), sorted(fixes)
    assert DDP_RUNG_CODE[script] in fixes["ladder-bf16"]["code"], fixes["ladder-bf16"]["code"]
    # the rung lowers every rank's peak: the patched script peaking where it promised is
    # the precision setting at work, not a peak autocast leaves where it was
    (ddp,) = result["scenarios"]
    assert fixes["ladder-bf16"]["max_peak_bytes"] < min(
        d["peak_allocated_bytes"] for d in ddp["devices"])
    for name, fix in fixes.items():
        fixed = tmp_path / name
        fixed.mkdir()
        check_the_change(script, args, fix, fixed, tmp_path / f"{name}.json", monkeypatch,
                         dpprof_args=steps, command=[*launch, script])


BATCH_SAMPLER_SCRIPT = '''\
import torch
import torch.nn as nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

data = TensorDataset(torch.randn(120, 4096), torch.randint(0, 2, (120,)))
loader = DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), 30, drop_last=False))
model = nn.DataParallel(nn.Sequential(nn.Linear(4096, 1024), nn.ReLU(), nn.Linear(1024, 2)))
model = model.cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in loader:
    loss = nn.functional.cross_entropy(model(x.cuda()), y.cuda())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''


def test_a_loader_with_its_own_batch_sampler_is_divided_and_its_ddp_change_is_a_note(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A DataLoader given a batch sampler of its own (30 rows a batch): the DDP alternative
    gives each rank its share of every batch (8 rows, DataParallel's first chunk), not the
    whole batch on every rank, and its note says so (not "batch_size divided"); the diff cannot divide it, so the DDP change is a note that
    says what to do by hand, not a diff whose patched script would load all 30 rows."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    script = tmp_path / "train.py"
    script.write_text(BATCH_SAMPLER_SCRIPT)
    monkeypatch.chdir(tmp_path)
    result = _run(["--", "python", str(script)], tmp_path / "r.json")
    scenarios = {s["name"]: s for s in result["scenarios"]}
    assert [d["batch_rows"] for d in scenarios["dp-loss-primary"]["devices"]] == [8, 8, 8, 6]
    assert [d["batch_rows"] for d in scenarios["ddp"]["devices"]] == [8] * 4
    # the alternative says what it did: no batch_size was divided, each batch was cut
    shares = [n for n in scenarios["ddp"]["notes"] if n.startswith("each rank's share: ")]
    assert shares == ["each rank's share: a DataLoader's own batch sampler: the first "
                      "ceil(len / 4) indices of every batch it yields"], shares
    at = BATCH_SAMPLER_SCRIPT.splitlines().index(
        next(line for line in BATCH_SAMPLER_SCRIPT.splitlines() if "batch_sampler=" in line)) + 1
    for fix in result["fixes"]:
        if fix["name"] in ("ddp", "gradient-as-bucket-view"):
            assert fix["code"] == (
                f"# no rewrite of the script's lines: line {at}: the DDP alternative gave each "
                "rank its share of this DataLoader's batches, which the diff cannot (it has a "
                "batch sampler of its own): give each rank 1/4 of each of its batches by hand"), \
                fix["code"]


PASSED_MODEL_SCRIPT = '''\
import torch
import torch.nn as nn


def train(loader, *, net, optimizer):
    for x in loader:
        loss = net(x).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def main():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        train([torch.randn(4, 8)], net=model, optimizer=optimizer)
'''


def test_checkpointing_follows_a_model_passed_to_the_training_function() -> None:
    """The model a training function is given (as the ImageNet example, timm's and
    torchvision's scripts pass it) is checkpointed where its caller makes it, once, before
    the caller's loop, and the patched script runs (on CPU). A function called from
    two places names no one model: the reason says so."""
    from dpprof.script.checkpointing_diff import checkpointing

    words = {"names": ["0", "1"], "kind": "Linear"}
    forward = PASSED_MODEL_SCRIPT.splitlines().index("        loss = net(x).sum()") + 1
    change = checkpointing(PASSED_MODEL_SCRIPT, "train.py", forward, words)
    assert change.ok, change.reason
    made = change.new_source.splitlines().index(
        "    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))")
    assert change.new_source.splitlines()[made + 6:made + 8] == [
        "    for block in map(model.get_submodule, ('0', '1',)):  # the 2 repeated Linear "
        "blocks", "        checkpointed(block)"]
    scope: dict[str, Any] = {}
    exec(compile(change.new_source, "train.py", "exec"), scope)
    scope["main"]()
    twice = PASSED_MODEL_SCRIPT + "    train([], net=model, optimizer=optimizer)\n"
    refused = checkpointing(twice, "train.py", forward, words)
    assert refused.reason == (f"line {forward}: no call of a model assigned before its loop: "
                              "`net`, the model `train` calls, is its argument, and `train` is "
                              "called 2 times in the script: which model to checkpoint is not "
                              "one line")
