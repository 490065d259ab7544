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

from dpprof.answers.answer import build_answer
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


# ---- a phone, dark mode, print -------------------------------------------------------------

DRAWN = "() => document.documentElement.getAttribute('data-charts') === 'drawn'"

LAYOUT_STATE = """() => {
  const inside = (a, b) => a.left >= b.left - 1 && a.right <= b.right + 1;
  return {
    width: document.documentElement.scrollWidth,
    height: document.documentElement.scrollHeight,
    charts: [...document.querySelectorAll('[data-figure]')].map(d => {
      const box = d.getBoundingClientRect();
      const texts = [...d.querySelectorAll('.bartext')].filter(t => t.getBBox().width > 0);
      const phases = [...d.querySelectorAll('.annotation')].filter(
        a => a.style.display !== 'none').map(a => a.getBoundingClientRect());
      return {
        id: d.id, plot: d._fullLayout._size.h,
        clipped: texts.filter(t => !inside(t.getBoundingClientRect(), box)).length,
        phases: phases.map(p => [p.left, p.right, p.top, p.bottom]),
        off: phases.filter(p => !inside(p, box)).length,
      };
    }),
  };
}"""


def _page(browser: Any, tmp_path: Path, page_html: str, width: int, **kw: Any) -> Any:
    f = tmp_path / "report.html"
    f.write_text(page_html, encoding="utf-8")
    page = browser.new_page(viewport={"width": width, "height": 900}, **kw)
    page.goto(f.as_uri())
    page.wait_for_function(DRAWN, timeout=30_000)
    page.wait_for_timeout(200)
    return page


def _overlap(a: list[float], b: list[float]) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[2] < b[3] and b[2] < a[3]


@pytest.mark.parametrize("name", ["emulated-lm", "synthetic-oom", "synthetic-nvml"])
def test_a_phone_reads_the_report(browser: Any, tmp_path: Path, name: str) -> None:
    page = _page(browser, tmp_path, html.render(saved(name)), 390)
    try:
        state = page.evaluate(LAYOUT_STATE)
        assert state["width"] <= 390  # nothing wider than the screen (was 697 px)
        for c in state["charts"]:
            # hbar charts are short by design; the others keep a readable plot (was 60 px)
            floor = 90 if c["id"] in ("fig-timing", "fig-maxbatch") else 180
            assert c["plot"] >= floor, c
            assert c["clipped"] == 0, c  # bar labels (the waterfall's totals) inside
            assert c["off"] == 0, c
            boxes = c["phases"]
            assert not [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]
                        if _overlap(a, b)], c  # phase labels never run together
    finally:
        page.close()


def test_sixty_four_gpus_at_1400_px(browser: Any, tmp_path: Path) -> None:
    from test_html import _many_gpus

    four = _page(browser, tmp_path, html.render(saved("emulated-lm")), 1400)
    page = _page(browser, tmp_path, html.render(_many_gpus(saved("emulated-lm"), 64)), 1400)
    try:
        state, base = page.evaluate(LAYOUT_STATE), four.evaluate(LAYOUT_STATE)
        assert state["width"] <= 1400  # was 5,989 px: the table scrolls in its card
        assert state["height"] < 1.2 * base["height"]
    finally:
        page.close()
        four.close()


def _luminance(css: str) -> float:
    import re

    r, g, b = (int(x) for x in re.findall(r"\d+", css)[:3])
    return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255


def test_dark_mode(browser: Any, tmp_path: Path) -> None:
    page = _page(browser, tmp_path, html.render(saved("synthetic-oom")), 1200,
                 color_scheme="dark")
    try:
        colours = page.evaluate("""() => ({
          body: getComputedStyle(document.body).backgroundColor,
          card: getComputedStyle(document.querySelector('.card')).backgroundColor,
          text: getComputedStyle(document.querySelector('#verdict')).color,
          ticks: [...document.querySelectorAll('[data-figure] .ytick text')].map(
            t => getComputedStyle(t).fill),
        })""")
        assert _luminance(colours["body"]) < 0.15 and _luminance(colours["card"]) < 0.2
        assert _luminance(colours["text"]) > 0.7
        assert colours["ticks"] and all(_luminance(c) > 0.6 for c in colours["ticks"])
        # back to light when the reader's scheme changes, charts too
        page.emulate_media(color_scheme="light")
        page.wait_for_timeout(1500)
        ticks = page.evaluate("""() => [...document.querySelectorAll(
            '[data-figure] .ytick text')].map(t => getComputedStyle(t).fill)""")
        assert all(_luminance(c) < 0.3 for c in ticks)
    finally:
        page.close()


