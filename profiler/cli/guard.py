"""The exit-status policy applied: one guard every command runs its body in.

    with guarded(debug):
        ...  # a DpprofError -> its one line and exit status; Ctrl-C -> 130; SIGTERM -> 143;
             # any other exception -> "internal error", exit 1 (the traceback with --debug);
             # a workload's BaseException (not an Exception) -> one line, exit 1

The statuses are :mod:`dpprof.errors`'; :func:`install_signal_handlers` makes SIGTERM unwind
as Ctrl-C does (``finally`` blocks end the children and remove temporary files).
"""

from __future__ import annotations

import contextlib
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
    raise_interrupted,
    run_exit_status,
)
from dpprof.reports.escape import terminal_text

__all__ = ["exit_for_run", "guarded", "install_signal_handlers", "interrupted_line"]

_err = Console(stderr=True, highlight=False, markup=False, emoji=False)

PartialWriter = Callable[[Any, int], list[str]]


def install_signal_handlers() -> None:
    """SIGTERM (and SIGHUP) raise :class:`Interrupted` in the main thread, as SIGINT raises
    KeyboardInterrupt; a no-op outside the main thread."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError, OSError):  # not the main thread
            signal.signal(sig, raise_interrupted)


def interrupted_line(signum: int, written: list[str] | None = None) -> str:
    name = signal.Signals(signum).name
    if written:
        return (f"dpprof: interrupted ({name}); wrote what was measured before it, marked "
                f"partial: {', '.join(written)}")
    return f"dpprof: interrupted ({name})"


@contextmanager
def guarded(debug: bool, on_interrupt: PartialWriter | None = None) -> Iterator[None]:
    """Run a command's body under the exit-status policy (see the module docstring).

    ``on_interrupt(partial_run, signum)`` writes what an interrupted run had measured and
    returns the paths written (shown in the one line)."""
    try:
        yield
    except typer.Exit:
        raise
    except (KeyboardInterrupt, Interrupted) as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        partial = e.partial if isinstance(e, Interrupted) else None
        written: list[str] = []
        if partial is not None and on_interrupt is not None:
            try:
                written = on_interrupt(partial, signum)
            except (Exception, KeyboardInterrupt, Interrupted) as w:
                _err.print(f"dpprof: could not write the partial result: {terminal_text(str(w))}",
                           soft_wrap=True)
        _err.print(interrupted_line(signum, written), soft_wrap=True)
        raise typer.Exit(code=128 + signum if signum else EXIT_SIGINT) from None
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
