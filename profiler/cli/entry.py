"""The ``dpprof`` console script (and ``python -m dpprof``): signals first, then the commands.

The commands that measure import torch and the emulator (a second or more; ``report``,
``watch`` and ``--help`` do not), here, before the command runs: until then nothing needs
undoing (no child, no temporary file, no output), so a Ctrl-C, SIGTERM or SIGHUP in that
time ends the process at once with dpprof's one line and its exit status (130/143/129): no
import traceback, and no half-imported module read again on the way out. A command then
takes them as :mod:`dpprof.errors` says (:func:`dpprof.cli.app.main`).
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

# what each measuring command runs on (torch, the emulator, the backends), imported before it
MEASURING = {"run": "dpprof.script.session", "compare": "dpprof.pipeline",
             "maxbatch": "dpprof.measure.maxbatch_search", "check": "dpprof.self_check"}


def _quit_at_once(signum: int, frame: object = None) -> None:
    name = signal.Signals(signum).name
    os.write(2, f"dpprof: interrupted ({name}) before anything was measured\n".encode())
    os._exit(128 + signum)


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _quit_at_once)
    command = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    if command == "run":
        # the seal's kernel line needs a process with one thread: before torch's import
        # starts another (dpprof.script.namespace)
        from dpprof.script import census_ahead, namespace

        namespace.enter()
        # the census of the user's files, in a thread while torch is imported (the
        # first run claims it, made current: dpprof.script.census_ahead)
        census_ahead.start_for_command(sys.argv)
    if command in MEASURING and "--help" not in sys.argv[1:]:
        importlib.import_module(MEASURING[command])
    # deferred: nothing but the handlers may come before they are installed (typer and
    # rich: see the module)
    from dpprof.cli.app import main as app_main

    app_main()


if __name__ == "__main__":
    main()
