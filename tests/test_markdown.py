"""Markdown for a GitHub issue, against every saved result."""

import re

from reports_data import HOSTILE, SAVED, hostile, saved

from dpprof.reports import markdown
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
    assert "line [80.00, 80.00, 80.00, 80.00]" in text  # capacity on the scale


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
