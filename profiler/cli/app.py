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

import importlib
import signal
import sys
from collections.abc import Sequence
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

from dpprof.cli.check import check_cmd
from dpprof.cli.common import err, fit_output_width, out
from dpprof.cli.compare import compare_cmd
from dpprof.cli.env import env_cmd
from dpprof.cli.guard import interrupted_line
from dpprof.cli.maxbatch import maxbatch_cmd
from dpprof.cli.report import report_cmd
from dpprof.cli.run import run_cmd
from dpprof.cli.watch import watch_cmd
from dpprof.errors import (
    CHECK_EXIT_STATUS_HELP,
    ENV_EXIT_STATUS_HELP,
    EXIT_SIGINT,
    EXIT_STATUS_HELP,
    EXIT_USAGE,
    MAXBATCH_EXIT_STATUS_HELP,
    REPORT_EXIT_STATUS_HELP,
    RUN_EXIT_STATUS_HELP,
    WATCH_EXIT_STATUS_HELP,
    Interrupted,
    exit_decided,
    install_stop_handlers,
)
from dpprof.reports.escape import terminal_text
from dpprof.version import __version__

# click's exceptions, from wherever this typer takes click (its own copy, or the package);
# Abort lives in typer itself in typer's own copy of click (0.2x), in click's exceptions before
_click_errors = importlib.import_module(typer.BadParameter.__module__)
_ABORT: type[BaseException] = getattr(typer, "Abort", None) or _click_errors.Abort


def without_flag_types(params: list[Any]) -> list[Any]:
    """``params`` with each flag's type left out of ``--help`` (a flag takes no value: typer
    shows ``<bool>`` for it otherwise)."""
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
    return params


class PlainHelp(TyperCommand):
    """A command whose ``--help`` shows no type for a flag."""

    def get_params(self, ctx: Any) -> list[Any]:
        return without_flag_types(super().get_params(ctx))


class OneLineErrors(TyperGroup):
    """A parse error (unknown option, a value of the wrong type) in dpprof's one-line style,
    as every other error is: ``dpprof: error: ...`` naming the fix, exit status 2; not
    typer's boxed panel."""

    def get_params(self, ctx: Any) -> list[Any]:
        return without_flag_types(super().get_params(ctx))

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             windows_expand_args: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode,
                                windows_expand_args, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, False, windows_expand_args,
                              **extra)
        except _click_errors.ClickException as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # the help was printed
                sys.exit(EXIT_USAGE)
            ctx = getattr(e, "ctx", None)
            where = f" ({ctx.command_path} --help lists the options)" if ctx else ""
            err.print(f"dpprof: error: {terminal_text(e.format_message())}{where}",
                      soft_wrap=True)
            sys.exit(e.exit_code)
        except _ABORT as e:
            if isinstance(e.__cause__, KeyboardInterrupt):  # click's word for a Ctrl-C
                raise KeyboardInterrupt from None
            err.print("dpprof: aborted", soft_wrap=True)
            sys.exit(1)
        # typer returns a command's typer.Exit code, or what the command returned (None)
        sys.exit(rv if isinstance(rv, int) else 0)


# Each command's page, under docs/ in dpprof's repository (pyproject names no site URL);
# ``--help`` ends with it, after the exit statuses.
DOCS_PAGES: dict[str, str] = {
    "compare": "docs/scenarios.md",
    "maxbatch": "docs/maxbatch.md",
    "watch": "docs/watch.md",
    "run": "docs/run.md",
    "report": "docs/reports.md",
    "env": "docs/gpus.md",
    "check": "docs/gpus.md",
}


def epilog(exit_status_help: str, page: str) -> str:
    """A command's ``--help`` epilog: its exit statuses, then the page that says the rest."""
    return f"{exit_status_help}\n\nDocs: {page} in dpprof's repository."


app = typer.Typer(
    cls=OneLineErrors,
    name="dpprof",
    help="Why does cuda:0 run out of memory under nn.DataParallel, and what should you "
    "change? dpprof runs your training step as paired scenarios and tells you.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    epilog=epilog(EXIT_STATUS_HELP, "README.md and docs/"),
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
    fit_output_width()


app.command("compare", cls=PlainHelp,
            epilog=epilog(EXIT_STATUS_HELP, DOCS_PAGES["compare"]))(compare_cmd)
app.command("maxbatch", cls=PlainHelp,
            epilog=epilog(MAXBATCH_EXIT_STATUS_HELP, DOCS_PAGES["maxbatch"]))(maxbatch_cmd)
app.command(
    "watch", cls=PlainHelp,
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
    epilog=epilog(WATCH_EXIT_STATUS_HELP, DOCS_PAGES["watch"]),
)(watch_cmd)
app.command(
    "run", cls=PlainHelp,
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
    epilog=epilog(RUN_EXIT_STATUS_HELP, DOCS_PAGES["run"]),
)(run_cmd)
app.command("report", cls=PlainHelp,
            epilog=epilog(REPORT_EXIT_STATUS_HELP, DOCS_PAGES["report"]))(report_cmd)
app.command("env", cls=PlainHelp, epilog=epilog(ENV_EXIT_STATUS_HELP, DOCS_PAGES["env"]))(env_cmd)
app.command("check", cls=PlainHelp,
            epilog=epilog(CHECK_EXIT_STATUS_HELP, DOCS_PAGES["check"]))(check_cmd)


def main() -> None:
    """The ``dpprof`` entry point: SIGTERM unwinds as Ctrl-C does (children ended, temporary
    files removed), and an interrupt outside a command's guard still exits 130/143."""
    install_stop_handlers()
    try:
        app()
    except BrokenPipeError:  # `dpprof ... | head`
        sys.stderr.close()
    except Interrupted as e:
        print(interrupted_line(e.signum), file=sys.stderr)
        exit_decided(e.exit_code)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print(interrupted_line(signal.SIGINT), file=sys.stderr)
        exit_decided(EXIT_SIGINT)
        sys.exit(EXIT_SIGINT)


if __name__ == "__main__":
    main()
