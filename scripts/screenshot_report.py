"""Regenerate docs/report.png, the screenshot of an HTML report that README.md and the pages show.

    python scripts/screenshot_report.py [result.json] [-o docs/report.png] [--full]
        [--width 1180] [--dark] [--pdf report.pdf]

Renders ``tests/data/emulated-lm.json`` (the default comparison, saved by dpprof) with
:func:`dpprof.reports.html.render` and photographs it in Debian's headless chromium through
playwright (never a downloaded browser): ``apt-get install chromium`` and
``pip install -e .[browser]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from dpprof.reports import html
from dpprof.saved_result import load

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-dev-shm-usage"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", nargs="?", default=str(ROOT / "tests/data/emulated-lm.json"))
    ap.add_argument("-o", "--output", default=str(ROOT / "docs/report.png"))
    ap.add_argument("--full", action="store_true", help="the whole page, not the first screen")
    ap.add_argument("--height", type=int, default=1372, help="viewport height (px)")
    ap.add_argument("--width", type=int, default=1180, help="viewport width (px); 390: a phone")
    ap.add_argument("--dark", action="store_true", help="as a reader in dark mode sees it")
    ap.add_argument("--pdf", help="also print the page to this PDF (A4, as chromium prints)")
    a = ap.parse_args()
    from playwright.sync_api import sync_playwright

    page_html = html.render(load(a.result))
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "report.html"
        f.write_text(page_html, encoding="utf-8")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": a.width, "height": a.height},
                                    device_scale_factor=1,
                                    color_scheme="dark" if a.dark else "light")
            page.goto(f.as_uri())
            # the page marks <html data-charts="drawn"> once its last chart is drawn
            page.wait_for_function(
                "() => document.documentElement.getAttribute('data-charts') === 'drawn'",
                timeout=60_000,
            )
            page.wait_for_timeout(300)
            Path(a.output).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=a.output, full_page=a.full)
            print(f"wrote {a.output}")
            if a.pdf:
                page.emulate_media(media="print")
                page.wait_for_timeout(1500)  # the charts redraw at the page's width
                page.pdf(path=a.pdf, format="A4", print_background=True)
                print(f"wrote {a.pdf}")
            browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
