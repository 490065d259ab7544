"""``dpprof run`` counts every step: the peak it reports for a GPU is at least every value
the script read of it from ``torch.cuda``'s memory functions, the warm-up step and what
follows the last step (an evaluation) included; a run whose figures would be below such a
reading says so instead of reporting them."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpprof.cli.app import app
from dpprof.script import hooks
from dpprof.script.session import ScriptConfig, parse_command, run_command

runner = CliRunner()

# One optimizer step, then an evaluation that holds less: the script's own
# max_memory_allocated() is the training step's (the 104.0 MiB against 64.0 MiB)
ONE_STEP_THEN_EVALUATE = """
    import torch
    import torch.nn as nn

    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    loss = model(torch.randn(512, 1024, device="cuda")).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(512, 1024, device="cuda"))
    print("read", torch.cuda.max_memory_allocated(), torch.cuda.memory_stats()[
        "allocated_bytes.all.peak"], torch.cuda.mem_get_info()[0])
"""

# A first step that holds a transient the later steps do not (a cache filled once), and a
# script that prints the peak after every step; then an evaluation after the last step
FIRST_STEP_TRANSIENT = """
    import torch
    import torch.nn as nn

    model = nn.Linear(256, 256).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range({steps}):
        x = torch.randn(64, 256, device="cuda")
        model(x).sum().backward()  # the cuBLAS handles' workspaces taken: read from here on
        if step == 0:
            cache = torch.empty(8 * 2**20, device="cuda")  # 32 MiB, freed at once
            del cache
        optimizer.step()
        optimizer.zero_grad()
        print("read", torch.cuda.max_memory_allocated())
    with torch.no_grad():
        big = model(torch.randn({eval_rows}, 256, device="cuda"))  # the evaluation
    print("read", torch.cuda.max_memory_allocated())
