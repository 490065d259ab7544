"""Regenerate the quoted sessions of README.md and docs/*.md from real runs of dpprof, and
check them.

    python scripts/readme_numbers.py          # rewrite the stale blocks
    python scripts/readme_numbers.py --check  # exit 1 when a block differs (what the test runs)

Each quoted session sits between ``<!-- readme-numbers: NAME -->`` and
``<!-- /readme-numbers -->`` in README.md or a page under docs/; :data:`SESSIONS` says how
each is produced (the command run through the CLI itself, at 104 columns, in a scratch
directory, with the files it needs copied there) and which parts of a long output the page
leaves out (``[... ...]`` lines). A name may be quoted on several pages; it runs once. Run
this after any change that moves the numbers (the emulator, the loop, the fixes) and commit
the pages with the change.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
WIDTH = 104  # columns of the quoted terminal (stdout); stderr's lines unwrapped, as in a log
STAMP = re.compile(r"\d{8}-\d{6}")  # the report files' time stamp
RUN_TIME = re.compile(r"(?<=\); )\d+(?:\.\d+)? s$", re.M)  # "(--steps 3; ...); 0.4 s"
# How dpprof run sealed the script depends on the machine (a mount namespace where it allows
# unprivileged user namespaces and dpprof entered one before any thread, else an audit hook),
# so a page quotes whichever the machine that regenerated it had.
SEAL_HOW = re.compile(r"by Python's file calls (?:and the kernel's mount namespace|\(no mount "
                      r"namespace here: an audit hook stops a write around them\))")
ANY_BLOCK = re.compile(r"<!-- readme-numbers: ([\w-]+) -->\n```\n.*?\n```\n"
                       r"<!-- /readme-numbers -->", re.S)


def _compare_excerpt(lines: list[str]) -> list[str]:
    """The default comparison: after the first attribution table, the other scenarios'
    tables and the fixes' details are left out."""
    out: list[str] = []
    skipping = ""
    seen_attribution = False
    for line in lines:
        if line.startswith("why cuda:0 is heavier under "):
            if seen_attribution:
                name = line.removeprefix("why cuda:0 is heavier under ").split(":")[0]
                out.append(f"[... the same for {name} ...]")
                skipping = "attribution"
                continue
            seen_attribution = True
            skipping = "first-attribution"
        if skipping == "first-attribution" and line.startswith("dp-loss-primary: cuda:0's"):
            skipping = "answer"  # the answer sentence and the note below the table
            continue
        if line.startswith("what each change buys"):
            skipping = "fixes"
        elif skipping == "fixes" and line and not line.startswith((" ", "─")):
            out.append("[... one paragraph per change ...]")
            skipping = "fix-details"
        if line.startswith(("wrote ", "Recommended: ")):  # the answer is quoted whole
            skipping = ""
        if skipping in ("attribution", "answer", "fix-details"):
            continue
        out.append(line)
    return out


NOTE = re.compile(r"[a-z0-9-]+: |kernels as on ")  # a note below the verdict


def _first_screen(lines: list[str]) -> list[str]:
    """A session as the README's first screen quotes it: the peaks per GPU, the verdict, what
    each change buys and the answer. Left out: the reserved-memory table, the notes, why
    cuda:0 is heavier and each change's paragraph (its code, for ``dpprof run`` its diff)."""
    out: list[str] = []
    state = "head"
    for line in lines:
        if state == "head" and line.startswith("on a GPU: reserved"):
            out.append("[... reserved memory and the CUDA context per GPU ...]")
            state = "reserved"
        elif state == "reserved" and line.startswith("cuda:0 needs "):
            state = "verdict"
        elif state == "verdict" and (not line or NOTE.match(line)
                                     or line.startswith("step time (")):  # a table's title
            out.append("[... notes; why cuda:0 is heavier, by cause ...]")
            state = "notes"
        elif state == "notes" and line.startswith("what each change buys"):
            state = "fixes"
        elif state == "fixes" and line and not line.startswith((" ", "─")):
            out.append("[... one paragraph per change, with its code ...]")
            state = "details"
        elif state == "details" and line.startswith("Recommended: "):
            state = "answer"
        if state in ("head", "verdict", "fixes", "answer"):
            out.append(line)
    return out


@dataclass(frozen=True)
class Session:
    args: list[str]  # dpprof's arguments
    prompt: bool  # show "$ dpprof ..." as the first line
    excerpt: Callable[[list[str]], list[str]] = lambda lines: lines
    files: list[str] = field(default_factory=list)  # copied from the checkout to the scratch dir


_DP_SCRIPT = "tests/scripts/dp_loss_outside.py"
_RUN_ARGS = ["run", "--", "python", "dp_loss_outside.py", "--batch-size", "256"]

