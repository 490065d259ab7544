"""The ``dpprof`` command line.

    dpprof compare --batch 512
    dpprof compare --workload my_pkg.train:workload --gpus 8 --gpu-memory 40GB
    dpprof report run.json -o run.html
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from dpprof import __version__
from dpprof.errors import DpprofError, UsageError
from dpprof.result import ResultFileError, RunResult, load, write_atomic
from dpprof.runner import (
    DEFAULT_EMULATED_GPUS,
    CompareConfig,
    resolve_backend,
)
from dpprof.scenarios.base import SCENARIOS
from dpprof.scenarios.workloads import BUILTINS, DEFAULT
from dpprof.units import fmt_bytes, parse_bytes

app = typer.Typer(
    name="dpprof",
    help="Why does cuda:0 run out of memory under nn.DataParallel, and what should you "
    "change? dpprof runs your training step as paired scenarios and tells you.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
err = Console(stderr=True, highlight=False)
# Piped output gets room for a table of 8 GPUs instead of rich's 80 columns.
out = Console(highlight=False, width=None if sys.stdout.isatty() else 140)

FORMATS = {".html": "html", ".json": "json"}
DEFAULT_DIR = Path("dpprof-reports")


def _fail(e: Exception, debug: bool) -> typer.Exit:
    if debug:
        err.print(traceback.format_exc(), markup=False)
    code = e.exit_code if isinstance(e, DpprofError) else 1
    err.print(f"dpprof: error: {e}", markup=False, soft_wrap=True)
    return typer.Exit(code=code)


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


def _output_paths(outputs: list[Path] | None, stem: str) -> list[tuple[Path, str]]:
    if not outputs:
        return [(DEFAULT_DIR / f"{stem}.html", "html"), (DEFAULT_DIR / f"{stem}.json", "json")]
    result = []
    for p in outputs:
        fmt = FORMATS.get(p.suffix.lower())
        if fmt is None:
            raise UsageError(
                f"--output {p}: unknown format {p.suffix or '(no suffix)'}; end the path "
                f"with one of {', '.join(FORMATS)}"
            )
        result.append((p, fmt))
    return result


def _check_writable(paths: list[tuple[Path, str]]) -> None:
    """Fail before measuring, not after, when a report cannot be written."""
    for p, _ in paths:
        parent = p.parent if str(p.parent) else Path(".")
        if p.is_dir():
            raise UsageError(f"--output {p} is a directory; give a file name such as {p}/run.html")
        try:
            parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".dpprof-check-", dir=parent)
            os.close(fd)
            os.unlink(tmp)
        except OSError as e:
            raise UsageError(
                f"cannot write reports to {parent}/ ({e.strerror or e}); choose another "
                "place with -o/--output"
            ) from e


def render_to(run: RunResult, fmt: str) -> str:
    if fmt == "html":
        from dpprof.reports import html

        return html.render(run)
    from dpprof.reports import json as json_report

    return json_report.render(run)


def write_reports(run: RunResult, paths: list[tuple[Path, str]], quiet: bool) -> list[Path]:
    written = []
    failures = []
    for p, fmt in paths:
        try:
            written.append(write_atomic(p, render_to(run, fmt)))
        except OSError as e:
            failures.append(f"{p}: {e.strerror or e}")
    for w in written:
        if not quiet:
            out.print(f"wrote {w}")
    if failures:
        raise DpprofError("could not write " + "; ".join(failures))
    return written


def _parse_scenarios(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown or not names:
        raise UsageError(
            f"--scenarios {text!r}: unknown {', '.join(unknown) or '(empty)'}; "
            f"choose from {', '.join(SCENARIOS)} (comma-separated)"
        )
    return names


@app.command("compare")
def compare_cmd(
    batch: Annotated[
        int, typer.Option("--batch", "-b", help="Global batch size (rows), split over the GPUs.")
    ] = 512,
    workload: Annotated[
        str,
        typer.Option(
            "--workload", "-w",
            help=f"Built-in ({', '.join(BUILTINS)}) or your own: module.path:function or "
            "path/to/file.py:function returning a dpprof.Workload.",
        ),
    ] = DEFAULT,
    gpus: Annotated[
        int | None,
        typer.Option(
            "--gpus", "-g", help=f"GPUs to use (emulated default {DEFAULT_EMULATED_GPUS})."
        ),
    ] = None,
    gpu_memory: Annotated[
        str, typer.Option("--gpu-memory", help="Memory of each GPU, e.g. 80GiB, 40GB, 24G.")
    ] = "80GiB",
    scenarios: Annotated[
        str, typer.Option("--scenarios", "-s", help="Comma-separated scenarios to run.")
    ] = ",".join(SCENARIOS),
    backend: Annotated[
        str,
        typer.Option(
            "--backend",
            help="auto (emulated without at least two GPUs), emulated, or cpu (real "
            "computation: DP on virtual devices over CPU tensors, ddp as gloo processes).",
        ),
    ] = "auto",
    compute: Annotated[
        bool,
        typer.Option(
            "--compute", help="Emulate over CPU tensors (real numbers; small workloads only)."
        ),
    ] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seed shared by every scenario.")] = 0,
    bucket_cap_mb: Annotated[
        float | None,
        typer.Option("--bucket-cap-mb", help="DDP gradient bucket cap in MiB (torch: 25; "
                     "unset also makes the first bucket 1 MiB)."),
    ] = None,
    gradient_as_bucket_view: Annotated[
        bool, typer.Option("--gradient-as-bucket-view",
                           help="DDP: .grad as views of the reducer's buckets.")
    ] = False,
    find_unused_parameters: Annotated[
        bool, typer.Option("--find-unused-parameters",
                           help="DDP: search for unused parameters (clones the outputs).")
    ] = False,
    compute_capability: Annotated[
        str,
        typer.Option("--compute-capability", help="The target GPU's compute capability "
                     "(8.0 A100, 9.0 H100, 7.5 T4, or a catalog name such as h100-80gb): "
                     "cuBLAS workspace size and which attention kernel runs."),
    ] = "8.0",
    dtype: Annotated[
        str | None,
        typer.Option("--dtype", help="float32, bfloat16 or float16: train the workload in "
                     "that dtype (pure low precision)."),
    ] = None,
    amp: Annotated[
        str | None,
        typer.Option("--amp", help="bfloat16 or float16: forward and loss under autocast "
                     "(float32 master weights)."),
    ] = None,
    no_broadcast_buffers: Annotated[
        bool, typer.Option("--no-broadcast-buffers",
                           help="DDP: broadcast_buffers=False (no buffer sync per forward).")
    ] = False,
    output: Annotated[
        list[Path] | None,
        typer.Option(
            "--output", "-o",
            help="Report file; repeat for several. The suffix picks the format (.html, .json). "
            "Default: both, in ./dpprof-reports/compare-YYYYmmdd-HHMMSS.*",
        ),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only errors.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    """Run your training step as paired scenarios and compare every GPU's peak memory.

    The scenarios: dp-loss-primary (nn.DataParallel, loss on cuda:0), dp-loss-forward
    (the loss inside forward, on every replica), ddp (DistributedDataParallel) and single
    (one GPU with batch ceil(B/N)). Without at least two GPUs, dpprof emulates them.

    Example: dpprof compare --batch 512 --gpus 8 --gpu-memory 40GB
    """
    from dpprof.reports import terminal
    from dpprof.runner import run_compare

    try:
        try:
            memory = parse_bytes(gpu_memory)
        except ValueError as e:
            raise UsageError(f"--gpu-memory: {e}") from e
        from dpprof.gpus import _cc_of

        try:
            cc = _cc_of(compute_capability)
        except (KeyError, ValueError) as e:
            raise UsageError(f"--compute-capability {compute_capability!r}: {e}") from e
        cfg = CompareConfig(
            compute_capability=cc,
            workload=workload, batch=batch, gpus=gpus, gpu_memory_bytes=memory,
            scenarios=_parse_scenarios(scenarios), backend=backend, seed=seed,
            compute=compute, debug=debug, bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
            find_unused_parameters=find_unused_parameters,
            broadcast_buffers=not no_broadcast_buffers, dtype=dtype, amp=amp,
        )
        cfg.validate()
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        paths = _output_paths(output, f"compare-{stamp}")
        _check_writable(paths)
        resolved = resolve_backend(cfg.backend)
        from dpprof.scenarios.workloads import load_workload

        wl = load_workload(cfg.workload)
        n = cfg.gpus or DEFAULT_EMULATED_GPUS
        if resolved == "cpu" and not quiet:
            err.print(
                f"dpprof: --backend cpu: {n} simulated GPUs on the CPU (ddp: {n} gloo "
                f"processes); workload {wl.name}, batch {batch}"
            )
        if resolved == "emulated" and not quiet:
            why = "no CUDA GPUs found" if cfg.backend == "auto" else "--backend emulated"
            kind = "CPU tensors" if compute else "meta tensors, memory only"
            err.print(
                f"dpprof: {why}: emulating {n} devices of {fmt_bytes(memory)} "
                f"({kind}); workload {wl.name}, batch {batch}"
            )
        if quiet:
            run = run_compare(cfg, workload=wl)
        else:
            with Progress(
                SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                console=err, transient=True,
            ) as bar:
                task = bar.add_task("starting", total=len(cfg.scenarios))

                def progress(name: str, i: int, total: int) -> None:
                    desc = f"running {name}" if name else "analysing"
                    bar.update(task, completed=i, description=desc)

                run = run_compare(cfg, progress=progress, workload=wl)
        if not quiet:
            out.print(terminal.render(run))
        write_reports(run, paths, quiet)
    except (DpprofError, OSError) as e:
        raise _fail(e, debug) from None
    except KeyboardInterrupt:
        err.print("dpprof: interrupted")
        raise typer.Exit(code=130) from None
    except Exception as e:  # a bug in dpprof: say so, in one line unless --debug
        if debug:
            raise
        err.print(f"dpprof: internal error: {type(e).__name__}: {e} (rerun with --debug)")
        raise typer.Exit(code=1) from None


@app.command("report")
def report_cmd(
    result: Annotated[Path, typer.Argument(help="A result saved by dpprof (JSON).")],
    output: Annotated[
        list[Path] | None,
        typer.Option(
            "--output", "-o", help="Write these files (.html, .json) instead of printing."
        ),
    ] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    """Re-render a saved result without running anything."""
    from dpprof.reports import terminal

    try:
        run = load(result)
        if not output:
            out.print(terminal.render(run))
            return
        write_reports(run, _output_paths(output, "report"), quiet=False)
    except ResultFileError as e:
        raise _fail(DpprofError(str(e)), debug) from None
    except DpprofError as e:
        raise _fail(e, debug) from None


def main() -> None:
    try:
        app()
    except BrokenPipeError:  # `dpprof ... | head`
        sys.stderr.close()


if __name__ == "__main__":
    main()
