"""A script written to a folder and run under ``dpprof run`` (one GPU, no alternatives), for
tests that compare the figures of two variants of one script."""

from __future__ import annotations

from pathlib import Path

from dpprof.result import ScenarioResult
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
