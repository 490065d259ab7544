"""The ``dpprof`` command line: the app, and each command registered from its own module.

    dpprof compare --batch 512
    dpprof maxbatch --workload lm --gpu a100-80gb
    dpprof run -- python train.py
    dpprof watch -- python train.py
    dpprof report run.json -o run.html
    dpprof env
    dpprof check
"""

from __future__ import annotations

import signal
import sys
from typing import Annotated

import typer

from dpprof import __version__
from dpprof.cli.check import check_cmd
from dpprof.cli.common import out
from dpprof.cli.compare import compare_cmd
from dpprof.cli.env import env_cmd
from dpprof.cli.guard import install_signal_handlers, interrupted_line
from dpprof.cli.maxbatch import maxbatch_cmd
from dpprof.cli.report import report_cmd
from dpprof.cli.run import run_cmd
from dpprof.cli.watch import watch_cmd
from dpprof.errors import EXIT_SIGINT, EXIT_STATUS_HELP, WATCH_EXIT_STATUS_HELP, Interrupted

app = typer.Typer(
    name="dpprof",
    help="Why does cuda:0 run out of memory under nn.DataParallel, and what should you "
    "change? dpprof runs your training step as paired scenarios and tells you.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    epilog=EXIT_STATUS_HELP,
)
def _version(value: bool) -> None:
    if value:
        out.print(f"dpprof {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """dpprof: a DataParallel load-imbalance profiler for PyTorch."""


app.command("compare", epilog=EXIT_STATUS_HELP)(compare_cmd)
app.command("maxbatch", epilog=EXIT_STATUS_HELP)(maxbatch_cmd)
app.command(
    "watch",
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
    epilog=WATCH_EXIT_STATUS_HELP,
)(watch_cmd)
app.command(
    "run",
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
    epilog=EXIT_STATUS_HELP,
)(run_cmd)
app.command("report", epilog=EXIT_STATUS_HELP)(report_cmd)
app.command("env", epilog=EXIT_STATUS_HELP)(env_cmd)
app.command("check", epilog=EXIT_STATUS_HELP)(check_cmd)


def main() -> None:
    """The ``dpprof`` entry point: SIGTERM unwinds as Ctrl-C does (children ended, temporary
    files removed), and an interrupt outside a command's guard still exits 130/143."""
    install_signal_handlers()
    try:
        app()
    except BrokenPipeError:  # `dpprof ... | head`
        sys.stderr.close()
    except Interrupted as e:
        print(interrupted_line(e.signum), file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print(interrupted_line(signal.SIGINT), file=sys.stderr)
        sys.exit(EXIT_SIGINT)


if __name__ == "__main__":
    main()