"""


def _reads(out: str) -> list[int]:
    return [int(v) for line in out.splitlines() if line.startswith("read ")
            for v in line.split()[1:]]


def _run(tmp_path: Path, source: str, capsys: pytest.CaptureFixture[str], steps: int = 3
         ) -> tuple[int, list[int], str]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(script)], 4),
                                         steps=steps), alternatives=False)
    s = result.scenarios[0]
    # what max_memory_allocated reads on a GPU: the tensors and the cuBLAS workspaces
    return s.devices[0].gpu_allocated_bytes, _reads(capsys.readouterr().out), s.status


def test_one_step_then_evaluate_reports_the_step(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    peak, reads, status = _run(tmp_path, ONE_STEP_THEN_EVALUATE, capsys)
    max_allocated, stats_peak, _free = reads
    assert status == "ok"
    assert peak == max_allocated == stats_peak  # what the script printed, to the byte


def test_the_cli_writes_the_step_the_script_printed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(textwrap.dedent(ONE_STEP_THEN_EVALUATE))
    res = runner.invoke(app, ["run", "-o", "r.json", "--", "python", "train.py"])
    assert res.exit_code == 0, res.output
    printed = _reads(res.stdout)[0]
    saved = json.loads((tmp_path / "r.json").read_text())
    device = saved["scenarios"][0]["devices"][0]
    assert device["peak_allocated_bytes"] + device["workspace_bytes"] == printed
    assert "peaked in the warm-up step" in res.stdout


@pytest.mark.parametrize("eval_rows", [40000, 8000], ids=["evaluation-39MiB", "evaluation-8MiB"])
@pytest.mark.parametrize("steps", [1, 2, 3, 5])
def test_a_first_step_transient_and_the_evaluation_after_the_last_step_count(
        steps: int, eval_rows: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = FIRST_STEP_TRANSIENT.format(steps=steps, eval_rows=eval_rows)
    peak, reads, status = _run(tmp_path, source, capsys, steps=10)
    assert status == "ok"
    # the highest the script read: the evaluation's (39 MiB) or the first step's (32 MiB)
    assert peak == max(reads) == reads[-1]


def test_a_run_below_what_the_script_read_says_so_instead_of_reporting(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the warm-up's peak dropped, as before this was counted: the check catches it
    monkeypatch.setattr(hooks.Stepper, "keep_higher_warmup_peaks", lambda self: {})
    peak, reads, status = _run(tmp_path, ONE_STEP_THEN_EVALUATE, capsys)
    assert peak < reads[0]
    assert status == "error"
    script = tmp_path / "train.py"
    result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(script)], 4)),
                            alternatives=False)
    message = result.scenarios[0].message
    assert message.startswith("not reported: dpprof's peak allocated for cuda:0")
    assert "torch.cuda.max_memory_allocated() at " + str(script) + ":15" in message


def test_the_cli_says_so_and_exits_1_where_the_figures_are_below_a_reading(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hooks.Stepper, "keep_higher_warmup_peaks", lambda self: {})
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(textwrap.dedent(ONE_STEP_THEN_EVALUATE))
    res = runner.invoke(app, ["run", "-q", "-o", "r.json", "--", "python", "train.py"])
    assert res.exit_code == 1, res.output
    assert "dpprof: single: not reported: dpprof's peak allocated for cuda:0" in res.stderr
    assert "(exit status 1)" in res.stderr
    saved = json.loads((tmp_path / "r.json").read_text())  # what was measured, marked
    assert saved["scenarios"][0]["status"] == "error"


@pytest.mark.parametrize(("conf", "noted"), [
    ("backend:cudaMallocAsync,expandable_segments:True", "backend:cudaMallocAsync"),
    ("garbage_collection_threshold:0.6", ""),  # c10 collects only under a memory fraction
    ("roundup_power2_divisions:4", ""), ("large_segment_size_mb:12", ""),
    ("expandable_segments:True", ""), ("expandable_segments:False", "")])
def test_an_allocator_setting_the_emulation_does_not_model_is_said(
        conf: str, noted: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the reserved figures are the modelled allocator's: a setting it does not model is
    # named (expandable segments, torchtitan's run_train.sh's, are modelled)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", conf)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(ONE_STEP_THEN_EVALUATE))
    result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(script)], 1)),
                            alternatives=False)
    notes = result.scenarios[0].notes
    said = [n for n in notes if n.startswith("PYTORCH_ALLOC_CONF=") and "not modelled" in n]
    assert bool(said) == bool(noted)
    # power-of-two rounding is simulated; the allocated figures' 512 B rounding is said
    assert any("roundup_power2_divisions rounds each block" in n for n in notes) == (
        "roundup" in conf)
    if noted:
        assert said[0].startswith(f"PYTORCH_ALLOC_CONF={conf} in the script's environment: "
                                  f"{noted} not modelled")


# twelve 12 MiB buffers, the first six freed, then a 24 MiB one: six separate segments
# cannot serve it, one expandable segment's merged free blocks can
FRAGMENTS = """
    import os
    import torch
    {setting}
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        held = [torch.empty(3 * 2**20, device="cuda") for _ in range(12)]
        del held[:6]
        wide = torch.empty(6 * 2**20, device="cuda")
        model(torch.randn(8, 64, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
        del held, wide
    print("read", torch.cuda.max_memory_reserved())
"""


@pytest.mark.parametrize("where", ["environment", "script"])
def test_expandable_segments_set_for_the_script_are_simulated(
        where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    reserved = {}
    for expandable in (False, True):
        setting = ""
        if expandable and where == "environment":
            monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
        elif expandable:  # the script sets it before CUDA starts, as torch reads it
            setting = 'os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"'
        script = tmp_path / f"train_{expandable}.py"
        script.write_text(textwrap.dedent(FRAGMENTS.format(setting=setting)))
        result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(script)], 1)),
                                alternatives=False)
        s = result.scenarios[0]
        assert s.status == "ok", s.message  # never below what the script read
        reserved[expandable] = s.devices[0].peak_reserved_bytes
        monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
        capsys.readouterr()
    assert reserved[True] < reserved[False]


def test_one_step_then_evaluate_predicts_no_step_time(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the script's only optimizer step is the warm-up: what follows it is its evaluation,
    # which is not a training step (pytorch/examples' word_language_model --dry-run: its
    # evaluation over the validation and test sets was predicted as a 48 s "step")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(ONE_STEP_THEN_EVALUATE))
    result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(script)], 1)),
                            alternatives=False)
    s = result.scenarios[0]
    assert s.status == "ok"
    assert s.predicted_step_time_s is None
    assert any(n.startswith("step time not predicted: no optimizer step ended after the "
                            "warm-up") for n in s.notes)
    two = tmp_path / "two.py"
    two.write_text(textwrap.dedent(FIRST_STEP_TRANSIENT.format(steps=3, eval_rows=100)))
    result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(two)], 1)),
                            alternatives=False)
    assert result.scenarios[0].predicted_step_time_s is not None
