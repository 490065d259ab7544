"""Property-based: nothing a user types or a result file holds ends in a traceback.

Two properties, each with a fixed seed (``derandomize=True``) and a bounded budget
(``max_examples``) so the suite stays fast and the same on every run:

* a saved result with one value replaced anywhere in its tree by any JSON value (NaN,
  huge integers, deep nesting, control characters, markup, wrong types) is rendered by
  ``dpprof report`` in every format or refused in one line: exit 0 or 1, no traceback;
* ``dpprof compare`` with any mix of options and values (out of range, NaN, markup in
  names and paths, duplicates) exits in {0, 1, 2, 3} without a traceback.
"""

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from dpprof.cli.app import app

pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")

BASE = Path(__file__).parent / "data" / "synthetic-oom.json"
runner = CliRunner()

HOSTILE_TEXT = st.sampled_from([
    "[red]x[/red]", "[/x]", "a:b:c", ":smile:", "\x1b]0;pwned\x07", "\x1b[2J", "\r\x08",
    "\ud800", "<script>alert(1)</script>", "@alice", "%%{init: {}}%%", "a|b", "`", "\u202e",
    "x" * 5000, "",
]) | st.text(max_size=40)
NUMBERS = st.sampled_from([0, -1, 1, 2**63, 2**64, 10**30, -(10**30)]) | st.floats(
    allow_nan=True, allow_infinity=True) | st.integers()
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | NUMBERS | HOSTILE_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(HOSTILE_TEXT, inner,
                                                                  max_size=3),
    max_leaves=8,
) | st.builds(lambda n: f"__DEEP_{n}__", st.integers(1, 3000))  # nesting, as JSON text


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value in a JSON tree (the root excluded)."""
    out: list[tuple[Any, ...]] = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(
        node, list) else []
    for k, v in items:
        out.append((*prefix, k))
        if len(out) < 4000:
            out += _paths(v, (*prefix, k))
    return out


BASE_DATA = json.loads(BASE.read_text())
PATHS = _paths(BASE_DATA)


def _set(data: Any, path: tuple[Any, ...], value: Any) -> None:
    for k in path[:-1]:
        data = data[k]
    data[path[-1]] = value


def _clean(r: Any, allowed: set[int]) -> None:
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output, r.output[-2000:]
    assert r.exit_code in allowed, (r.exit_code, r.output[-2000:])


@settings(max_examples=40, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow, HealthCheck.data_too_large])
@given(path=st.sampled_from(PATHS), value=JSON_VALUES)
def test_mutated_results_render_or_are_refused(tmp_path: Path, path: tuple[Any, ...],
                                               value: Any) -> None:
    data = json.loads(json.dumps(BASE_DATA))
    _set(data, path, value)
    text = json.dumps(data)  # NaN and Infinity as Python writes them; surrogates as \udXXX
    if isinstance(value, str) and value.startswith("__DEEP_"):
        n = int(value.strip("_").split("_")[1])
        text = text.replace(json.dumps(value), "[" * n + "]" * n)
    p = tmp_path / "mutated.json"
    p.write_text(text, encoding="utf-8")
    _clean(runner.invoke(app, ["report", str(p)]), {0, 1})
    outs = [a for ext in ("md", "html", "json") for a in ("-o", str(tmp_path / f"out.{ext}"))]
    _clean(runner.invoke(app, ["report", str(p), *outs]), {0, 1})


OPTIONS: dict[str, Any] = {
    "--batch": st.sampled_from(["0", "-3", "2", "4", "9223372036854775808", "1e3", "x"]),
    "--gpus": st.sampled_from(["0", "1", "2", "3", "65", "10000", "-1", "nan"]),
    "--gpu-memory": st.sampled_from(["80GiB", "0", "1B", "nanGiB", "1e400GiB", "9" * 40, "x"]),
    "--scenarios": st.sampled_from(["single", "single,single", "dp-loss-primary", "", ",",
                                    "bogus", "[red]x[/red]"]),
    "--backend": st.sampled_from(["emulated", "auto", "bogus", "[/x]"]),
    "--seed": st.sampled_from(["0", "-1", str(2**64), "nan"]),
    "--warmup": st.sampled_from(["0", "1", "-1", "100000"]),
    "--nvml-interval": st.sampled_from(["0.02", "nan", "inf", "-1", "0"]),
    "--ddp-timeout": st.sampled_from(["10", "nan", "-inf", "0"]),
    "--bucket-cap-mb": st.sampled_from(["25", "nan", "0", "1e300"]),
    "--multiple-of": st.sampled_from(["1", "0", "8", str(2**40)]),
    "--fail-on-imbalance": st.sampled_from(["1.5", "nan", "0.5", "inf"]),
    "--gpu": st.sampled_from(["a100-80gb", "nope", "[bold]x"]),
    "--compute-capability": st.sampled_from(["8.0", "9.0", "x", "99.99", "nan"]),
    "--dtype": st.sampled_from(["bfloat16", "float64", "[/x]"]),
    "--amp": st.sampled_from(["bfloat16", "int8"]),
    "--workload": st.sampled_from(["mlp", "a:b:c", "[/x]", "\x1b]0;t\x07", "/nonexistent.py:f",
                                   ""]),
    "--output": st.sampled_from(["r.json", "[red]x[/red].md", "[/x].md", "adir.html/",
                                 "r.txt", "", "r.md"]),
}
FLAGS = ["--fail-on-oom", "--no-fixes", "--count-reserved", "--compute", "--quiet"]


@settings(max_examples=40, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_any_options_exit_cleanly(tmp_path: Path, data: st.DataObject,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    os.chdir(tmp_path)
    names = data.draw(st.lists(st.sampled_from(sorted(OPTIONS)), max_size=4, unique=True))
    args = ["compare", "-w", "mlp", "-b", "4", "-s", "single", "--no-fixes", "-g", "2"]
    for name in names:
        args += [name, data.draw(OPTIONS[name])]
    args += data.draw(st.lists(st.sampled_from(FLAGS), max_size=2, unique=True))
    _clean(runner.invoke(app, args), {0, 1, 2, 3})


@pytest.fixture(autouse=True)
def _restore_cwd() -> Any:
    cwd = os.getcwd()
    yield
    os.chdir(cwd)
