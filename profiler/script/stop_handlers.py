"""The script's own handlers of the stop signals (SIGINT, SIGTERM, SIGHUP).

A training script may take Ctrl-C or SIGTERM itself: a handler that sets a flag so the loop
saves and ends, one that calls ``sys.exit(0)``, or ``SIG_IGN``. Installed for real, such a
handler would replace dpprof's, so a stop would end the run as if the script had finished
(measured, then the alternatives run, exit 0), and it would stay installed for the runs
after. While the script runs, ``signal.signal`` and ``signal.getsignal`` keep its handlers
of those signals in a table instead (:func:`dpprof.errors.interrupts_allowed` hands the
first such signal to them, as on a GPU, and notes it, so the run still ends interrupted);
other signals pass through.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from dpprof.errors import STOP_SIGNALS

__all__ = ["scripts_stop_handlers"]

# what plain Python starts with, as the script would see it
_PLAIN: dict[int, Any] = {signal.SIGINT: signal.default_int_handler,
                          signal.SIGTERM: signal.SIG_DFL, signal.SIGHUP: signal.SIG_DFL}


@contextlib.contextmanager
def scripts_stop_handlers() -> Iterator[dict[int, Any]]:
    """While inside, the handlers the script sets for the stop signals land in the table
    yielded (signal number -> handler) and ``signal.getsignal`` answers from it."""
    theirs: dict[int, Any] = {}
    real_signal, real_getsignal = signal.signal, signal.getsignal

    def script_getsignal(signalnum: int) -> Any:
        if signalnum in STOP_SIGNALS:
            return theirs.get(signalnum, _PLAIN[signalnum])
        return real_getsignal(signalnum)

    def script_signal(signalnum: int, handler: Any) -> Any:
        in_main = threading.current_thread() is threading.main_thread()
        if signalnum not in STOP_SIGNALS or not in_main:
            return real_signal(signalnum, handler)  # its errors as Python's
        if handler not in (signal.SIG_IGN, signal.SIG_DFL) and not callable(handler):
            raise TypeError("signal handler must be signal.SIG_IGN, signal.SIG_DFL, or a "
                            "callable object")
        previous = script_getsignal(signalnum)
        theirs[signalnum] = handler
        return previous

    signal.signal, signal.getsignal = script_signal, script_getsignal  # type: ignore[assignment]
    try:
        yield theirs
    finally:
        signal.signal, signal.getsignal = real_signal, real_getsignal  # type: ignore[assignment]