def test_print(browser: Any, tmp_path: Path) -> None:
    import re

    from dpprof.reports.html_page import PRINT_WIDTH_PX

    page = _page(browser, tmp_path, html.render(saved("emulated-lm")), 1400,
                 color_scheme="dark")
    try:
        page.emulate_media(media="print")
        page.wait_for_timeout(2500)  # every chart redrawn at the page's width, light
        state = page.evaluate("""() => [...document.querySelectorAll('[data-figure]')].map(d => ({
          width: d._fullLayout.width, height: d._fullLayout.height,
          avoid: getComputedStyle(d.closest('.card')).breakInside,
          ink: getComputedStyle(d.querySelector('.ytick text')).fill}))""")
        for c in state:
            assert c["width"] <= PRINT_WIDTH_PX and c["avoid"] == "avoid", c
            assert _luminance(c["ink"]) < 0.3, c  # printed light, whatever the screen
        for collapsed in ("#configuration", "#environment"):  # not printed: 2-3 pages
            assert page.locator(collapsed).evaluate("d => d.open") is False
        pdf = page.pdf(format="A4", print_background=True)
        pages = len(re.findall(rb"/Type\s*/Page[^s]", pdf))
        # 9: the charts, tables and text of emulated-lm, cards kept whole; its notes (the
        # H200's rank memory, NCCL's first buckets) take about a quarter page of the ninth.
        # The configuration and environment printed open make 12.
        assert 1 < pages <= 9, pages
    finally:
        page.close()


VISIBLE_LABELS = """(sel) => [...document.querySelectorAll(sel + ' .bartext')].filter(
  t => t.getBBox().width > 0 && getComputedStyle(t).display !== 'none'
       && t.style.opacity !== '0').map(t => t.textContent)"""


@pytest.mark.parametrize("name", ["synthetic-oom", "emulated-lm"])
def test_no_toolbar_over_the_legends(browser: Any, tmp_path: Path, name: str) -> None:
    """plotly's toolbar covered legend entries, on screen and in print."""
    page = _page(browser, tmp_path, html.render(saved(name)), 1200)
    try:
        assert page.locator(".modebar-btn").count() == 0
        page.emulate_media(media="print")
        page.wait_for_timeout(1500)
        assert page.locator(".modebar-btn").count() == 0
    finally:
        page.close()


def test_print_keeps_the_out_of_memory_labels(browser: Any, tmp_path: Path) -> None:
    """The "OOM" labels over the bars vanished in print (narrower bars: plotly hid them)."""
    run = saved("synthetic-oom")
    page = _page(browser, tmp_path, html.render(run), 1400)
    try:
        screen = page.evaluate(VISIBLE_LABELS, "#fig-peaks")
        ooms = [t for t in screen if t.startswith("OOM")]
        assert ooms
        page.emulate_media(media="print")
        page.wait_for_timeout(2500)
        printed = page.evaluate(VISIBLE_LABELS, "#fig-peaks")
        assert [t for t in printed if t.startswith("OOM")] == ooms
        assert sorted(printed) == sorted(screen)
    finally:
        page.close()


REACH = """() => [...document.querySelectorAll('main table')].filter(
  t => t.offsetParent !== null).map(t => {
  const box = t.closest('.scroll');
  const last = t.querySelector('tr').lastElementChild;
  const before = last.getBoundingClientRect().right;
  if (box) box.scrollLeft = box.scrollWidth;
  const after = last.getBoundingClientRect().right;
  if (box) box.scrollLeft = 0;
  return {id: t.id, scrolls: !!box && getComputedStyle(box).overflowX === 'auto',
          before: before, after: after};
})"""


@pytest.mark.parametrize("name", ["synthetic-oom", "emulated-lm", "synthetic-ddp-2-nodes"])
def test_every_column_reachable_at_390_px(browser: Any, tmp_path: Path, name: str) -> None:
    """At 390 px the peak table's status column and cuda:3 were off-screen."""
    page = _page(browser, tmp_path, html.render(saved(name)), 390)
    try:
        for t in page.evaluate(REACH):
            assert t["before"] <= 391 or (t["scrolls"] and t["after"] <= 391), t
        # the status is beside the scenario: seen without scrolling
        status = page.locator("#peaks-table tr").first.locator("th").nth(1)
        assert status.inner_text() == "status"
        assert status.bounding_box()["x"] + status.bounding_box()["width"] <= 390
        # the scenario's name stays at the left edge while the GPUs scroll past
        box = page.locator("#peaks-table").locator("xpath=..")
        box.evaluate("b => { b.scrollLeft = b.scrollWidth; }")
        first = page.locator("#peaks-table tr").nth(1).locator("td").first
        assert first.bounding_box()["x"] >= 0 and first.bounding_box()["x"] < 40
    finally:
        page.close()
