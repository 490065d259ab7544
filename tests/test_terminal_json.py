"""The terminal and JSON renderers against every saved result."""


from reports_data import HOSTILE, hostile, saved
from rich.console import Console

from dpprof.reports import terminal
from dpprof.result import RunResult


def _text(run: RunResult) -> str:
    console = Console(record=True, width=160, color_system=None)
    console.print(terminal.render(run))
    return console.export_text()


def test_terminal_oom_and_hostile_text() -> None:
    assert "OOM" in _text(saved("synthetic-oom"))
    text = _text(hostile(saved("emulated-lm")))  # rich markup in a name is text, not markup
    assert HOSTILE.split("<b>")[0] in " ".join(text.split())


def test_rich_markup_in_a_workload_name_does_not_break_the_table() -> None:
    run = saved("cpu-mlp")
    run.workload = "[/bold][red]x"
    assert "[/bold][red]x" in _text(run)
