"""Markdown for a GitHub issue, against every saved result."""

import dataclasses
import re
from pathlib import Path

import pytest
from reports_data import HOSTILE, SAVED, hostile, saved
from typer.testing import CliRunner

from dpprof.cli.app import app
from dpprof.reports import markdown
from dpprof.reports.escape import without_host
from dpprof.reports.markdown import md


def _mermaid(text: str) -> list[str]:
    return re.findall(r"```mermaid\n(.*?)\n```", text, re.S)


def test_default_comparison_table_and_fix() -> None:
    run = saved("emulated-lm")
    text = markdown.render(run)
    assert "| dp-loss-primary | 69.5 GiB | 10.6 GiB | 10.6 GiB | 10.6 GiB | +58.9 GiB | 2.74 | ok |" \
        in text
    assert "| loss, its temporaries and its gradient | +46.9 GiB |" in text
    assert "dpprof.ModelWithLoss(model, loss_fn)" in text
    assert "line [79.25, 79.25, 79.25, 79.25]" in text  # capacity on the scale, in GiB


def test_oom_and_timing_and_max_batch() -> None:
    text = markdown.render(saved("synthetic-oom"))
    assert "> **⚠ dp-loss-primary ran out of memory on cuda:0" in text
    assert "| **OOM** |" in text
    nvml = markdown.render(saved("synthetic-nvml"))
    assert "### Step time and throughput" in nvml and "| dp-loss-primary | 610.0 ms |" in nvml
    assert "### Largest batch that fits in 80.0 GiB per GPU" in nvml
    assert "| ddp | 1,280 |" in nvml


def test_capacity_far_above_the_peaks_is_left_off_the_chart() -> None:
    text = markdown.render(saved("cpu-mlp"))
    assert "line [" not in text


def test_hostile_strings_are_text() -> None:
    for name in SAVED:
        text = markdown.render(hostile(saved(name)))
        # code blocks and code spans show their content literally; outside them, no HTML
        prose = re.sub(r"`[^`\n]*`", "", re.sub(r"(`{3,})[a-z]*\n.*?\n\1", "", text, flags=re.S))
        assert "<script" not in prose and "<img" not in prose and "<b>" not in prose
        assert len(re.findall(r"^`{3,}", text, re.M)) % 2 == 0  # every fence closed
        assert "&lt;script&gt;" in text
        assert "[a](javascript" not in prose
        for chart in _mermaid(text):
            for line in chart.splitlines():
                # every mermaid string is one quoted run: no quote or bracket inside
                for q in re.findall(r'"([^"]*)"', line):
                    assert not set(q) & set('"[]<>')
        # table rows keep their columns: a '|' in a name is escaped
        for line in text.splitlines():
            if line.startswith("| ") and HOSTILE[:5] in line:
                assert "\\|" in line


def test_md_escapes_markdown_and_html() -> None:
    assert md("a|b") == "a\\|b"
    assert md("<b>x</b>") == "&lt;b&gt;x&lt;/b&gt;"
    assert md("one\ntwo") == "one two"
    assert md("my_pkg.train:wl") == "my\\_pkg.train:wl"


def test_reserved_context_and_nvml_peaks_of_a_real_gpu_run() -> None:
    text = markdown.render(saved("synthetic-nvml"))
    assert "| scenario | device | allocated | requested | reserved | context | " \
        "NVML used | phase of the peak |" in text
    assert "| dp-loss-primary | cuda:0 | 46.0 GiB | 45.1 GiB | 49.7 GiB | 520 MiB | 50.2 GiB | " \
        "backward |" in text
    assert "NVML used" not in markdown.render(saved("emulated-lm"))


def test_charts_are_in_the_unit_that_fits() -> None:
    """cpu-mlp's peaks are MiB: charted in MiB, not as "0.09" GiB."""
    run = saved("cpu-mlp")
    top = max(d.total_peak_bytes for s in run.scenarios for d in s.devices)
    assert top < 2**30
    charts = _mermaid(markdown.render(run))
    assert charts and all('y-axis "MiB"' in c and "needs, MiB" in c for c in charts)
    bars = [float(v) for c in charts for v in re.search(r"bar \[(.*?)\]", c).group(1)  # type: ignore[union-attr]
            .split(", ")]
    assert max(bars) == pytest.approx(top / 2**20, rel=1e-3) and min(bars) >= 1


