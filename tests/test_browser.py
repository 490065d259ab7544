"""The HTML reports in a real browser: Debian's headless chromium driven by playwright.

Skipped unless both are installed (``apt-get install chromium``, ``pip install -e .[browser]``;
playwright's own browser downloads are never used). Each page is opened from a file with
the network off-limits, and must draw every chart without a console error or a request.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from reports_data import HOSTILE, SAVED, hostile, saved

from dpprof.analysis.answers import build_answer
from dpprof.reports import diff, html

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-dev-shm-usage"]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None,
                       reason="playwright is not installed (pip install -e .[browser])"),
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason="chromium is not installed (apt-get install chromium)"),
]

ALL_DRAWN = """() => {
  const divs = [...document.querySelectorAll('[data-figure]')];
  return divs.length > 0 && divs.every(d => d.querySelector('.main-svg .trace'));
}"""

CHART_STATE = """() => [...document.querySelectorAll('[data-figure]')].map(d => ({
  id: d.id,
  traces: d.querySelectorAll('.main-svg .trace').length,
  marks: [...d.querySelectorAll('.main-svg .trace path')].filter(p => {
    const b = p.getBBox(); return (b.width > 0 || b.height > 0);
  }).length,
  data: (d.data || []).length,
}))"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def _open(browser: Any, tmp_path: Path, page_html: str) -> tuple[Any, list[str], list[str]]:
    f = tmp_path / "report.html"
    f.write_text(page_html, encoding="utf-8")
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    errors: list[str] = []
    requests: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url) if r.url != f.as_uri() else None)
    page.goto(f.as_uri())
    page.wait_for_function(ALL_DRAWN, timeout=20_000)
    return page, errors, requests


@pytest.mark.parametrize("name", list(SAVED))
def test_report_draws_every_chart_offline(browser: Any, tmp_path: Path, name: str) -> None:
    run = saved(name)
    page, errors, requests = _open(browser, tmp_path, html.render(run))
    try:
        charts = page.evaluate(CHART_STATE)
        assert charts, "no charts"
        for c in charts:
            assert c["data"] > 0 and c["traces"] > 0 and c["marks"] > 0, c
        verdict = page.locator("#verdict")
        assert verdict.is_visible()
        assert verdict.inner_text().strip() == build_answer(run).verdict
        assert errors == [] and requests == []
    finally:
        page.close()


def test_hostile_names_render_as_text(browser: Any, tmp_path: Path) -> None:
    run = hostile(saved("synthetic-ddp-2-nodes"))
    page, errors, requests = _open(browser, tmp_path, html.render(run))
    try:
        assert page.evaluate("() => window.__pwned") is None
        assert HOSTILE in page.locator("#title").inner_text()
        assert page.locator("main img").count() == 0  # the <img> is text, not an element
        assert page.locator("main b").count() == 0
        assert HOSTILE in page.locator("#verdict").inner_text()
        # the labels plotly drew show the text too, not markup
        legend = page.locator("[data-figure] .main-svg").first.inner_html()
        assert "<script" not in legend
        assert errors == [] and requests == []
    finally:
        page.close()


def test_diff_report_draws(browser: Any, tmp_path: Path) -> None:
    rd = diff.diff(saved("synthetic-oom"), saved("synthetic-nvml"))
    page, errors, requests = _open(browser, tmp_path, diff.render_html(rd))
    try:
        charts = page.evaluate(CHART_STATE)
        assert len(charts) == 1 and charts[0]["traces"] == 2 and charts[0]["marks"] > 0
        assert errors == [] and requests == []
    finally:
        page.close()
