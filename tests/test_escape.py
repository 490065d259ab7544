"""User text is data: never rich markup, never a raw control sequence, escaped in every
Markdown context."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpprof.cli.app import app
from dpprof.reports import markdown, terminal
from dpprof.reports.escape import (
    for_terminal,
    markdown_text,
    mermaid_label,
    terminal_text,
)
from dpprof.saved_result import load

DATA = Path(__file__).parent / "data"
runner = CliRunner()
RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")

NAMED = '''
import torch
import dpprof

def _batch(n, device):
    return torch.randn(n, 4, device=device), torch.randn(n, 4, device=device)

def wl():
    return dpprof.Workload(model=lambda: torch.nn.Linear(4, 4), batch=_batch,
                           loss=torch.nn.MSELoss(), name=NAME)
'''


@pytest.mark.parametrize("name", ["[red]x[/red].md", "[/x].md", "a:smile:b.md"])
def test_output_paths_are_not_markup(tmp_path: Path, name: str) -> None:
    r = runner.invoke(app, ["compare", "-w", "mlp", "-b", "4", "-s", "single", "--no-fixes",
                            "-o", str(tmp_path / name)])
    assert r.exit_code == 0, r.output
    assert f"wrote {tmp_path / name}" in r.output  # the path as given, not as markup
    assert (tmp_path / name).exists()


@pytest.mark.parametrize("name", ["\x1b]0;pwned\x07", "\x1b[2J\x1b[H", "a:smile:c [/x]",
                                  "x\r\x08y\u202e"])
def test_a_workload_name_is_shown_escaped(tmp_path: Path, name: str) -> None:
    f = tmp_path / "wl.py"
    f.write_text(f"NAME = {name!r}\n" + NAMED)
    r = runner.invoke(app, ["compare", "-w", f"{f}:wl", "-b", "4", "-s", "single",
                            "--no-fixes", "-o", str(tmp_path / "r.md")])
    assert r.exit_code == 0, r.output
    assert not RAW_CONTROL.search(r.output.replace("\n", "")), repr(r.output)
    assert terminal_text(name) in r.output
    assert "😄" not in r.output
    md_text = (tmp_path / "r.md").read_text()
    assert not RAW_CONTROL.search(md_text.replace("\n", ""))


def test_terminal_escapes_every_field_of_a_hostile_result() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from reports_data import hostile  # type: ignore[import-not-found]

    run = hostile(load(DATA / "synthetic-oom.json"))
    first = run.scenarios[0]
    run = dataclasses.replace(
        run, workload="\x1b]0;pwned\x07[/x]:smile:", scenarios=(
            dataclasses.replace(first, notes=(*first.notes, "\x1b[31mred\x1b[0m")),
            *run.scenarios[1:]))
    from rich.console import Console

    console = Console(record=True, width=200, markup=False, emoji=False, color_system=None)
    console.print(terminal.render(for_terminal(run)))
    text = console.export_text()
    assert "\x1b" not in text and "\\x1b]0;pwned\\x07[/x]:smile:" in text


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("@alice please look", "@\u200balice please look"),
        ("<img src=x onerror=alert(1)>", "&lt;img src=x onerror=alert(1)&gt;"),
        ("a | b", "a \\| b"),
        ("# not a heading", "\\# not a heading"),
        ("- not a list", "\\- not a list"),
        ("1. not a list", "1\\. not a list"),
        (":smile: a:b:c", "\\:smile: a\\:b:c"),
        ("$x^2$", "\\$x^2\\$"),
        ("line\nbreak", "line break"),
        ("\x1b[2J", "\\\\x1b\\[2J"),
    ],
)
def test_markdown_text(raw: str, shown: str) -> None:
    assert markdown_text(raw) == shown


def test_mermaid_labels_carry_no_syntax() -> None:
    label = mermaid_label('%%{init: {"theme": "dark"}}%% a|b "q" [x] #1; @bob')
    inner = label[1:-1]
    assert label.startswith('"') and label.endswith('"')
    for bad in ("%", "{", "}", "|", '"', "[", "]", "#", ";"):
        assert bad not in inner
    assert "@\u200bbob" in inner


def test_markdown_report_of_a_hostile_result_has_no_raw_html_or_mentions() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from reports_data import hostile

    run = hostile(load(DATA / "emulated-lm.json"))
    assert run.fixes and run.attribution
    run = dataclasses.replace(
        run, fixes=tuple(dataclasses.replace(
            f, title="<b>@alice</b> %%{init}%%", detail="| x | ```", code="```\nrm -rf /\n```")
            for f in run.fixes),
        attribution={k: dataclasses.replace(a, answer="<script>x</script> @bob")
                     for k, a in run.attribution.items()},
        fail_reasons=(*run.fail_reasons, "<i>@carol</i>"))
    from dpprof.reports.answer_sections import markdown_sections
    from dpprof.reports.view_builder import build_view

    sections = markdown_sections(build_view(run))
    assert "````" in sections  # a code block holding ``` gets a longer fence
    text = markdown.render(run) + sections
    # what GitHub reads as Markdown and HTML: outside code blocks and code spans
    prose = re.sub(r"^(`{3,})[^\n]*\n.*?^\1$", "", text, flags=re.M | re.S)
    prose = re.sub(r"(?<!\\)(`+)(?!`).*?(?<!`)\1(?!`)", "", prose, flags=re.S)
    for bad in ("<b>", "<script>", "<i>", "@alice", "@bob", "@carol"):
        assert bad not in prose, bad


def test_report_files_hold_no_control_characters_from_user_strings(tmp_path: Path) -> None:
    """A terminal escape in a workload's name is not written into a report file either
    (``cat run.html`` would run it)."""
    name = "\x1b]0;pwned\x07wl\x1b[2J\u202e"
    f = tmp_path / "wl.py"
    f.write_text(f"NAME = {name!r}\n" + NAMED)
    outs = [tmp_path / f"r.{ext}" for ext in ("html", "md", "json")]
    r = runner.invoke(app, ["compare", "-w", f"{f}:wl", "-b", "4", "-s", "single",
                            "--no-fixes", *[a for o in outs for a in ("-o", str(o))]])
    assert r.exit_code == 0, r.output
    for out in outs:
        text = out.read_text(encoding="utf-8")
        for c in ("\x1b", "\x07", "\u202e"):
            assert c not in text, (out.name, repr(c))
    assert "wl" in (tmp_path / "r.html").read_text(encoding="utf-8")
