"""Each fix ``dpprof run`` measures carries its strategy (dpprof.script.strategy), found by the
fix's one name; nothing else in the script layer chooses by a fix's name; an alternative's
run is named as its fix; results saved before the DDP alternative took its fix's name
(``ddp-in-place``) still load and render as they did."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpprof.cli.app import app
from dpprof.fixes.fix_registry import FIXES
from dpprof.saved_result import load
from dpprof.script.strategy import Alternative
from dpprof.script.strategy_registry import alternative_named, module_of, strategies

REPO = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).parent / "scripts" / "dp_loss_outside.py"
OLD_DDP_NAME = "ddp-in-place"  # what results saved by earlier versions call the DDP run


def _own_modules(name: str) -> set[Path]:
    """The files a fix's name may be written in: its kind's module and its strategy's."""
    kind = next(k for k in FIXES if k.name == name)
    kind_module = type(kind).__module__.rpartition(".")[2]
    strategy_module = module_of(kind).rpartition(".")[2]
    return {REPO / "profiler" / "fixes" / "kinds" / f"{kind_module}.py",
            REPO / "profiler" / "script" / f"{strategy_module}.py"}


def test_the_strategies_are_the_fix_registrys_by_its_names() -> None:
    found = strategies()
    names = [k.name for k in FIXES]
    assert [s.name for s in found] == [n for n in names if n in {s.name for s in found}]
    assert {s.name for s in found} >= {"loss-in-forward", "ddp", "gradient-as-bucket-view"}
    for s in found:  # each in the module its fix's name names
        assert type(s).__module__ == module_of(s.kind)
    ddp = alternative_named("ddp")
    assert isinstance(ddp, Alternative) and ddp.ladder_floor and ddp.as_ranks
    assert alternative_named("gradient-as-bucket-view") is None  # read from DDP's run
    assert alternative_named(OLD_DDP_NAME) is None


@pytest.mark.parametrize("folder", ["script", "fixes"])
def test_no_fix_name_is_written_outside_its_own_modules(folder: str) -> None:
    """Where the script run or the fixes chose by a fix's name (``if variant ==
    DDP_IN_PLACE``), they now ask the fix's strategy; a fix's name as a string appears only
    in its kind's module and its strategy's."""
    names = {k.name for k in FIXES} | {OLD_DDP_NAME}
    found = []
    for path in sorted((REPO / "profiler" / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and node.value in names
                    and (node.value == OLD_DDP_NAME or path not in _own_modules(node.value))):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert not found, "\n".join(found)


def test_an_older_result_naming_the_ddp_run_ddp_in_place_loads_and_renders(
        tmp_path: Path) -> None:
    """The run of the DDP alternative is named ``ddp`` now; a result an earlier dpprof saved
    names it ``ddp-in-place`` (its steps and seconds): it loads, and ``dpprof report``
    renders it as the same result saved now (the run under the name it was saved with),
    and compares it with one."""
    new = tmp_path / "new.json"
    r = CliRunner().invoke(app, ["run", "--gpus", "4", "-q", "-o", str(new), "--",
                                 "python", str(SCRIPT)])
    assert r.exit_code == 0, r.output
    data = json.loads(new.read_text())
    config = data["config"]
    assert {"as-written", "loss-in-forward", "ddp"} <= set(config["steps_done"])
    assert OLD_DDP_NAME not in config["steps_done"]  # the DDP run has its fix's name
    # the result an earlier dpprof wrote of the same run
    for key in ("steps_done", "seconds"):
        config[key] = {OLD_DDP_NAME if k == "ddp" else k: v for k, v in config[key].items()}
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    assert load(old).config["steps_done"][OLD_DDP_NAME] == 3
    rendered = {}
    for name in ("old", "new"):
        out = tmp_path / f"{name}.md"
        r = CliRunner().invoke(app, ["report", str(tmp_path / f"{name}.json"), "-o", str(out)])
        assert r.exit_code == 0, r.output
        rendered[name] = out.read_text()
    # the same report, the run named as it was saved (in the configuration it lists)
    assert f'"{OLD_DDP_NAME}"' in rendered["old"]
    assert rendered["old"].replace(f'"{OLD_DDP_NAME}"', '"ddp"') == rendered["new"]
    r = CliRunner().invoke(app, ["report", str(old), str(new)])
    assert r.exit_code == 0, r.output
