"""How big the HTML report of the default comparison is, and how fast it opens.

    python benchmarks/report_load.py [result.json]

Renders ``tests/data/emulated-lm.json`` (the default comparison, saved by dpprof) twice,
with the plotly.js basic bundle the report inlines and, for comparison, with plotly.py's
full bundle, and opens each in Debian's headless chromium (through playwright) five times:
the time from navigation until the first chart, and until every chart, has drawn its
traces (the page draws its charts one per task, top to bottom). Prints a table; the
numbers of a run are recorded in ``benchmarks/report_load.md``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from dpprof.reports import html, html_page
from dpprof.saved_result import load

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-dev-shm-usage"]
DRAWN = ("() => [...document.querySelectorAll('[data-figure]')]"
         ".every(d => d.querySelector('.main-svg .trace'))")
FIRST = "() => document.querySelector('[data-figure] .main-svg .trace') !== null"


def _open_times(browser: object, page_html: str, runs: int = 5
                ) -> tuple[list[float], list[float]]:
    firsts, times = [], []
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "report.html"
        f.write_text(page_html, encoding="utf-8")
        for _ in range(runs):
            page = browser.new_page()  # type: ignore[attr-defined]
            t0 = time.perf_counter()
            page.goto(f.as_uri(), wait_until="commit")
            page.wait_for_function(FIRST, polling=10, timeout=60_000)
            firsts.append(time.perf_counter() - t0)
            page.wait_for_function(DRAWN, polling=10, timeout=60_000)
            times.append(time.perf_counter() - t0)
            page.close()
    return firsts, times


def main() -> int:
    from playwright.sync_api import sync_playwright
    from plotly.offline import get_plotlyjs

    run = load(sys.argv[1] if len(sys.argv) > 1 else ROOT / "tests/data/emulated-lm.json")
    t0 = time.perf_counter()
    basic = html.render(run)
    render_s = time.perf_counter() - t0
    full = basic.replace(html_page.plotly_js(), get_plotlyjs())
    rows = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        for name, page_html in (("basic bundle (shipped)", basic), ("full bundle", full)):
            firsts, times = _open_times(browser, page_html)
            rows.append((name, len(page_html.encode()), statistics.median(firsts),
                         statistics.median(times)))
        browser.close()
    print(f"render: {render_s * 1e3:.0f} ms (python, {run.workload} batch {run.batch})")
    print("median of 5 opens: until the first chart is drawn, until every chart is")
    print(f"{'plotly.js':24} {'size':>10} {'first chart':>12} {'all charts':>11}")
    for name, size, first, every in rows:
        print(f"{name:24} {size / 2**20:8.2f} MiB {first * 1e3:9.0f} ms {every * 1e3:8.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
