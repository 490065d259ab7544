"""Saved results: loading, the schema upgrade hook, and the saved test data itself."""

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import synthetic
from reports_data import SAVED

from dpprof import saved_result
from dpprof.saved_result import ResultFileError, load


def test_saved_synthetic_results_are_what_the_helper_builds() -> None:
    for name, build in synthetic.SYNTHETIC.items():
        saved = json.loads((synthetic.DATA / name).read_text())
        assert saved == json.loads(build().to_json()), f"rerun python tests/synthetic.py ({name})"
        assert saved["notes"][0].startswith("synthetic:")
        assert saved["environment"]["synthetic"] is True


VOLATILE = ("created", "environment", "dpprof_version")  # when, where and which build
# Floats computed on CPU tensors (losses, gradient differences) change with the machine's
# kernels by a few float32 ulps: relative 1e-7 per operation, summed over a step. Sizes and
# counts are integers and compared exactly.
FLOAT_REL, FLOAT_ABS = 1e-5, 1e-6


def _differences(saved: Any, fresh: Any, path: str = "") -> list[str]:
    """Where a saved result and a fresh one differ, but for what differs between two runs of
    the same dpprof (the date, the machine) and float noise below FLOAT_REL / FLOAT_ABS."""
    if isinstance(saved, dict) and isinstance(fresh, dict):
        keys = (saved.keys() | fresh.keys()) - set(VOLATILE)
        return [d for k in sorted(keys)
                for d in _differences(saved.get(k), fresh.get(k), f"{path}.{k}")]
    if isinstance(saved, list) and isinstance(fresh, list) and len(saved) == len(fresh):
        return [d for i, (a, b) in enumerate(zip(saved, fresh, strict=True))
                for d in _differences(a, b, f"{path}[{i}]")]
    if isinstance(saved, float) and isinstance(fresh, float):
        if math.isclose(saved, fresh, rel_tol=FLOAT_REL, abs_tol=FLOAT_ABS):
            return []
    elif saved == fresh:
        return []
    return [f"{path}: saved {saved!r}, now {fresh!r}"]


def test_float_noise_is_not_a_difference_but_a_changed_size_is() -> None:
    saved = {"loss": 1.0357247591018677, "grad_max_diff": 1.2054634012270412e-07,
             "peak_bytes": 512, "created": "yesterday"}
    noisy = dict(saved, loss=1.0357246398925781, grad_max_diff=2.1e-07, created="today")
    assert _differences(saved, noisy) == []
    assert _differences(saved, dict(noisy, peak_bytes=1024)) == [
        ".peak_bytes: saved 512, now 1024"]
    assert _differences(saved, dict(noisy, loss=1.04)) != []


def test_saved_emulated_results_are_what_dpprof_produces_now() -> None:
    """tests/data's dpprof-made results regenerated: a stale file fails here (rerun
    python scripts/make_test_data.py and commit the files with the change that moved them)."""
    spec = importlib.util.spec_from_file_location(
        "make_test_data", Path(__file__).parent.parent / "scripts" / "make_test_data.py")
    assert spec is not None and spec.loader is not None
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    for name, run in make.build().items():
        saved = json.loads((synthetic.DATA / name).read_text())
        fresh = json.loads(run.to_json())
        stale = _differences(saved, fresh)
        assert not stale, (f"tests/data/{name} is stale ({'; '.join(stale[:3])}): rerun "
                           "python scripts/make_test_data.py")
    lm = load(SAVED["emulated-lm"])
    assert lm.backend == "emulated" and lm.workload == "lm" and lm.batch == 512
    cpu = load(SAVED["cpu-mlp"])
    assert cpu.config["compute"] is True and all(s.loss is not None for s in cpu.scenarios)


def test_upgrade_hook_brings_an_older_result_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                ) -> None:
    data = json.loads(SAVED["emulated-lm"].read_text())
    data["workload_name"] = data.pop("workload")  # pretend version 1 called it so
    p = tmp_path / "v1.json"
    p.write_text(json.dumps(data))

    def v1_to_v2(d: dict) -> dict:
        d["workload"] = d.pop("workload_name")
        return d

    monkeypatch.setattr(saved_result, "SCHEMA_VERSION", 2)
    monkeypatch.setitem(saved_result._UPGRADES, 1, v1_to_v2)
    run = load(p)
    assert run.workload == "lm" and run.schema_version == 2


def test_an_older_version_without_an_upgrade_step_is_one_clear_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "old.json"
    p.write_text(json.dumps({"schema_version": 1, "scenarios": []}))
    monkeypatch.setattr(saved_result, "SCHEMA_VERSION", 3)
    monkeypatch.setitem(saved_result._UPGRADES, 1, lambda d: d)
    with pytest.raises(ResultFileError, match="schema_version 2 is not one this dpprof can read"):
        load(p)


@pytest.mark.parametrize(("content", "needle"), [
    ('{"schema_version": 0, "scenarios": []}', "not a dpprof result"),
    ('{"schema_version": "1", "scenarios": []}', "not a dpprof result"),
    ('{"schema_version": 1, "scenarios": [1]}', "malformed dpprof result"),
    ("[1, 2]", "not a dpprof result"),
])
def test_bad_results(tmp_path: Path, content: str, needle: str) -> None:
    p = tmp_path / "r.json"
    p.write_text(content)
    with pytest.raises(ResultFileError, match=needle):
        load(p)


def test_a_directory_is_not_a_result(tmp_path: Path) -> None:
    with pytest.raises(ResultFileError, match="cannot read it"):
        load(tmp_path)
