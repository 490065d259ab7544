"""Errors that reach the user as one line on stderr, and dpprof's one exit-status policy.

Every command exits with one of these (``--help`` and docs/ci.md say the same):

====  =====================================================================================
0     measured (or rendered): every scenario ran; an out-of-memory is a result, not an error
1     a scenario errored, nothing was measured, or a file could not be read or written
2     usage: a bad option or value, an unknown scenario, a workload that cannot be loaded
3     a ``--fail-on-*`` check failed (CI)
130   interrupted by SIGINT (Ctrl-C); the scenarios already measured are written, marked partial
143   terminated by SIGTERM; the same
129   hung up (SIGHUP); the same
====  =====================================================================================

``dpprof watch -- CMD`` and ``dpprof run -- CMD`` exit with the command's own status once it ran.
"""

from __future__ import annotations

import _thread
import atexit
import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

EXIT_OK = 0
EXIT_ERROR = 1  # a scenario errored, nothing was measured, or a runtime error
EXIT_USAGE = 2  # bad input on the command line
EXIT_CHECK_FAILED = 3  # --fail-on-imbalance / --fail-on-oom
EXIT_SIGINT = 128 + signal.SIGINT  # 130
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143

EXIT_STATUS_HELP = (
    "Exit status: 0 measured; 1 a scenario errored or nothing was measured; 2 usage; "
    "3 a `--fail-on-*` check failed; 130/143/129 interrupted (SIGINT/SIGTERM/SIGHUP)."
)
# Each command's own line: only the statuses (and options) that command has.
MAXBATCH_EXIT_STATUS_HELP = (
    "Exit status: 0 searched; 1 a scenario errored; 2 usage; 130/143/129 interrupted "
    "(SIGINT/SIGTERM/SIGHUP)."
)
RUN_EXIT_STATUS_HELP = (
    "Exit status: 0 the script ran and was measured; the script's own (1 for an uncaught "
    "error; under a launcher, the failed rank's) when it failed; 1 nothing was measured (it "
    "put nothing on a GPU); 2 usage; 130/143/129 interrupted (SIGINT/SIGTERM/SIGHUP)."
)
REPORT_EXIT_STATUS_HELP = (
    "Exit status: 0 rendered; 1 a file could not be read or written; 2 usage; 130/143/129 "
    "interrupted (SIGINT/SIGTERM/SIGHUP)."
)
ENV_EXIT_STATUS_HELP = (
    "Exit status: 0 printed; 2 usage; 130/143/129 interrupted (SIGINT/SIGTERM/SIGHUP)."
)
CHECK_EXIT_STATUS_HELP = (
    "Exit status: 0 checked; 1 a check could not run; 2 usage, or no CUDA GPU here; "
    "130/143/129 interrupted (SIGINT/SIGTERM/SIGHUP)."
)
WATCH_EXIT_STATUS_HELP = (
    "Exit status: the command's own once it ran (128 + N when a signal N ended it); before "
    "it ran: 1 dpprof could not start it, 2 usage, 130/143/129 interrupted "
    "(SIGINT/SIGTERM/SIGHUP)."
)


class DpprofError(Exception):
    """A runtime problem: exit status 1."""

    exit_code = EXIT_ERROR


class UsageError(DpprofError):
    """Bad input on the command line: exit status 2."""

    exit_code = EXIT_USAGE


class WorkloadError(UsageError):
    """A workload that cannot be found, loaded or used."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived: unwind (children ended, temporary files removed) and exit
    ``128 + signum``. A BaseException, as KeyboardInterrupt: ``except Exception`` lets it
    pass. ``partial`` is what was measured before it arrived (a RunResult), if anything;
    ``during``: what it stopped, in words ("the DDP alternative"), where that is known."""

    def __init__(self, signum: int, partial: Any = None, during: str = "") -> None:
        self.signum = signum
        self.partial = partial
        self.during = during
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def raise_interrupted(signum: int, frame: Any = None) -> None:
    """A signal handler: SIGTERM (or any other) becomes :class:`Interrupted` in the main
    thread, so ``finally`` blocks run as they do for Ctrl-C."""
    raise Interrupted(signum)


