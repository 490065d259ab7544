"""dpprof report before.json after.json: side by side, the difference per scenario and device."""

import dataclasses
import json
import re
from pathlib import Path

from reports_data import SAVED, hostile, saved
from typer.testing import CliRunner

from dpprof.cli.app import app
from dpprof.reports import diff
from dpprof.result import RunResult
from dpprof.units import fmt_bytes

runner = CliRunner()


def _after_fix() -> RunResult:
    """The default comparison as if the user had fixed the loss: primary = forward."""
    run = saved("emulated-lm")
    prim, fwd = run.scenario("dp-loss-primary"), run.scenario("dp-loss-forward")
    assert prim is not None and fwd is not None
    fixed = dataclasses.replace(prim, devices=tuple(
        dataclasses.replace(a, peak_allocated_bytes=b.peak_allocated_bytes)
        for a, b in zip(prim.devices, fwd.devices, strict=True)))
    after = dataclasses.replace(run, scenarios=tuple(
        fixed if s is prim else s for s in run.scenarios))
    from dpprof.answers.comparison import compare

    return dataclasses.replace(after, comparison=compare(after))


def test_diff_per_scenario_and_device() -> None:
    before, after = saved("emulated-lm"), _after_fix()
    rd = diff.diff(before, after)
    assert rd.changed == {}
    prim = next(s for s in rd.scenarios if s.name == "dp-loss-primary")
    d0 = prim.devices[0]
    assert d0.label == "cuda:0"
    assert d0.delta_bytes == (after.scenario("dp-loss-primary").devices[0].peak_allocated_bytes
                              - before.scenario("dp-loss-primary").devices[0].peak_allocated_bytes)
    assert d0.delta_bytes < -30 * 2**30
    assert prim.after_excess_bytes < prim.before_excess_bytes
    ddp = next(s for s in rd.scenarios if s.name == "ddp")
    assert all(d.delta_bytes == 0 for d in ddp.devices)
    lines = diff.summary(rd)
    # what the fullest GPU needs and whether it fits, then cuda:0's allocated peak
    need = fmt_bytes(before.scenario("dp-loss-primary").devices[0].total_peak_bytes)
    assert lines[0].startswith(f"dp-loss-primary: cuda:0 {need}, fits → {need}, fits; "
                               "allocated cuda:0 69.5 GiB → 18.7 GiB (-50.8 GiB -73%)")


def test_diff_across_configurations_says_so() -> None:
    rd = diff.diff(saved("emulated-lm"), saved("cpu-mlp"))
    assert set(rd.changed) >= {"workload", "batch"}
    assert "the runs differ in" in diff.render_markdown(rd)


def test_diff_with_absent_scenarios_and_oom() -> None:
    before = saved("synthetic-oom")
    after = saved("synthetic-nvml")
    after = dataclasses.replace(after, scenarios=after.scenarios[:2])
    rd = diff.diff(before, after)
    lines = diff.summary(rd)
    assert any("status OOM → ok" in x for x in lines)
    assert "ddp: only in the before run" in lines


def test_cli_terminal_md_and_html(tmp_path: Path) -> None:
    b = SAVED["emulated-lm"]
    a = tmp_path / "after.json"
    a.write_text(_after_fix().to_json())
    r = runner.invoke(app, ["report", str(b), str(a)])
    assert r.exit_code == 0, r.output
    assert "before:" in r.stdout and "-50.8 GiB" in r.stdout and "excess" in r.stdout and "needs" in r.stdout
    r = runner.invoke(app, ["report", str(b), str(a), "-o", str(tmp_path / "d.md"),
                            "-o", str(tmp_path / "d.html")])
    assert r.exit_code == 0, r.output
    md = (tmp_path / "d.md").read_text()
    assert "| dp-loss-primary | cuda:0 | 69.5 GiB | 18.7 GiB | -50.8 GiB | -73% |" in md
    page = (tmp_path / "d.html").read_text()
    assert "data-figure=\"diff\"" in page and "-50.8 GiB" in page
    r = runner.invoke(app, ["report", str(b), str(a), "-o", str(tmp_path / "d.json")])
    assert r.exit_code == 2 and "written as .html or .md" in r.output


def test_cli_bad_second_file_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    r = runner.invoke(app, ["report", str(SAVED["emulated-lm"]), str(bad)])
    assert r.exit_code == 1 and "not JSON" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1
    r = runner.invoke(app, ["report", str(bad), str(bad), str(bad)])
    assert r.exit_code == 2 and "one result, or two" in r.output


def test_hostile_diff_html_is_text(tmp_path: Path) -> None:
    rd = diff.diff(hostile(saved("synthetic-ddp-2-nodes")), saved("synthetic-ddp-2-nodes"))
    page = diff.render_html(rd)
    assert "<script>window" not in page and "<img" not in page
    data = page.split('type="application/json">')[1].split("</script>")[0]
    json.loads(data)
    assert "<" not in data


def test_did_my_fix_work_a_script_before_and_after_its_change(tmp_path: Path) -> None:
    """A DataParallel script, then the same model with the loss inside forward: the diff
    said "dp-loss-primary: only in the before run; dp-loss-forward +0 B" (it matched the
    runs by scenario name). Now what the user runs is matched with what they run after,
    with what its fullest GPU needs and whether it fits."""
    scripts = Path(__file__).parent / "scripts"
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    for script, out in (("dp_loss_outside.py", before), ("dp_loss_inside.py", after)):
        r = runner.invoke(app, ["run", "-q", "-o", str(out), "--", "python",
                                str(scripts / script)])
        assert r.exit_code == 0, r.output
    rd = diff.diff(RunResult.from_dict(json.loads(before.read_text())),
                   RunResult.from_dict(json.loads(after.read_text())))
    role = rd.scenarios[0]
    assert (role.name, role.before_scenario, role.after_scenario) == (
        "as written", "dp-loss-primary", "dp-loss-forward")
    assert role.before_need is not None and role.after_need is not None
    line = diff.summary(rd)[0]
    assert line.startswith("as written (dp-loss-primary → dp-loss-forward): cuda:0 ")
    assert re.search(r"cuda:0 [\d.]+ [KMG]iB, (fits|out of memory) → [\d.]+ [KMG]iB, "
                     r"(fits|out of memory)", line), line
    r = runner.invoke(app, ["report", str(before), str(after)])
    assert r.exit_code == 0 and "as written" in r.stdout and "needs" in r.stdout
