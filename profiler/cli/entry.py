"""The ``dpprof`` console script (and ``python -m dpprof``): signals first, then the commands.

Importing the commands imports torch (a second or more); a Ctrl-C or SIGTERM in that time
gets dpprof's one line and its exit status (130/143), not an import traceback.
"""

from __future__ import annotations

import signal
import sys


def main() -> None:
    # deferred, all three: nothing but the handlers may come before they are installed
    # (typer and rich, then torch through the commands: see the module)
    from dpprof.cli.guard import install_signal_handlers, interrupted_line
    from dpprof.errors import EXIT_SIGINT, Interrupted

    install_signal_handlers()
    if next((a for a in sys.argv[1:] if not a.startswith("-")), None) == "run":
        # the seal's kernel line needs a process with one thread: before torch's import
        # starts another (dpprof.script.namespace)
        from dpprof.script import namespace

        namespace.enter()
    try:
        from dpprof.cli.app import main as app_main
    except KeyboardInterrupt:
        print(interrupted_line(signal.SIGINT), file=sys.stderr)
        sys.exit(EXIT_SIGINT)
    except Interrupted as e:
        print(interrupted_line(e.signum), file=sys.stderr)
        sys.exit(e.exit_code)
    app_main()


if __name__ == "__main__":
    main()
