"""``dpprof env``: the environment block for a bug report.

    dpprof env --markdown
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from dpprof.cli.common import out
from dpprof.cli.guard import guarded
from dpprof.environment import collect_environment, environment_markdown, environment_rows


def env_cmd(
    markdown: Annotated[
        bool, typer.Option("--markdown", help="Markdown ready to paste into a GitHub issue.")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    """GPUs, driver, CUDA/NCCL/torch versions, GPU links, CUDA_VISIBLE_DEVICES."""
    from rich.table import Table

    with guarded(debug):
        env = collect_environment()
        if markdown:
            sys.stdout.write(environment_markdown(env))
            return
        table = Table(show_header=False, box=None, pad_edge=False)
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        for label, value in environment_rows(env):
            table.add_row(label, value)
        out.print(table)