# ---- a stop is a stop -------------------------------------------------------------------
#
# How a command takes SIGINT, SIGTERM and SIGHUP (:func:`on_stop_signal`, installed by the
# command line): the first raises where the program is (KeyboardInterrupt for SIGINT, as a
# script expects; Interrupted for the others), except inside :func:`deferred_interrupts`
# (dpprof putting torch back, or setting it up), which delivers it at its end. Once dpprof
# has taken an interrupt (:func:`take_interrupt`: it is stopping and writes what was
# measured), the next is held and said, so the partial result is still written; the one
# after quits at once, saying it did not write it.

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Interrupts:
    """The command's interrupts so far (one per process: signals go to the main thread)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.deferring = 0  # depth of deferred_interrupts()
        self.pending: int | None = None  # a signal that arrived while deferring
        self.taken: int | None = None  # the signal dpprof is stopping on
        self.again = 0  # signals since it was taken
        self.delivered: int | None = None  # the last raised where the program was
        # inside interrupts_allowed(): the handlers the program there set for stop signals
        self.theirs: dict[int, Any] | None = None
        self.exiting: int | None = None  # the exit status decided: only exiting is left
        self.half_written: set[str] = set()  # temporary files a quit at once removes
        self.pid = os.getpid()  # dpprof's process: a fork of it (a DataLoader's worker) is not


_STATE = _Interrupts()


def _say(line: str) -> None:
    with contextlib.suppress(OSError):  # from a signal handler: no buffered stream
        os.write(2, (line + "\n").encode())


def on_stop_signal(signum: int, frame: Any = None) -> None:
    """The command line's handler of :data:`STOP_SIGNALS` (see above)."""
    state = _STATE
    if os.getpid() != state.pid:
        _as_without_dpprof(signum, frame)  # a process the script forked: the signal is its
        return
    name = signal.Signals(signum).name
    if state.exiting is not None:  # all is written and said: the status stays
        os._exit(state.exiting)
    if state.taken is not None:
        state.again += 1
        if state.again == 1:
            _say(f"dpprof: {name} again: writing what was measured first ({name} once more "
                 "quits without it)")
            return
        _say(f"dpprof: {name} again: quit without writing the partial result")
        for path in state.half_written:
            with contextlib.suppress(OSError):
                os.unlink(path)
        os._exit(128 + state.taken)
    if state.deferring:
        if state.pending is None:
            state.pending = signum
        return
    theirs = (state.theirs or {}).get(signum, signal.SIG_DFL)
    first = state.delivered is None
    state.delivered = signum  # the run ends interrupted, however the program takes it
    if first and theirs is not signal.SIG_DFL:  # the program's own: it takes the first
        if callable(theirs):
            theirs(signum, frame)
        return
    if _in_a_callback(frame):  # raised there, it would be printed and dropped
        # delivered again in a moment, from another thread (tripped from here, it would be
        # handled at once, inside this handler, still in the callback)
        again = threading.Timer(0.002, _thread.interrupt_main, (signal.Signals(signum),))
        again.daemon = True
        again.start()
        return
    _raise(signum)


# the code of callbacks Python calls where an exception cannot go on (a weak reference's:
# it is printed, "Exception ignored in", and dropped): a stop signal arriving in one is
# raised once the callback has returned
_CALLBACKS: set[Any] = set()


def called_where_nothing_raises(callback: Any) -> Any:
    """``callback`` (a function, or a method's function) marked as called where an
    exception is dropped (see above); it is returned."""
    _CALLBACKS.add(callback.__code__)
    return callback


def _in_a_callback(frame: Any) -> bool:
    while frame is not None:
        if frame.f_code in _CALLBACKS:
            return True
        frame = frame.f_back
    return False


def _as_without_dpprof(signum: int, frame: Any) -> None:
    """A stop signal in a process the script forked from dpprof's (a DataLoader's worker,
    which torch's ``terminate()`` stops with SIGTERM), taken as the interpreter takes it
    without dpprof: by the script's own handler, else SIGINT as KeyboardInterrupt and the
    others by their default action, the process ended by the signal. It inherited dpprof's
    handler, which would unwind dpprof's run in it (a partial report written over the
    parent's, the parent's temporary files removed)."""
    theirs = (_STATE.theirs or {}).get(signum, signal.SIG_DFL)
    if callable(theirs):
        theirs(signum, frame)
        return
    if theirs == signal.SIG_IGN:
        return
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    _SET_HANDLER(signum, signal.SIG_DFL)  # Python's own (the script's runs replace it)
    os.kill(os.getpid(), signum)


_SET_HANDLER = signal.signal


def _raise(signum: int) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Interrupted(signum)


