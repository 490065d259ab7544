"""A script's own output while ``dpprof run`` draws its progress bar.

rich's live display redirects ``sys.stdout`` and ``sys.stderr`` into its console so that
what is printed appears above the bar; for a training script that is not enough: the
script's standard output went to dpprof's console (standard error), so ``dpprof run ... |
tee log`` lost it; each ``flush()`` of a partial line (tqdm's ``\\r`` updates) printed it as
a line of its own, so progress lines stacked; and long lines were cut at the terminal's
width. :class:`LiveLines` keeps each stream where it was going: into a pipe or a file as
written, and onto the terminal as whole lines above the bar, a line's last ``\\r`` segment
only (what a terminal would leave on screen), wrapped by the terminal, not cut.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator
from typing import TextIO, cast

from rich.console import Console
from rich.text import Text

__all__ = ["LiveLines", "script_output_above"]


class LiveLines(io.TextIOBase):
    """``file`` (the script's stdout or stderr) while a live display is drawn on
    ``console``: on a terminal, each complete line printed above the display; elsewhere
    (a pipe, a file) every write passed through unchanged."""

    def __init__(self, console: Console, file: TextIO) -> None:
        super().__init__()
        self._console = console
        self._file = file
        self._screen = _isatty(file)
        self._partial = ""

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if not self._screen:
            return self._file.write(text)
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            self._show(line)
        return len(text)

    def _show(self, line: str) -> None:
        # what a terminal leaves of a line rewritten with carriage returns: its last part
        self._console.print(Text.from_ansi(line.rsplit("\r", 1)[-1]), soft_wrap=True)

    def flush(self) -> None:
        # a partial line waits for its end: shown now, the next update would stack under it
        if not self._screen:
            self._file.flush()

    def finish(self) -> None:
        """The display is done: a line still partial is shown as it stands."""
        if self._partial:
            self._show(self._partial)
            self._partial = ""

    @property
    def rich_proxied_file(self) -> TextIO:
        """The stream under this one: where a rich console whose file is ``sys.stderr``
        writes (rich's own proxies say so the same way), not back into this proxy."""
        return self._file

    def isatty(self) -> bool:
        return self._screen

    def fileno(self) -> int:
        return self._file.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._file, "encoding", "utf-8") or "utf-8"

    def writable(self) -> bool:
        return True


def _isatty(file: TextIO) -> bool:
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError, OSError):
        return False


@contextlib.contextmanager
def script_output_above(console: Console) -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` as :class:`LiveLines` over ``console`` while the
    display is drawn (only where the console is a terminal: otherwise there is no display
    to keep the output off), then as they were."""
    if not console.is_terminal:
        yield
        return
    streams = {"stdout": LiveLines(console, sys.stdout), "stderr": LiveLines(console, sys.stderr)}
    before = {name: getattr(sys, name) for name in streams}
    for name, proxy in streams.items():
        setattr(sys, name, cast("TextIO", proxy))
    try:
        yield
    finally:
        for name, proxy in streams.items():
            if getattr(sys, name) is proxy:
                setattr(sys, name, before[name])
            proxy.finish()
