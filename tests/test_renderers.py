"""Every saved result in ``tests/data/`` rendered in every format of the registry: one test.

What every format must say (the verdict, every scenario, the recommended fixes, cuda:0's
excess by cause with the attribution's labels) is checked once for all; what is particular
to a format (HTML's sections and figures, Markdown's charts, JSON's round trip) is checked
by that format's checker below.
"""

from __future__ import annotations

import dataclasses
import html as std_html
import json
import re
from collections.abc import Callable

import pytest
from reports_data import HTML_SECTIONS, SAVED, report_words, saved

from dpprof.answers.answer import answer_of
from dpprof.answers.attribution import cause_label
from dpprof.reports.formats import renderers
from dpprof.reports.markdown import md
from dpprof.reports.view_builder import build_view
from dpprof.result import RunResult


def _html(run: RunResult, page: str) -> None:
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    verdict = re.search(r"id='verdict'>(.*?)</p>", page, re.S)
    assert verdict and re.sub(r"<[^>]+>", "", std_html.unescape(verdict.group(1))) == \
        answer_of(run).verdict
    heads = [std_html.unescape(h) for h in re.findall(
        r"<h2><span class='n'>\d+</span>(.*?)</h2>", page)]
    assert heads == [h for h in HTML_SECTIONS if h in heads]  # the order
    assert {"Peak memory per GPU", "What to change", "How these numbers were obtained"} <= set(
        heads)
    m = re.search(r'<script id="dpprof-figures" type="application/json">(.*?)</script>', page,
                  re.S)
    assert m
    figs = json.loads(m.group(1))
    assert set(figs) == set(re.findall(r"data-figure='([^']+)'", page))
    for fig in figs.values():
        assert fig["data"] and all(("x" in t or "y" in t) for t in fig["data"])
    # plotly.js inlined once, the basic bundle (not also the full one plotly.py ships)
    assert "Plotly.react" in page and page.count("Copyright 2012-") == 1
    assert "plotly.js (basic - minified)" in page


def _markdown(run: RunResult, text: str) -> None:
    assert md(answer_of(run).verdict) in text
    assert "### Peak memory per GPU" in text and "### What to change" in text
    charts = re.findall(r"```mermaid\n(.*?)\n```", text, re.S)
    drawn = [s for s in run.scenarios if s.status in ("ok", "oom")]
    assert len(charts) == len(drawn)
    for chart, s in zip(charts, drawn, strict=True):
        lines = chart.splitlines()[1:]  # after the init directive (colours)
        assert chart.startswith("%%{init: ")
        assert lines[0] == "xychart-beta"
        assert lines[1].startswith('    title "') and s.name in lines[1]
        labels = re.findall(r'"([^"]*)"', lines[2])
        bars = [float(x) for x in re.search(r"bar \[(.*)\]", chart).group(1).split(", ")]
        used = [d for d in s.devices if d.used]
        # one bar per GPU, what it needs; beside a single GPU, the capacity's bar
        assert all(lb.endswith(f"cuda:{d.index}") for lb, d in zip(labels, used, strict=False))
        assert len(labels) == len(bars) == len(used) + (labels[-1:] == ["capacity"])
        top = float(re.search(r"--> ([0-9.]+)", chart).group(1))
        assert max(bars) <= top
    # collapsed blocks open and close; the full configuration is JSON
    # + a block of allocated/reserved/context/NVML peaks where reserved was measured or
    # modelled, or a warm-up's transient left a steady peak below the peak (NCCL DDP's buckets)
    peaks = any(d.peak_reserved_bytes or d.steady_peak_allocated_bytes
                for s in run.scenarios for d in s.devices)
    tracebacks = sum(1 for s in run.scenarios if s.status not in ("ok", "oom") and s.traceback)
    collapsed_code = text.count("<summary>The change (")  # a fix's long code
    measured = 1 if answer_of(run).fixes else 0  # each change's sentence, collapsed
    assert text.count("<details>") == text.count("</details>") == \
        (4 if peaks else 3) + tracebacks + (1 if charts else 0) + collapsed_code + measured
    assert "<details><summary>Full configuration</summary>" in text
    assert '"batch": ' in text


def _json(run: RunResult, text: str) -> None:
    back = RunResult.from_dict(json.loads(text))
    # the result itself, with its one answer (built for a result saved before answers
    # were stored)
    assert back.recommended == answer_of(run)
    assert dataclasses.replace(back, recommended=run.recommended) == run


def _terminal(run: RunResult, text: str) -> None:
    assert " ".join(answer_of(run).verdict.split()) in " ".join(text.split())


CHECKS: dict[str, Callable[[RunResult, str], None]] = {
    "html": _html, "markdown": _markdown, "json": _json, "terminal": _terminal,
}


def test_every_format_has_a_checker() -> None:
    assert set(renderers()) == set(CHECKS)


@pytest.mark.parametrize("fmt", sorted(CHECKS))
@pytest.mark.parametrize("name", list(SAVED))
def test_every_saved_result_in_every_format(name: str, fmt: str) -> None:
    run = saved(name)
    text = renderers()[fmt].render(run)
    CHECKS[fmt](run, text)
    if fmt == "json":
        return  # the result itself: its words are data, checked by the round trip
    words = report_words(fmt, text)
    for s in run.scenarios:
        assert s.name in words
    # cuda:0's excess by cause: the attribution's labels, the same in every format
    for ex in build_view(run).attributions:
        for c in ex.causes:
            if c.bytes and abs(c.bytes) > 0.01 * max(ex.primary_bytes, 1):
                assert cause_label(c.key) in words, (fmt, c.key)
    # the recommended fixes, by title, in the formats that recommend
    if fmt in ("html", "markdown"):
        answer = answer_of(run)
        assert f"Recommended: {answer.title or 'nothing to change'}" in words, fmt
