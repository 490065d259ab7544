"""Regenerate the README's quoted sessions from real runs of dpprof, and check them.

    python scripts/readme_numbers.py          # rewrite the blocks in README.md
    python scripts/readme_numbers.py --check  # exit 1 when a block differs (what the test runs)

Each quoted session sits between ``<!-- readme-numbers: NAME -->`` and
``<!-- /readme-numbers -->`` in README.md; :data:`SESSIONS` says how each is produced (the
command run through the CLI itself, at 104 columns, in a scratch directory) and which parts
of a long output the README leaves out (``[... ...]`` lines). Run it after any change that
moves the numbers (the emulator, the loop, the fixes) and commit README.md with the change.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
WIDTH = 104  # columns of the quoted terminal (stdout); stderr's lines unwrapped, as in a log
STAMP = re.compile(r"\d{8}-\d{6}")  # the report files' time stamp


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


@dataclass(frozen=True)
class Session:
    args: list[str]  # dpprof's arguments
    prompt: bool  # show "$ dpprof ..." as the first line
    excerpt: Callable[[list[str]], list[str]] = lambda lines: lines


SESSIONS: dict[str, Session] = {
    "compare": Session(["compare", "--batch", "512"], prompt=False, excerpt=_compare_excerpt),
    "maxbatch": Session(["maxbatch", "-w", "lm", "--gpu", "a100-80gb", "-g", "4",
                         "--multiple-of", "8"], prompt=True),
}


def run_session(session: Session) -> str:
    """The session as a user sees it: stderr's lines, then stdout's, at :data:`WIDTH`."""
    from typer.testing import CliRunner

    from dpprof.cli import common
    from dpprof.cli.app import app

    old_width, old_err = common.out.width, common.err.width
    common.out.width = WIDTH  # as on a terminal of WIDTH columns (piped output is wider)
    common.err.width = 1000
    cwd = os.getcwd()
    try:
        with tempfile.TemporaryDirectory() as scratch:
            os.chdir(scratch)  # the default reports go to ./dpprof-reports, not the checkout
            res = CliRunner().invoke(app, session.args, env={"COLUMNS": str(WIDTH)})
    finally:
        os.chdir(cwd)
        common.out.width, common.err.width = old_width, old_err
    if res.exit_code != 0:
        raise SystemExit(f"dpprof {' '.join(session.args)} exited {res.exit_code}:\n"
                         f"{res.output}")
    lines = [line.rstrip() for line in (res.stderr + res.stdout).splitlines()]
    lines = session.excerpt(lines)
    while lines and not lines[-1]:
        lines.pop()
    head = [f"$ dpprof {' '.join(session.args)}"] if session.prompt else []
    return "\n".join(head + lines)


def _block(name: str) -> re.Pattern[str]:
    return re.compile(r"(<!-- readme-numbers: " + re.escape(name) + r" -->\n```\n)(.*?)(\n```"
                      r"\n<!-- /readme-numbers -->)", re.S)


def quoted(text: str, name: str) -> str:
    """The session ``name`` as README.md quotes it."""
    m = _block(name).search(text)
    if m is None:
        raise SystemExit(f"README.md has no <!-- readme-numbers: {name} --> block")
    return m.group(2)


def normalised(text: str) -> str:
    """What may differ between two identical runs: the report files' time stamps."""
    return STAMP.sub("YYYYmmdd-HHMMSS", text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    ap.add_argument("names", nargs="*", default=list(SESSIONS), help="sessions to regenerate")
    args = ap.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    stale = []
    for name in args.names:
        fresh = run_session(SESSIONS[name])
        if normalised(fresh) != normalised(quoted(text, name)):
            stale.append(name)
            text = _block(name).sub(lambda m, f=fresh: m.group(1) + f + m.group(3), text)
    if args.check:
        for name in stale:
            print(f"README.md: the {name} session is stale; rerun python "
                  "scripts/readme_numbers.py", file=sys.stderr)
        return 1 if stale else 0
    README.write_text(text, encoding="utf-8")
    print(f"README.md: regenerated {', '.join(stale) or 'nothing (all current)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
