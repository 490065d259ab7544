"""The ladder under ``dpprof run``: where even the floor run of a script (its DDP
alternative, else the script as written) does not fit the GPU, the script runs again with
each rung applied as it runs, and each rung is a fix with its change to the script. The
rung's run must equal the script with that change made by hand, to the byte: what dpprof
measures is what it hands out."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dpprof.answers.answer import build_answer
from dpprof.cli.app import app
from dpprof.measure.ladder_code import CODE_CHECKPOINT
from dpprof.measure.ladder_rungs import rungs as ladder_rungs
from dpprof.result import Fix, RunResult
from dpprof.script import autocast_diff
from dpprof.script.runner import ScriptRun, run_script
from dpprof.script.session import ScriptConfig, parse_command, run_command

SCRIPTS = Path(__file__).parent / "scripts"
LM = SCRIPTS / "transformer_lm.py"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.chdir(tmp_path)


def config(script: Path, gpus: int = 4, memory: int | None = None,
           ladder: bool | None = None) -> ScriptConfig:
    return ScriptConfig(launch=parse_command(["python", str(script)], gpus), gpus=gpus,
                        steps=3, gpu_memory_bytes=memory, ladder=ladder)


def as_written(script: Path, gpus: int = 4) -> ScriptRun:
    return run_script(config(script, gpus))


def peaks(run: ScriptRun) -> list[tuple[int, int]]:
    return [(d.peak_allocated_bytes, d.total_peak_bytes) for d in run.scenario.devices
            if d.used]


def rungs(result: RunResult) -> dict[str, Fix]:
    return {f.name: f for f in result.fixes if f.name.startswith("ladder-")}


def test_a_one_gpu_script_that_does_not_fit_gets_the_ladder_and_its_verdict() -> None:
    floor = as_written(LM)
    (need,) = [total for _, total in peaks(floor)]
    result, main = run_command(config(LM, memory=need - 1))  # the script as written: OOM
    assert main.scenario.status == "oom"
    found = rungs(result)
    assert list(found) == ["ladder-bf16", "ladder-checkpoint", "ladder-bf16-checkpoint"]
    answers = {a.fix: a for a in build_answer(result).fixes}
    for fix in found.values():  # each rung lighter than the floor, and the answer says so
        assert fix.need_bytes is not None and fix.need_bytes < need
        assert fix.detail.startswith("on one GPU: ")
        assert answers[fix.name].fits and "it fits in" in answers[fix.name].why
    assert "4 repeated blocks checkpointed" in found["ladder-checkpoint"].detail
    assert "for block in model.transformer_encoder.layers:" in found["ladder-checkpoint"].code
    # bf16 comes first and fits: the verdict names it, on the run it changed
    assert ("recommended: Mixed precision (bf16 autocast) on one GPU, the cheapest change "
            "measured that fits") in result.comparison.verdict
    # the rungs' runs are silent and are not scenarios of their own (as in compare)
    assert [s.name for s in result.scenarios] == ["single"]
    assert set(result.config["seconds"]) == {"as-written", *found}


def test_each_rung_equals_the_script_with_its_change_made_by_hand(tmp_path: Path) -> None:
    result, main = run_command(config(LM, ladder=True))
    found = rungs(result)
    # the mixed-precision rung: its diff of the script, applied, run as written
    change = autocast_diff.autocast_until_at(main.forward_sites[0], main.backward_sites[0],
                                               "bfloat16")
    assert change.ok, change.reason
    assert change.diff in found["ladder-bf16"].code
    amp = tmp_path / "lm_bf16.py"
    amp.write_text(change.new_source)
    by_hand = as_written(amp)
    assert by_hand.autocast_regions == 3  # the user's own region, once in each step
    assert peaks(by_hand) == [(found["ladder-bf16"].primary_peak_bytes,
                               found["ladder-bf16"].need_bytes)]
    # the checkpointing rung: its lines added after the model is built
    lines = [line[1:] for line in CODE_CHECKPOINT.format(**main.blocks_words).splitlines()]
    source = LM.read_text().replace("criterion = nn.CrossEntropyLoss()\n",
                                    "\n".join(lines) + "\ncriterion = nn.CrossEntropyLoss()\n")
    ckpt = tmp_path / "lm_checkpoint.py"
    ckpt.write_text(source)
    assert peaks(as_written(ckpt)) == [(found["ladder-checkpoint"].primary_peak_bytes,
                                        found["ladder-checkpoint"].need_bytes)]
    both = tmp_path / "lm_both.py"
    both.write_text(change.new_source.replace(
        "criterion = nn.CrossEntropyLoss()\n",
        "\n".join(lines) + "\ncriterion = nn.CrossEntropyLoss()\n"))
    assert peaks(as_written(both)) == [(found["ladder-bf16-checkpoint"].primary_peak_bytes,
                                        found["ladder-bf16-checkpoint"].need_bytes)]


def test_a_data_parallel_script_gets_the_ladder_on_its_ddp_alternative() -> None:
    script = SCRIPTS / "checkpoint_every_step.py"  # DataParallel, a Linear stack
    result, _ = run_command(config(script, ladder=True))
    assert result.config["ladder_on"] == "DDP"
    found = rungs(result)
    # no repeated blocks (nn.Linear layers are not blocks): mixed precision only
    assert list(found) == ["ladder-bf16"]
    assert found["ladder-bf16"].detail.startswith("on DDP: ")
    assert any("no activation checkpointing: the model has no repeated blocks" in n
               for n in result.notes)
    # every run, the rung's as the others, saved its checkpoint into its own overlay:
    # listed, and none made in the user's folder
    assert not Path("checkpoint.pt").exists()
    saved_by = {w.run for w in result.writes if w.path == "checkpoint.pt"}
    assert saved_by == {"as-written", "ddp", "loss-in-forward", "ladder-bf16"}
    assert result.seal is not None and result.seal.changed == ()


def test_a_script_already_under_autocast_gets_no_mixed_precision_rung(tmp_path: Path) -> None:
    source = LM.read_text().replace(
        "    output = model(data, mask)\n",
        '    with torch.autocast("cuda", dtype=torch.bfloat16):\n'
        "        output = model(data, mask)\n")
    script = tmp_path / "lm_amp.py"
    script.write_text(source)
    result, _ = run_command(config(script, ladder=True))
    assert list(rungs(result)) == ["ladder-checkpoint"]
    assert any("already runs under torch.autocast('cuda')" in n for n in result.notes)


def test_no_ladder_where_the_floor_fits_or_when_told_not_to() -> None:
    result, _ = run_command(config(LM))  # 80 GB: it fits
    assert not rungs(result)
    need = max(total for _, total in peaks(as_written(LM)))
    result, main = run_command(config(LM, memory=need - 1, ladder=False))
    assert main.scenario.status == "oom" and not rungs(result)


def test_dpprof_run_shows_the_rungs_and_names_the_one_that_fits() -> None:
    out = CliRunner().invoke(app, ["run", "--gpu-memory", "800MiB", "-o", "r.json", "--",
                                   "python", str(LM)], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    assert "Mixed precision (bf16) and activation checkpointing" in out.output
    assert "the cheapest change measured that fits" in " ".join(out.output.split())


def test_a_rung_leaves_torch_as_it_found_it() -> None:
    """The mixed-precision rung's region ends where backward begins; checkpoint's
    recompute in backward calls the blocks again, which is no forward of the step: taken
    for one, it opened a region that outlived the recompute's own and left autocast's
    wrappers in torch.nn.functional for every later run."""
    linear, enabled = torch.nn.functional.linear, torch.is_autocast_enabled
    both = ladder_rungs((8, 0), True)[-1]
    assert both.amp == "bfloat16" and both.checkpoint
    run = run_script(dataclasses.replace(config(LM), rung=both))
    assert run.scenario.status == "ok" and run.checkpointed_blocks == 4
    assert run.forwards == 3  # the model's call in each of 3 steps (not the recompute's)
    assert torch.nn.functional.linear is linear and torch.is_autocast_enabled is enabled


def test_a_ddp_script_under_torchrun_gets_the_ladder_as_written() -> None:
    """Under torchrun the script is its own floor (one emulated rank stands for all): the
    rung runs it again as written, the forward and loss of its own loop under autocast."""
    cmd = ["torchrun", "--nproc-per-node", "4", str(SCRIPTS / "ddp_torchrun.py")]
    result, main = run_command(ScriptConfig(launch=parse_command(cmd, 4), gpus=4, steps=3,
                                            ladder=True))
    assert main.scenario.name == "ddp" and result.config["ladder_on"] == "DDP"
    (fix,) = rungs(result).values()
    assert fix.name == "ladder-bf16" and fix.detail.startswith("on DDP: ")
    # one line does forward and loss: it goes under autocast, the backward stays out
    assert ('+            with torch.autocast("cuda", dtype=torch.bfloat16):\n'
            "+                loss = criterion(ddp_model(x), y)") in fix.code


def test_where_no_rung_fits_the_report_says_so_and_what_each_needs(tmp_path: Path) -> None:
    result, _ = run_command(config(LM, memory=200 * 2**20))  # nothing fits in 200 MiB
    answer = build_answer(result)
    assert answer.fix is None and answer.fits is False
    # not "No fix applies: the step runs on one GPU": each rung measured is passed over
    # for what it needs
    assert answer.why.startswith("Nothing measured fits in 200 MiB")
    passed = {p.title: p.reason for p in answer.passed_over}
    for fix in rungs(result).values():
        assert passed[fix.title].startswith("it does not fit: its fullest GPU needs")
    # not "recommended: nothing to change" after "none of the scenarios run fits"
    assert "no recommendation: no change measured fits" in result.comparison.verdict
    assert "nothing to change" not in result.comparison.verdict


def test_a_script_that_shards_its_model_itself_is_told_why_it_gets_no_ladder() -> None:
    cmd = ["torchrun", "--nproc-per-node", "4", str(SCRIPTS / "fsdp2_meta_init.py")]
    result, main = run_command(ScriptConfig(launch=parse_command(cmd, 4), gpus=4, steps=3,
                                            ladder=True))
    assert main.scenario.name == "fsdp2" and not rungs(result)
    assert any(n.startswith("no ladder: the script shards its model itself (fsdp2)")
               for n in result.notes)
