"""A script's own output while ``dpprof run`` draws its progress bar
(:mod:`dpprof.cli.live_output`): on a terminal, whole lines above the bar, a line rewritten
with carriage returns shown as a terminal leaves it, long lines not cut; into a pipe,
everything as written; and in a real pseudo-terminal, the script's stdout stays stdout."""

from __future__ import annotations

import io
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from dpprof.cli.live_output import LiveLines, script_output_above


class Tty(io.StringIO):
    """A terminal's stream, as the script sees it."""

    def isatty(self) -> bool:
        return True


def screen(width: int = 40) -> tuple[Console, io.StringIO]:
    shown = io.StringIO()
    return Console(file=shown, force_terminal=True, width=width, color_system=None), shown


def test_carriage_return_updates_show_once_as_the_terminal_leaves_them() -> None:
    console, shown = screen()
    lines = LiveLines(console, Tty())
    for i in range(3):  # tqdm's way: \r, the new state, a flush; a newline at the end
        lines.write(f"\rstep {i}")
        lines.flush()
    assert shown.getvalue() == ""  # a partial line waits (each flush printed a line)
    lines.write("\n")
    assert shown.getvalue() == "step 2\n"


def test_a_long_line_is_not_cut_at_the_terminal_width() -> None:
    console, shown = screen(width=40)
    lines = LiveLines(console, Tty())
    long = "x" * 100
    lines.write(long + "\nend")
    lines.finish()  # the display ends: the partial line is shown
    assert shown.getvalue() == long + "\nend\n"


def test_into_a_pipe_every_write_passes_through() -> None:
    console, shown = screen()
    pipe = io.StringIO()
    lines = LiveLines(console, pipe)
    lines.write("\rstep 1")
    lines.write("\rstep 2\nloss 0.5\n")
    assert pipe.getvalue() == "\rstep 1\rstep 2\nloss 0.5\n" and shown.getvalue() == ""
    assert not lines.isatty()


def test_a_console_on_stderr_writes_under_the_proxy_not_into_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """dpprof's own console is ``Console(stderr=True)``: it writes to whatever sys.stderr
    is, the proxy included; told the stream under it (rich_proxied_file), it writes there
    (it printed into itself without end: dpprof run hung in a terminal)."""
    terminal = Tty()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(sys, "stdout", Tty())
    console = Console(stderr=True, force_terminal=True, width=60, color_system=None)
    with script_output_above(console):
        print("from the script", file=sys.stderr)
        console.print("from dpprof")
    assert terminal.getvalue() == "from the script\nfrom dpprof\n"
    assert sys.stderr is terminal


SCRIPT = '''
import sys
import torch
model = torch.nn.Linear(8, 8).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
print("starting " + "x" * 150)
for i in range(4):
    model(torch.randn(4, 8, device="cuda")).sum().backward()
    opt.step()
    sys.stderr.write(f"\\rstep {i}")
    sys.stderr.flush()
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux pseudo-terminal")
def test_dpprof_run_in_a_terminal_with_stdout_piped(tmp_path: Path) -> None:
    import pty

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    master, slave = pty.openpty()
    cmd = [sys.executable, "-m", "dpprof", "run", "--steps", "3", "-o", "r.json", "--",
           "python", str(script)]
    proc = subprocess.Popen(cmd, stdin=slave, stdout=subprocess.PIPE, stderr=slave,
                            cwd=tmp_path)
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    else:
        proc.kill()
        pytest.fail("dpprof run did not end within 120 s in a terminal")
    piped = proc.stdout.read().decode() if proc.stdout else ""
    assert proc.wait() == 0
    terminal = seen.decode(errors="replace")
    # the script's stdout went to the pipe, whole; its \r updates to the terminal, once
    assert "starting " + "x" * 150 + "\n" in piped
    assert "starting" not in terminal
    assert terminal.count("step 1") == 1 and "step 0" not in terminal