SESSIONS: dict[str, Session] = {
    "compare": Session(["compare", "--batch", "512"], prompt=False, excerpt=_first_screen),
    "compare-full": Session(["compare", "--batch", "512"], prompt=True,
                            excerpt=_compare_excerpt),
    "maxbatch": Session(["maxbatch", "-w", "lm", "--gpu", "a100-80gb", "-g", "4",
                         "--multiple-of", "8"], prompt=True),
    "run": Session(_RUN_ARGS, prompt=True, excerpt=_first_screen, files=[_DP_SCRIPT]),
    "run-full": Session(_RUN_ARGS, prompt=True, files=[_DP_SCRIPT]),
}


@functools.cache
def _output(args: tuple[str, ...], files: tuple[str, ...]) -> tuple[str, ...]:
    """What ``dpprof ARGS`` prints, stderr's lines then stdout's, at :data:`WIDTH`; run once
    per command (the sessions that quote one command differently share its run)."""
    from typer.testing import CliRunner

    from dpprof.cli import common
    from dpprof.cli.app import app

    old_width, old_err = common.out.width, common.err.width
    common.out.width = WIDTH  # as on a terminal of WIDTH columns (piped output is wider)
    common.err.width = 1000
    cwd = os.getcwd()
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for name in files:
                shutil.copy(ROOT / name, scratch)
            os.chdir(scratch)  # the default reports go to ./dpprof-reports, not the checkout
            res = CliRunner().invoke(app, list(args), env={"COLUMNS": str(WIDTH)})
    finally:
        os.chdir(cwd)
        common.out.width, common.err.width = old_width, old_err
    if res.exit_code != 0:
        raise SystemExit(f"dpprof {' '.join(args)} exited {res.exit_code}:\n{res.output}")
    return tuple(line.rstrip() for line in (res.stderr + res.stdout).splitlines())


def run_session(session: Session) -> str:
    """The session as a user sees it, excerpted as the pages quote it."""
    lines = session.excerpt(list(_output(tuple(session.args), tuple(session.files))))
    while lines and not lines[-1]:
        lines.pop()
    head = [f"$ dpprof {' '.join(session.args)}"] if session.prompt else []
    return "\n".join(head + lines)


def _block(name: str) -> re.Pattern[str]:
    return re.compile(r"(<!-- readme-numbers: " + re.escape(name) + r" -->\n```\n)(.*?)(\n```"
                      r"\n<!-- /readme-numbers -->)", re.S)


def replaced(text: str, name: str, session: str) -> str:
    """``text`` with the block ``name`` quoting ``session``."""
    m = _block(name).search(text)
    if m is None:
        raise SystemExit(f"no <!-- readme-numbers: {name} --> block")
    return text[:m.start(2)] + session + text[m.end(2):]


def pages() -> list[Path]:
    """The pages that may quote sessions: README.md and every page under docs/."""
    return [README, *sorted(DOCS.glob("*.md"))]


def block_names(text: str) -> list[str]:
    """The sessions a page quotes, in its order."""
    return [m.group(1) for m in ANY_BLOCK.finditer(text)]


def quoted(text: str, name: str) -> str:
    """The session ``name`` as a page quotes it."""
    m = _block(name).search(text)
    if m is None:
        raise SystemExit(f"no <!-- readme-numbers: {name} --> block")
    return m.group(2)


def normalised(text: str) -> str:
    """What may differ between two identical runs: the report files' time stamps, the time
    a ``dpprof run`` scenario took, and how the machine sealed its runs (which moves the line
    breaks after it: lines are compared joined)."""
    text = RUN_TIME.sub("N s", STAMP.sub("YYYYmmdd-HHMMSS", text))
    text = text.replace("a private overlay (mount namespace)", "a private overlay")
    return SEAL_HOW.sub("SEALED", text.replace("\n", " "))


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    ap.add_argument("names", nargs="*", default=list(SESSIONS), help="sessions to regenerate")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in SESSIONS]
    if unknown:
        ap.error(f"unknown session(s) {', '.join(unknown)}; known: {', '.join(SESSIONS)}")
    stale: list[str] = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        changed = False
        for name in block_names(text):
            if name not in SESSIONS:
                print(f"{_shown(page)}: no session named {name!r} in scripts/readme_numbers.py",
                      file=sys.stderr)
                return 1
            if name not in args.names:
                continue
            fresh = run_session(SESSIONS[name])
            if normalised(fresh) != normalised(quoted(text, name)):
                stale.append(f"{_shown(page)}: the {name} session")
                text = replaced(text, name, fresh)
                changed = True
        if changed and not args.check:
            page.write_text(text, encoding="utf-8")
    if args.check:
        for what in stale:
            print(f"{what} is stale; rerun python scripts/readme_numbers.py", file=sys.stderr)
        return 1 if stale else 0
    print(f"regenerated {'; '.join(stale) or 'nothing (all current)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
