"""The ``dpprof`` console script (and ``python -m dpprof``): signals first, then the commands.

Importing the commands imports torch (a second or more). Until a command runs, nothing
needs undoing (no child, no temporary file, no output), so a Ctrl-C, SIGTERM or SIGHUP in
that time ends the process at once with dpprof's one line and its exit status (130/143/129):
no import traceback, and no half-imported module read again on the way out. A command
then takes them as :mod:`dpprof.errors` says (:func:`dpprof.cli.app.main`).
"""

from __future__ import annotations

import os
import signal
import sys


def _quit_at_once(signum: int, frame: object = None) -> None:
    name = signal.Signals(signum).name
    os.write(2, f"dpprof: interrupted ({name}) before anything was measured\n".encode())
    os._exit(128 + signum)


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _quit_at_once)
    if next((a for a in sys.argv[1:] if not a.startswith("-")), None) == "run":
        # the seal's kernel line needs a process with one thread: before torch's import
        # starts another (dpprof.script.namespace)
        from dpprof.script import census_ahead, namespace

        namespace.enter()
        # the census of the user's files, in a thread while torch is imported (the
        # first run claims it, made current: dpprof.script.census_ahead)
        census_ahead.start_for_command(sys.argv)
    # deferred: nothing but the handlers may come before they are installed (typer and
    # rich, then torch through the commands: see the module)
    from dpprof.cli.app import main as app_main

    app_main()


if __name__ == "__main__":
    main()
