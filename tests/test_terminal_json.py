"""The terminal and JSON renderers against every saved result."""

import dataclasses
from pathlib import Path

import pytest
from reports_data import HOSTILE, SAVED, hostile, saved
from rich.console import Console
from typer.testing import CliRunner

from dpprof.cli.app import app
from dpprof.reports import terminal
from dpprof.result import RunResult


def _text(run: RunResult) -> str:
    console = Console(record=True, width=160, color_system=None)
    console.print(terminal.render(run))
    return console.export_text()


def test_terminal_oom_and_hostile_text() -> None:
    assert "OOM" in _text(saved("synthetic-oom"))
    text = _text(hostile(saved("emulated-lm")))  # rich markup in a name is text, not markup
    assert HOSTILE.split("<b>")[0] in " ".join(text.split())


def test_rich_markup_in_a_workload_name_does_not_break_the_table() -> None:
    run = dataclasses.replace(saved("cpu-mlp"), workload="[/bold][red]x")
    assert "[/bold][red]x" in _text(run)


WIDTH = 80


def _lines_at(run: RunResult, width: int = WIDTH) -> list[str]:
    console = Console(record=True, width=width, color_system=None)
    console.print(terminal.render(run))
    return console.export_text().splitlines()


@pytest.mark.parametrize("name", list(SAVED))
def test_every_saved_result_fits_80_columns_uncut(name: str) -> None:
    lines = _lines_at(saved(name))
    assert all(len(line.rstrip()) <= WIDTH for line in lines), name
    cut = [line for line in lines if "…" in line]
    assert not cut, cut


def test_many_gpus_become_cuda0_and_the_others_min_median_max() -> None:
    run = saved("emulated-lm")
    wide = _lines_at(run, 160)
    assert any("cuda:3" in line for line in wide)  # a wide terminal keeps every GPU
    lines = _lines_at(_with_gpus(run, 8))
    text = "\n".join(lines)
    assert "median" in text and "cuda:7" not in text
    assert not [line for line in lines if "…" in line or len(line.rstrip()) > WIDTH]


def _with_gpus(run: RunResult, n: int) -> RunResult:
    """``run`` as if measured on ``n`` GPUs: the last device of each scenario repeated."""
    return dataclasses.replace(run, gpus=n, scenarios=tuple(
        dataclasses.replace(s, devices=(*s.devices, *(
            dataclasses.replace(s.devices[-1], index=i) for i in range(len(s.devices), n))))
        if len(s.devices) > 1 else s for s in run.scenarios))


def test_the_units_move_to_the_header_at_80_columns() -> None:
    lines = _lines_at(saved("emulated-lm"))
    table = lines[:lines.index(next(line for line in lines if line.startswith("on a GPU")))]
    assert "peak allocated in GiB" in table[0]
    assert not any("GiB" in line for line in table[1:])
    row = next(line for line in table if line.lstrip().startswith("dp-loss-primary"))
    assert row.split()[1:3] == ["69.5", "10.6"]


def test_kernel_choices_and_the_negative_cause_note_are_said_once() -> None:
    text = "\n".join(_lines_at(saved("emulated-lm")))
    assert text.count("kernels as on") == 1
    assert "kernels as on sm_80: dropout:fused, embedding_backward:direct/sorted" in text
    assert text.count("A negative cause") == 1


def test_compare_at_80_columns_puts_the_verdict_on_the_first_screen(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Piped output (CliRunner's is not a terminal) honours COLUMNS."""
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["compare", "-b", "512", "-o", "r.json"],
                           env={"COLUMNS": str(WIDTH)})
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert all(len(line.rstrip()) <= WIDTH for line in lines)
    assert not [line for line in lines if "…" in line]
    verdict = next(i for i, line in enumerate(lines) if line.startswith("cuda:0 needs"))
    assert verdict < 24, "\n".join(lines[:30])
    wide = CliRunner().invoke(app, ["compare", "-b", "512", "-o", "r.json"],
                              env={"COLUMNS": "160"})
    assert max(len(line.rstrip()) for line in wide.stdout.splitlines()) > WIDTH


def test_the_runs_own_notes_are_said() -> None:
    # a `dpprof run` says here why an alternative was not run; a synthetic result that
    # nothing in it was measured
    run = dataclasses.replace(saved("emulated-lm"), notes=(
        "no loss-inside-forward alternative: the outputs are used at train.py:154 outside "
        "the arguments of an nn.Module loss",))
    text = " ".join(_text(run).split())
    assert "no loss-inside-forward alternative: the outputs are used at train.py:154" in text
    assert "nothing here was measured" in " ".join(_text(saved("synthetic-nvml")).split())
