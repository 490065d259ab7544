"""The exit-status policy applied: one guard every command runs its body in.

    with guarded(debug):
        ...  # a DpprofError -> its one line and exit status; Ctrl-C -> 130; SIGTERM -> 143;
             # any other exception -> "internal error", exit 1 (the traceback with --debug);
             # a workload's BaseException (not an Exception) -> one line, exit 1

The statuses are :mod:`dpprof.errors`'; :func:`install_signal_handlers` makes SIGTERM unwind
as Ctrl-C does (``finally`` blocks end the children and remove temporary files).
"""

from __future__ import annotations

import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console

from dpprof.errors import (
    EXIT_ERROR,
    EXIT_SIGINT,
    DpprofError,
    Interrupted,
    exit_decided,
    install_stop_handlers,
    interrupt_signal,
    reset_interrupts,
    run_exit_status,
    take_interrupt,
)
from dpprof.reports.escape import terminal_text

__all__ = ["exit_for_run", "guarded", "install_signal_handlers", "interrupted_line"]

_err = Console(stderr=True, highlight=False, markup=False, emoji=False)

PartialWriter = Callable[[Any, int], list[str]]


def install_signal_handlers() -> None:
    """SIGINT, SIGTERM and SIGHUP taken as :mod:`dpprof.errors` says
    (:func:`~dpprof.errors.on_stop_signal`): SIGTERM and SIGHUP raise :class:`Interrupted`
    in the main thread, as SIGINT raises KeyboardInterrupt; a no-op outside it."""
    install_stop_handlers()


def interrupted_line(signum: int, written: list[str] | None = None, during: str = "",
                     why_not: str = "") -> str:
    """The one line of an interrupted command: what it stopped, and what it wrote of what
    was measured (or why it wrote nothing)."""
    head = f"dpprof: interrupted ({signal.Signals(signum).name})" + (
        f" during {during}" if during else "")
    if written:
        return f"{head}; wrote what was measured before it, marked partial: {', '.join(written)}"
    if why_not:
        return f"{head}; no report written: {why_not}"
    return head


@contextmanager
def guarded(debug: bool, on_interrupt: PartialWriter | None = None) -> Iterator[None]:
    """Run a command's body under the exit-status policy (see the module docstring).

    ``on_interrupt(partial_run, signum)`` writes what an interrupted run had measured and
    returns the paths written (shown in the one line)."""
    reset_interrupts()
    try:
        yield
    except typer.Exit:
        raise
    except (KeyboardInterrupt, Interrupted) as e:
        signum = interrupt_signal(e)
        take_interrupt(signum)  # the next signal is held while the partial result is written
        partial = e.partial if isinstance(e, Interrupted) else None
        written: list[str] = []
        why_not = ""
        if on_interrupt is not None:
            if partial is None:
                why_not = "nothing was measured before it"
            else:
                try:
                    written = on_interrupt(partial, signum)
                except Exception as w:
                    why_not = ("could not write the partial result: "
                               + terminal_text(str(w) or type(w).__name__))
        during = e.during if isinstance(e, Interrupted) else ""
        _err.print(interrupted_line(signum, written, during, why_not), soft_wrap=True)
        status = 128 + signum if signum else EXIT_SIGINT
        exit_decided(status)
        raise typer.Exit(code=status) from None
    except DpprofError as e:
        raise _fail(e, debug, e.exit_code) from None
    except SystemExit as e:  # a workload (or a library it calls) called sys.exit()
        raise _fail(e, debug, EXIT_ERROR, f"the workload called sys.exit({e.code!r}) inside "
                    "dpprof: nothing was measured; remove the exit from the code dpprof "
                    "runs") from None
    except OSError as e:
        raise _fail(e, debug, EXIT_ERROR, f"{e.strerror or e}" + (
            f": {e.filename}" if e.filename else "")) from None
    except RecursionError as e:
        raise _fail(e, debug, EXIT_ERROR, "input nested too deeply") from None
    except Exception as e:  # a bug in dpprof: say so in one line unless --debug
        if debug:
            raise
        _err.print(f"dpprof: internal error: {type(e).__name__}: {terminal_text(str(e))} "
                   "(rerun with --debug)",
                   soft_wrap=True)
        raise typer.Exit(code=EXIT_ERROR) from None
    except BaseException as e:  # GeneratorExit, or a workload's own BaseException subclass
        raise _fail(e, debug, EXIT_ERROR, f"the workload raised {type(e).__name__}"
                    f"{': ' + str(e) if str(e) else ''}, a BaseException that is not an "
                    "Exception, which stops dpprof as it would stop the training loop: "
                    "nothing was measured; raise an Exception subclass instead") from None


def _fail(e: BaseException, debug: bool, code: int, text: str | None = None) -> typer.Exit:
    if debug:
        _err.print("".join(traceback.format_exception(e)), soft_wrap=True)
    _err.print(f"dpprof: error: {terminal_text(text or str(e))}", soft_wrap=True)
    return typer.Exit(code=code)


def exit_for_run(run: Any) -> None:
    """Exit 1 when any scenario errored or nothing was measured (one line saying which)."""
    code = run_exit_status(run)
    if code == 0:
        return
    errored = [s.name for s in getattr(run, "scenarios", []) if s.status == "error"]
    if errored:
        _err.print(f"dpprof: {len(errored)} scenario(s) errored: {', '.join(errored)} "
                   "(exit status 1)", soft_wrap=True)
    else:
        _err.print("dpprof: nothing was measured (exit status 1)", soft_wrap=True)
    sys.stdout.flush()
    raise typer.Exit(code=code)
