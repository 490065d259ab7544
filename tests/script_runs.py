"""A script written to a folder and run under ``dpprof run`` (one GPU, no alternatives), for
tests that compare the figures of two variants of one script; a script run with what it
prints kept, and the same script run by plain Python on the host (its device ``"cpu"``)."""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import warnings
from pathlib import Path
from typing import Any

from dpprof.result import RunResult, ScenarioResult
from dpprof.script.session import ScriptConfig, parse_command, run_command


def run_script(folder: Path, source: str) -> ScenarioResult:
    """``source`` as ``folder/train.py``, run; its one scenario."""
    script = folder / "train.py"
    script.write_text(source)
    result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(script)], 1)),
                            alternatives=False)
    return result.scenarios[0]


def peak_reserved(folder: Path, source: str) -> int:
    """The reserved peak of the script's first device."""
    reserved = run_script(folder, source).devices[0].peak_reserved_bytes
    assert reserved is not None
    return reserved


def run_printing(script: Path, gpus: int = 1, steps: int = 3, compute: bool = False,
                 alternatives: bool = True) -> tuple[RunResult, str]:
    """``python script`` under ``dpprof run`` on ``gpus`` virtual GPUs (``--compute``: real
    numbers; alternatives and all unless ``alternatives`` is false): its result, and what it
    printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(script)], gpus),
                                             steps=steps, compute=compute),
                                alternatives=alternatives)
    return result, out.getvalue()


def printed_on_the_host(folder: Path, source: str) -> str:
    """What ``source`` prints run by plain Python with its ``dev = "cuda"`` made ``"cpu"``
    (its warnings not shown)."""
    plain = folder / "plain.py"
    plain.write_text(source.replace('dev = "cuda"', 'dev = "cpu"'))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runpy.run_path(str(plain), run_name="__main__")
    return out.getvalue()


def run_cli(folder: Path, name: str, source: str, gpus: int) -> tuple[dict[str, Any], str]:
    """``source`` as ``folder/name``, run as a user runs it (``dpprof run --gpus N --steps 3
    -o name.json -- python name``, alternatives and all): the JSON report, and the output."""
    from typer.testing import CliRunner

    from dpprof.cli.app import app

    script = folder / name
    script.write_text(source)
    out = folder / f"{name}.json"
    r = CliRunner().invoke(app, ["run", "--gpus", str(gpus), "--steps", "3", "-o", str(out),
                                 "--", "python", str(script)])
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text()), r.output


def run_report(command: list[str], out: Path, options: tuple[str, ...] = ()) -> dict[str, Any]:
    """``dpprof run -q <options> -o out -- <command>`` as a user runs it, in the working
    folder: the JSON report (the run must succeed)."""
    from typer.testing import CliRunner

    from dpprof.cli.app import app

    r = CliRunner().invoke(app, ["run", "-q", *options, "-o", str(out), "--", *command])
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def peaks(scenario: dict[str, Any]) -> list[tuple[int, int]]:
    """A reported scenario's (allocated, reserved) peak of each GPU."""
    return [(d["peak_allocated_bytes"], d["peak_reserved_bytes"]) for d in scenario["devices"]]


def beside_by_hand(folder: Path, script: Path, *changes: tuple[str, str]) -> None:
    """``script`` copied into ``folder``, and ``by_hand.py`` beside it: the same script with
    each change (its text as written, each found there once; the text by hand) made."""
    source = script.read_text()
    (folder / script.name).write_text(source)
    for written, by_hand in changes:
        assert source.count(written) == 1, written
        source = source.replace(written, by_hand)
    (folder / "by_hand.py").write_text(source)
