"""Saved results are validated on load against the result model; JSON is written strictly."""

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from dpprof.cli.app import app
from dpprof.reports import html
from dpprof.result import MAX_DEVICES, MAX_RESULT_FILE_BYTES
from dpprof.saved_result import ResultFileError, load

DATA = Path(__file__).parent / "data"
BASE = DATA / "synthetic-oom.json"
runner = CliRunner()


def _mutated(tmp_path: Path, change: Any) -> Path:
    data = json.loads(BASE.read_text())
    change(data)
    p = tmp_path / "r.json"
    p.write_text(json.dumps(data))
    return p


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda d: d.update(comparison=None), "field comparison: Input should be"),
        (lambda d: d.update(gpus=1_000_000), "field gpus: Input should be less than or equal "
                                            f"to {MAX_DEVICES}"),
        (lambda d: d.update(batch="512"), "field batch: Input should be a valid integer"),
        (lambda d: d.update(batch=2**70), "field batch: Input should be less than"),
        (lambda d: d["scenarios"][0].update(status="exploded"), "field scenarios[0].status"),
        (lambda d: d["scenarios"][1]["devices"][0].update(peak_allocated_bytes=-5),
         "field scenarios[1].devices[0].peak_allocated_bytes: Input should be greater"),
        (lambda d: d["scenarios"][0].update(devices=None), "field scenarios[0].devices"),
        (lambda d: d["scenarios"][0].update(notes=[1, 2]), "field scenarios[0].notes[0]"),
        (lambda d: d["comparison"]["scenarios"]["ddp"].update(imbalance="2.5"),
         "comparison.scenarios.ddp.imbalance"),
    ],
)
def test_a_mutated_result_is_refused_naming_the_field(tmp_path: Path, change: Any,
                                                      needle: str) -> None:
    p = _mutated(tmp_path, change)
    with pytest.raises(ResultFileError, match="malformed dpprof result") as e:
        load(p)
    assert needle in str(e.value)
    r = runner.invoke(app, ["report", str(p)])
    assert r.exit_code == 1 and needle in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"schema_version": 1, "scenarios": [], "loss": NaN}', "NaN is not a JSON number"),
        ('{"schema_version": 1, "scenarios": [], "x": -Infinity}', "-Infinity is not"),
        ('{"schema_version": 1, "scenarios": [' + "[" * 100_000 + "]" * 100_000 + "]}",
         "nested too deeply"),
        ('{"schema_version": 1, "scenarios": [], "workload": "\\ud800"}', "malformed"),
        ('{"schema_version": 1, "scenarios": [], "x": 1' + "0" * 5000 + "}", "not strict JSON"),
    ],
)
def test_json_that_is_not_strict_is_refused(tmp_path: Path, text: str, needle: str) -> None:
    p = tmp_path / "r.json"
    p.write_text(text)
    with pytest.raises(ResultFileError, match=needle):
        load(p)


def test_report_reads_only_regular_files_of_bounded_size(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    for special in ("/dev/zero", "/dev/null"):
        if os.path.exists(special):
            r = runner.invoke(app, ["report", special])
            assert r.exit_code == 1 and "not a regular file" in r.output, r.output
    zero = tmp_path / "samples.jsonl"  # a watch samples file is read the same way
    zero.symlink_to("/dev/zero")
    r = runner.invoke(app, ["report", str(zero)])
    assert r.exit_code == 1 and "not a regular file" in r.output, r.output
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    r = runner.invoke(app, ["report", str(fifo)])  # opening it would block forever
    assert r.exit_code == 1 and "not a regular file" in r.output
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_RESULT_FILE_BYTES + 1)
    r = runner.invoke(app, ["report", str(big)])
    assert r.exit_code == 1 and "more than a dpprof result holds" in r.output
    assert time.perf_counter() - t0 < 60  # generous: the point is that nothing reads forever


def test_a_nan_loss_is_written_as_null_and_reads_back(tmp_path: Path) -> None:
    run = load(BASE)
    run = dataclasses.replace(run, scenarios=(
        dataclasses.replace(run.scenarios[0], loss=math.nan),
        dataclasses.replace(run.scenarios[1], step_time_s=math.inf), *run.scenarios[2:]))
    text = run.to_json()
    assert "NaN" not in text and "Infinity" not in text
    data = json.loads(text)
    assert data["scenarios"][0]["loss"] is None and data["scenarios"][1]["step_time_s"] is None
    p = tmp_path / "r.json"
    p.write_text(text)
    assert load(p).scenarios[0].loss is None


def test_html_figures_stay_parseable_with_a_nan(tmp_path: Path) -> None:
    run = load(BASE)
    run = dataclasses.replace(run, scenarios=tuple(dataclasses.replace(s, devices=tuple(
        dataclasses.replace(d, timeline=(
            *(dataclasses.replace(pt, t=math.nan) for pt in d.timeline[:3]), *d.timeline[3:]))
        for d in s.devices)) for s in run.scenarios))
    page = html.render(run)
    start = page.index("id='dpprof-figures'") if "id='dpprof-figures'" in page else page.index(
        'id="dpprof-figures"')
    body = page[page.index(">", start) + 1:page.index("</script>", start)]
    json.loads(body, parse_constant=lambda c: pytest.fail(f"{c} in the figures' JSON"))
