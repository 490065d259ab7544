"""A result is built whole by the code that measures it and never written after: every
result class is a frozen dataclass whose sequences are tuples, nothing in dpprof goes
around the freezing, and what is derived from the measurements (the comparison, the
verdict, the answer, the attribution's sentences) is computed by the answers layer from
the result, the same however often it is asked for."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import typing
from pathlib import Path

import pytest
from reports_data import SAVED, saved

import dpprof.result as result_module
from dpprof.answers.answer import settled
from dpprof.answers.comparison import compare
from dpprof.saved_result import validate

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [p for d in ("profiler", "reports", "scenarios") for p in (ROOT / d).rglob("*.py")]
# where dpprof writes an attribute of a frozen object of its own (not a result's), and why
ALLOWED_BYPASSES = {
    # the allocator's settings parse themselves in __post_init__ (a frozen config)
    ("profiler/emulator/allocator_config.py", "object.__setattr__"),
    # torch's DDP and DataParallel subclasses keep dpprof's state beside torch's own
    ("profiler/script/wrappers.py", "object.__setattr__"),
    ("profiler/script/wrappers.py", "__dict__"),
    ("profiler/emulator/standins.py", "__dict__"),
    # ModelWithLoss's attribute lookup falls through to the model's: its own __dict__ read
    # without recursing into it, and where a replica is loading which prefix it loads under
    ("scenarios/model_with_loss.py", "__dict__"),
}


def result_classes() -> list[type]:
    return [obj for _, obj in inspect.getmembers(result_module, inspect.isclass)
            if dataclasses.is_dataclass(obj) and obj.__module__ == result_module.__name__]


def test_there_are_result_classes_to_check() -> None:
    names = {c.__name__ for c in result_classes()}
    assert {"RunResult", "ScenarioResult", "DeviceResult", "Comparison", "Fix",
            "Recommendation", "WatchResult"} <= names


@pytest.mark.parametrize("cls", result_classes(), ids=lambda c: c.__name__)
def test_every_result_class_is_frozen(cls: type) -> None:
    assert cls.__dataclass_params__.frozen, f"{cls.__name__} is not frozen"  # type: ignore[attr-defined]


@pytest.mark.parametrize("cls", result_classes(), ids=lambda c: c.__name__)
def test_no_result_field_is_a_list(cls: type) -> None:
    """A list inside a frozen result could still be appended to: sequences are tuples."""
    hints = typing.get_type_hints(cls, vars(result_module), include_extras=True)
    for name, hint in hints.items():
        assert "list[" not in str(hint) and "typing.List" not in str(hint), (
            f"{cls.__name__}.{name} is a list: {hint}")


def _every_object(obj: object) -> list[object]:
    out = [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            out += _every_object(getattr(obj, f.name))
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out += _every_object(v)
    elif isinstance(obj, dict):  # free-form records (config, environment) are JSON's own
        for v in obj.values():
            if dataclasses.is_dataclass(v):
                out += _every_object(v)
    return out


@pytest.mark.parametrize("name", list(SAVED))
def test_a_loaded_result_refuses_every_write(name: str) -> None:
    """Every object of a loaded result (each scenario, device, timeline point, fix, the
    answer) raises on a write to any of its fields, and holds no list."""
    run = saved(name)
    objects = _every_object(run)
    assert not [o for o in objects if isinstance(o, list)]
    written = 0
    for obj in objects:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                with pytest.raises(dataclasses.FrozenInstanceError):
                    setattr(obj, f.name, getattr(obj, f.name))
                written += 1
    assert written > 1000  # the whole tree, down to the timelines' points


def _bypasses(path: Path) -> set[str]:
    """How ``path`` writes around a frozen dataclass: ``object.__setattr__`` calls and
    ``x.__dict__[...] = `` assignments."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "__setattr__" and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "object"):
            found.add("object.__setattr__")
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute)
                        and t.value.attr == "__dict__"):
                    found.add("__dict__")
    return found


def test_nothing_writes_around_the_freezing() -> None:
    """The only ways to change a frozen result are ``object.__setattr__`` and its
    ``__dict__``: neither is used outside the few objects of dpprof's own listed above."""
    found = {(str(p.relative_to(ROOT)), how) for p in SOURCES for how in _bypasses(p)}
    assert found - ALLOWED_BYPASSES == set()
    assert ALLOWED_BYPASSES - found == set(), "an allowed bypass is gone: drop it from the list"


def test_the_scan_finds_a_write_around_the_freezing(tmp_path: Path) -> None:
    p = tmp_path / "x.py"
    p.write_text("object.__setattr__(run, 'verdict', 'x')\nrun.__dict__['notes'] = ()\n")
    assert _bypasses(p) == {"object.__setattr__", "__dict__"}


@pytest.mark.parametrize("name", list(SAVED))
def test_what_is_derived_is_computed_from_the_result(name: str) -> None:
    """The comparison and the answer stored in a saved result are what the answers layer
    computes from its measurements now; deriving them again gives the same result, and
    leaves the result it was given as it was."""
    run = saved(name)
    before = run.to_json()
    again = settled(run)
    assert run.to_json() == before  # the input is not rewritten
    assert again == run
    assert dataclasses.replace(compare(run), verdict=run.comparison.verdict) == run.comparison
    assert settled(again) == again


def test_a_result_derived_without_its_stored_answer_gets_it_back() -> None:
    """A result whose derived fields were left out (a result written before they were
    stored) has them derived again, equal to what a command stores."""
    run = saved("emulated-lm")
    data = json.loads(run.to_json())
    data["comparison"] = {"scenarios": {}, "verdict": "", "savings_bytes": {}}
    data["recommended"] = None
    for att in data["attribution"].values():
        att["answer"] = ""
    bare = validate(data)
    assert bare != run
    assert settled(bare) == run
