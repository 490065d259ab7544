"""No dead link between README.md and the pages under docs/: every relative link and image
names a file that exists, every anchor a heading of its page, and every page is in the site's
navigation. Plain Python, so it runs under a ``.[test]`` install without MkDocs (CI's
``mkdocs build --strict`` checks the built site besides).

Anchors are checked as both renderers make them: GitHub's (README.md and the pages read on
GitHub) and Python-Markdown's ``toc`` (the MkDocs site), so a link works in both."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MKDOCS_YML = ROOT / "mkdocs.yml"

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_REF = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)=\"([^\"]+)\"", re.I)
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose(text: str) -> str:
    """The text a renderer reads links and headings from: code blocks and code spans left
    out (a link written inside code is shown, not followed)."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return INLINE_CODE.sub(lambda m: "code" if "\n" not in m.group(0) else "\n", text)


def heading_text(raw: str) -> str:
    """A heading as rendered: code spans kept as their text, links as their label,
    emphasis marks dropped."""
    raw = re.sub(r"`+([^`]*)`+", r"\1", raw)
    raw = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    return re.sub(r"[*_]{1,3}([^*_]+)[*_]{1,3}", r"\1", raw)


def github_slug(text: str) -> str:
    """GitHub's anchor for a heading (github-slugger): lower case, punctuation removed, each
    space a hyphen."""
    text = text.lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return text.replace(" ", "-")


def toc_slug(text: str) -> str:
    """Python-Markdown toc's default ``slugify``, which MkDocs uses."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(text: str, slug: Callable[[str], str]) -> set[str]:
    """The anchors a page's headings get under ``slug``; a repeated one gets -1, -2..."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for m in HEADING.finditer(prose_headings(text)):
        base = slug(heading_text(m.group(2)))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def prose_headings(text: str) -> str:
    """Only code blocks left out: a heading may hold a code span."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def links(text: str) -> list[tuple[int, str]]:
    """(line, target) of every link and image in the page's prose, relative ones only."""
    body = prose(text)
    found = [(m.start(), m.group(3)) for m in LINK.finditer(body)]
    found += [(m.start(), m.group(1)) for m in HTML_REF.finditer(body)]
    return [(body.count("\n", 0, at) + 1, target) for at, target in sorted(found)
            if not EXTERNAL.match(target)]


def dead_links(page: Path, text: str | None = None) -> list[str]:
    """What is wrong with each relative link of ``page``, one line each."""
    text = page.read_text(encoding="utf-8") if text is None else text
    problems: list[str] = []
    in_docs = page.parent == DOCS
    for line, target in links(text):
        where = f"{page.relative_to(ROOT)}:{line}: {target}"
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if path_part and not dest.exists():
            problems.append(f"{where}: no such file")
            continue
        if in_docs and path_part and not dest.is_relative_to(DOCS):
            problems.append(f"{where}: outside docs/, so missing from the site")
            continue
        if not anchor:
            continue
        if dest.suffix != ".md":
            problems.append(f"{where}: an anchor into a file that is not a page")
            continue
        dest_text = text if dest == page else dest.read_text(encoding="utf-8")
        if anchor not in anchors(dest_text, github_slug):
            problems.append(f"{where}: no heading with that anchor on GitHub")
        elif dest.parent == DOCS and anchor not in anchors(dest_text, toc_slug):
            problems.append(f"{where}: no heading with that anchor on the MkDocs site")
    return problems


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_dead_link(page: Path) -> None:
    assert dead_links(page) == []


def test_every_page_is_linked_from_the_readme_and_in_the_site_navigation() -> None:
    readme_targets = {t.partition("#")[0] for _, t in links(README.read_text(encoding="utf-8"))}
    nav = set(re.findall(r"^\s*-\s*[^:\n]+:\s*(\S+\.md)\s*$", MKDOCS_YML.read_text("utf-8"),
                         re.M))
    for page in sorted(DOCS.glob("*.md")):
        assert page.name in nav, f"docs/{page.name} is not in mkdocs.yml's nav"
        if page.name != "index.md":  # the site's home; the README is GitHub's
            assert f"docs/{page.name}" in readme_targets, f"README.md never links docs/{page.name}"
    assert nav <= {p.name for p in DOCS.glob("*.md")}, "mkdocs.yml's nav names a missing page"


def test_the_checker_finds_each_kind_of_dead_link() -> None:
    page = DOCS / "faq.md"
    text = "\n".join([
        "# A page",
        "## `dpprof run`: the seal",
        "[fine](run.md) [fine too](#dpprof-run-the-seal) ![picture](report.png)",
        "[gone](no-such-page.md)",
        "![gone too](no-such.png)",
        "[bad anchor](run.md#no-such-heading)",
        "[bad local anchor](#nowhere)",
        "[out of the site](../README.md)",
        '<img src="missing.svg">',
        "`[in code](not-followed.md)`",
        "```",
        "[in a block](not-followed-either.md)",
        "```",
        "[web](https://example.org/missing)",
    ])
    problems = dead_links(page, text)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "no-such-page.md: no such file",
        "no-such.png: no such file",
        "run.md#no-such-heading: no heading with that anchor on GitHub",
        "#nowhere: no heading with that anchor on GitHub",
        "../README.md: outside docs/, so missing from the site",
        "missing.svg: no such file",
    ]


@pytest.mark.parametrize(("heading", "github", "toc"), [
    ("Why cuda:0 is heavier, what each fix buys", "why-cuda0-is-heavier-what-each-fix-buys",
     "why-cuda0-is-heavier-what-each-fix-buys"),
    ("`dpprof compare` on real GPUs", "dpprof-compare-on-real-gpus",
     "dpprof-compare-on-real-gpus"),
    ("A — B", "a--b", "a-b"),  # where the two renderers differ
])
def test_anchors_as_each_renderer_makes_them(heading: str, github: str, toc: str) -> None:
    assert github_slug(heading_text(heading)) == github
    assert toc_slug(heading_text(heading)) == toc


def test_the_site_anchors_are_mkdocs_own() -> None:
    """toc_slug against Python-Markdown's own slugify, on every heading of every page (where
    the ``docs`` extra is installed)."""
    toc = pytest.importorskip("markdown.extensions.toc")
    for page in pages():
        for m in HEADING.finditer(prose_headings(page.read_text(encoding="utf-8"))):
            text = heading_text(m.group(2))
            assert toc_slug(text) == toc.slugify(text, "-"), (page.name, text)


def test_the_readme_is_short_with_both_entries_on_its_first_screen() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md is {len(lines)} lines: move the detail into docs/"
    first_screen = "\n".join(lines[:40])
    assert "dpprof compare --batch 512" in first_screen
    assert "dpprof run -- python train.py" in first_screen
    # the set-up and test commands, as a user copies them (CI runs the same pytest)
    text = "\n".join(lines)
    assert "\npip install -e . && dpprof compare --batch 512\n" in text
    assert '\npip install -e ".[test]" && pytest -n auto\n' in text
