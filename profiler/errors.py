"""Errors that reach the user as one line on stderr, and dpprof's one exit-status policy.

Every command exits with one of these (``--help`` and docs/ci.md say the same):

====  =====================================================================================
0     measured (or rendered): every scenario ran; an out-of-memory is a result, not an error
1     a scenario errored, nothing was measured, or a file could not be read or written
2     usage: a bad option or value, an unknown scenario, a workload that cannot be loaded
3     a ``--fail-on-*`` check failed (CI)
130   interrupted by SIGINT (Ctrl-C); the scenarios already measured are written, marked partial
143   terminated by SIGTERM; the same
====  =====================================================================================

``dpprof watch -- CMD`` and ``dpprof run -- CMD`` exit with the command's own status once it ran.
"""

from __future__ import annotations

import signal
from typing import Any

EXIT_OK = 0
EXIT_ERROR = 1  # a scenario errored, nothing was measured, or a runtime error
EXIT_USAGE = 2  # bad input on the command line
EXIT_CHECK_FAILED = 3  # --fail-on-imbalance / --fail-on-oom
EXIT_SIGINT = 128 + signal.SIGINT  # 130
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143

EXIT_STATUS_HELP = (
    "Exit status: 0 measured; 1 a scenario errored or nothing was measured; 2 usage; "
    "3 a `--fail-on-*` check failed; 130/143 interrupted (SIGINT/SIGTERM)."
)
# Each command's own line: only the statuses (and options) that command has.
MAXBATCH_EXIT_STATUS_HELP = (
    "Exit status: 0 searched; 1 a scenario errored; 2 usage; 130/143 interrupted "
    "(SIGINT/SIGTERM)."
)
RUN_EXIT_STATUS_HELP = (
    "Exit status: 0 the script ran and was measured; the script's own (1 for an uncaught "
    "error) when it failed; 2 usage; 130/143 interrupted (SIGINT/SIGTERM)."
)
REPORT_EXIT_STATUS_HELP = (
    "Exit status: 0 rendered; 1 a file could not be read or written; 2 usage; 130/143 "
    "interrupted (SIGINT/SIGTERM)."
)
ENV_EXIT_STATUS_HELP = "Exit status: 0 printed; 2 usage; 130/143 interrupted (SIGINT/SIGTERM)."
CHECK_EXIT_STATUS_HELP = (
    "Exit status: 0 checked; 1 a check could not run; 2 usage, or no CUDA GPU here; "
    "130/143 interrupted (SIGINT/SIGTERM)."
)
WATCH_EXIT_STATUS_HELP = (
    "Exit status: the command's own once it ran (128 + N when a signal N ended it); before "
    "it ran: 1 dpprof could not start it, 2 usage, 130/143 interrupted (SIGINT/SIGTERM)."
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
    pass. ``partial`` is what was measured before it arrived (a RunResult), if anything."""

    def __init__(self, signum: int, partial: Any = None) -> None:
        self.signum = signum
        self.partial = partial
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def raise_interrupted(signum: int, frame: Any = None) -> None:
    """A signal handler: SIGTERM (or any other) becomes :class:`Interrupted` in the main
    thread, so ``finally`` blocks run as they do for Ctrl-C."""
    raise Interrupted(signum)


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