def test_charts_and_long_code_are_collapsed() -> None:
    text = markdown.render(saved("emulated-lm"))
    for chart in re.finditer(r"```mermaid", text):
        opened = text.rfind("<details>", 0, chart.start())
        assert opened > text.rfind("</details>", 0, chart.start()), "a chart outside <details>"
    short = text.index("+model = nn.DataParallel(dpprof.ModelWithLoss(model, loss_fn).cuda())")
    assert text.rfind("<details>", 0, short) < text.rfind("</details>", 0, short)  # shown
    # where the answer is the balanced split (the only change measured), its class is long
    run = saved("emulated-lm")
    split = next(f for f in run.fixes if f.name == "balanced-split")
    run = dataclasses.replace(
        run, scenarios=tuple(s for s in run.scenarios if s.name == "dp-loss-primary"),
        fixes=(dataclasses.replace(split, need_bytes=split.max_peak_bytes),),
        recommended=None)  # edited: its stored answer is of the run it was
    text = markdown.render(run)
    assert "**Recommended: A smaller share of the batch on cuda:0**" in text
    balanced = text.index("class BalancedDataParallel")
    summary = text.rfind("<summary>", 0, balanced)
    assert text.rfind("</details>", 0, balanced) < summary
    assert re.match(r"<summary>The change \(\d+ lines\)</summary>", text[summary:])


def test_a_public_report_leaves_the_machine_out(tmp_path: Path) -> None:
    import json
    import socket

    host = socket.gethostname()
    runner = CliRunner()
    args = ["compare", "-w", "mlp", "-b", "4", "-s", "single", "--no-fixes"]
    r = runner.invoke(app, [*args, "-o", str(tmp_path / "a.md"), "-o", str(tmp_path / "a.json"),
                            "-o", str(tmp_path / "a.html")])
    assert r.exit_code == 0, r.output
    text = (tmp_path / "a.md").read_text()
    assert f"**hostname**: {md(host)}" not in text and "left out (--include-host" in text
    # every format: the JSON result and the HTML page too (they carried it by default)
    hosted = json.loads((tmp_path / "a.json").read_text())["environment"]["hostname"]
    assert hosted == "left out (--include-host keeps it)"
    assert f"<td>{host}</td>" not in (tmp_path / "a.html").read_text()
    r = runner.invoke(app, ["report", str(tmp_path / "a.json"), "-o", str(tmp_path / "b.md")])
    assert r.exit_code == 0 and f"**hostname**: {md(host)}" not in (tmp_path / "b.md").read_text()
    r = runner.invoke(app, [*args, "--include-host", "-o", str(tmp_path / "c.md"),
                            "-o", str(tmp_path / "c.json"), "-o", str(tmp_path / "c.html")])
    assert r.exit_code == 0 and f"**hostname**: {md(host)}" in (tmp_path / "c.md").read_text()
    assert json.loads((tmp_path / "c.json").read_text())["environment"]["hostname"] == host
    assert f"<td>{host}</td>" in (tmp_path / "c.html").read_text()


def test_nodes_and_gpu_ids_are_left_out_of_a_public_report() -> None:
    run = saved("synthetic-ddp-2-nodes")
    run.environment["hostname"] = "node-a"
    run.environment["cuda_visible_devices"] = "GPU-00000000-synthetic,1"
    text = markdown.render(without_host(run))
    for private in ("node-a", "node-b", "GPU-00000000-synthetic"):
        assert private not in text, private
    assert "node0/cuda:0" in text and "node1/cuda:1" in text
    assert "node-a" in markdown.render(run)  # the result itself keeps them


def _chart_of(text: str, scenario: str) -> str:
    return next(c for c in _mermaid(text) if f'title "{scenario}:' in c)


def _series(chart: str, kind: str) -> list[list[float]]:
    return [[float(v) for v in m.split(", ")]
            for m in re.findall(rf"^    {kind} \[(.*?)\]$", chart, re.M)]


def test_charts_draw_the_need_against_the_capacity() -> None:
    """The charts drew allocated memory against the capacity, so a scenario out of memory
    sat under the red line; a single GPU got no line at all."""
    run = saved("emulated-lm")
    text = markdown.render(run)
    for s in run.scenarios:
        chart = _chart_of(text, s.name)
        need = max(d.total_peak_bytes for d in s.devices if d.used)
        assert max(_series(chart, "bar")[0]) == pytest.approx(need / 2**30, rel=1e-3)
    single = _chart_of(text, "single")
    assert '"capacity"' in single and _series(single, "bar")[1] == [0.0, 79.25]
    # an out-of-memory scenario stands above the line
    oom = saved("synthetic-oom")
    chart = _chart_of(markdown.render(oom), "dp-loss-primary")
    (line,) = _series(chart, "line")
    assert max(_series(chart, "bar")[0]) > line[0]


def test_sixty_four_gpus_are_cuda0_and_the_others_spread() -> None:
    from test_html import _many_gpus

    text = markdown.render(_many_gpus(saved("emulated-lm"), 64))
    chart = _chart_of(text, "dp-loss-primary")
    labels = re.findall(r'"([^"]*)"', chart.splitlines()[3])
    assert labels == ["cuda:0", "least of 63 others", "median of 63", "most of 63"]
    assert len(_series(chart, "line")[0]) == 4