def install_stop_handlers() -> None:
    """:func:`on_stop_signal` for :data:`STOP_SIGNALS`, from a state with no interrupt taken
    or pending; a no-op outside the main thread."""
    _STATE.reset()
    for sig in STOP_SIGNALS:
        with contextlib.suppress(ValueError, OSError):  # not the main thread
            signal.signal(sig, on_stop_signal)
    atexit.unregister(_ignore_stops_when_exiting)
    atexit.register(_ignore_stops_when_exiting)  # first registered: runs last


@contextlib.contextmanager
def removed_if_quit(temporary_path: str) -> Iterator[None]:
    """While inside, a stop signal that quits the process at once (see above) removes
    ``temporary_path`` first: a report half written is not left beside the user's files."""
    _STATE.half_written.add(temporary_path)
    try:
        yield
    finally:
        _STATE.half_written.discard(temporary_path)


def exit_decided(status: int) -> None:
    """An interrupted command has written and said all it will and exits ``status``: a
    stop signal from now on ends the process at once with that status (not Python's
    default death by the signal, once the interpreter has put its handlers back)."""
    _STATE.exiting = status


def _ignore_stops_when_exiting() -> None:
    # the interpreter's shutdown puts the default handlers back after this (SIG_IGN kept)
    if _STATE.exiting is not None:
        for sig in STOP_SIGNALS:
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """A stop signal that arrives inside is delivered at its end (raised there), so what
    runs inside (patches undone, a process's state restored) is never cut in half."""
    state = _STATE
    state.deferring += 1
    try:
        yield
    finally:
        state.deferring -= 1
        if not state.deferring and state.pending is not None:
            signum, state.pending = state.pending, None
            if state.taken is None:
                _raise(signum)


@contextlib.contextmanager
def interrupts_allowed(theirs: dict[int, Any] | None = None) -> Iterator[None]:
    """Inside :func:`deferred_interrupts`, a stretch where a stop signal raises at once
    (a script's own time); one that waited is raised as it begins. ``theirs``: the handlers
    the program running inside sets for stop signals, kept up to date by the caller; the
    first stop signal goes to such a handler (to none for ``SIG_IGN``), a second raises."""
    state = _STATE
    saved, state.deferring = state.deferring, 0
    saved_theirs, state.theirs = state.theirs, theirs
    state.delivered = None
    try:
        if state.pending is not None and state.taken is None:
            signum, state.pending = state.pending, None
            state.delivered = signum
            _raise(signum)
        yield
    finally:
        state.deferring = saved
        state.theirs = saved_theirs


def pending_interrupt() -> int | None:
    """The stop signal that arrived while deferred and is not yet raised (taken from the
    queue: the caller answers it), or None."""
    signum, _STATE.pending = _STATE.pending, None
    return signum


def interrupt_delivered() -> int | None:
    """The stop signal last raised inside :func:`interrupts_allowed`, if any: an error the
    program raised after it is the interrupt's doing (a DataLoader worker it ended)."""
    return _STATE.delivered


def interrupt_signal(e: BaseException) -> int:
    """The signal an interrupt (KeyboardInterrupt or :class:`Interrupted`) stands for."""
    return e.signum if isinstance(e, Interrupted) else signal.SIGINT


def take_interrupt(signum: int) -> None:
    """dpprof is stopping on ``signum`` (see above): the next stop signal is held."""
    if _STATE.taken is None:
        _STATE.taken = signum


def reset_interrupts() -> None:
    """A command starts: no interrupt taken, none pending."""
    _STATE.reset()


def run_exit_status(run: Any) -> int:
    """The exit status a finished run earns before ``--fail-on-*`` checks: 1 when any scenario
    errored or nothing was measured (no scenario, or none with a measured device), else 0."""
    scenarios = list(getattr(run, "scenarios", None) or [])
    if any(s.status == "error" for s in scenarios):
        return EXIT_ERROR
    if getattr(run, "watch", None) is not None or getattr(run, "maxbatch", None) is not None:
        return EXIT_OK
    if not any(s.status in ("ok", "oom") and s.devices for s in scenarios):
        return EXIT_ERROR
    return EXIT_OK


class NotEmulated(DpprofError):
    """A path of the script that dpprof cannot emulate (a collective its process group lacks,
    a framework's engine it does not re-enact): the run stops with this one line, which
    names dpprof and what is missing, never a traceback that reads as the script's."""
