"""The command line of the answers: ``dpprof maxbatch`` and the options ``compare`` shares.

    dpprof maxbatch --workload lm --gpu a100-80gb --gpus 4 --multiple-of 8
    dpprof compare --batch 512 --maxbatch --fail-on-imbalance 1.5 --fail-on-oom
"""

from __future__ import annotations

import datetime as _dt
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from dpprof.errors import DpprofError, UsageError
from dpprof.gpus import GpuSpec, known_gpus, lookup_gpu
from dpprof.result import RunResult
from dpprof.units import parse_bytes

DEFAULT_MEMORY = "80GiB"

GPU = typer.Option(
    "--gpu", help="A GPU from the catalog (e.g. a100-80gb, h100-80gb, rtx-4090): its memory, "
    "and its context counted. Unknown names list the known ones.")
MAXBATCH = typer.Option(
    "--maxbatch", help="Also find the largest batch each scenario fits (reserved memory and "
    "the CUDA context counted).")
MULTIPLE_OF = typer.Option("--multiple-of", help="Batch granularity of the largest-batch search.")
COUNT_RESERVED = typer.Option(
    "--count-reserved", help="With --compute: count simulated reserved memory and the CUDA "
    "context in the out-of-memory check (meta emulation always counts them).")
FIXES = typer.Option("--fixes/--no-fixes", help="Emulate each fix and what it saves.")
FAIL_ON_IMBALANCE = typer.Option(
    "--fail-on-imbalance", metavar="RATIO",
    help="Exit 3 when a scenario's max/mean peak exceeds RATIO (for CI).")
FAIL_ON_OOM = typer.Option(
    "--fail-on-oom", help="Exit 3 when any scenario runs out of memory (for CI).")


def gpu_memory_and_spec(gpu_memory: str | None, gpu: str) -> tuple[int, GpuSpec | None]:
    """``--gpu-memory`` wins over ``--gpu``'s memory; an unknown GPU lists the known ones."""
    spec = None
    if gpu:
        try:
            spec = lookup_gpu(gpu)
        except KeyError:
            raise UsageError(
                f"--gpu {gpu}: unknown GPU; known GPUs: {', '.join(known_gpus())} (or give "
                "--gpu-memory, e.g. 80GiB)"
            ) from None
    if gpu_memory is None:
        return (spec.total_memory_bytes if spec else parse_bytes(DEFAULT_MEMORY)), spec
    try:
        return parse_bytes(gpu_memory), spec
    except ValueError as e:
        raise UsageError(f"--gpu-memory: {e}") from e


def exit_on_fail_reasons(run: RunResult, err: Console) -> None:
    """Exit 3 with one line per failed --fail-on-* check."""
    from dpprof.answers import EXIT_CHECK_FAILED

    for reason in run.fail_reasons:
        err.print(f"dpprof: check failed: {reason}", markup=False, soft_wrap=True)
    if run.fail_reasons:
        raise typer.Exit(code=EXIT_CHECK_FAILED)


def register(app: typer.Typer) -> None:
    app.command("maxbatch")(maxbatch_cmd)


def maxbatch_cmd(
    workload: Annotated[
        str, typer.Option("--workload", "-w", help="Built-in or module.path:function or "
                          "path/to/file.py:function returning a dpprof.Workload.")
    ] = "lm",
    gpus: Annotated[int, typer.Option("--gpus", "-g", help="GPUs (emulated).")] = 4,
    gpu_memory: Annotated[
        str | None, typer.Option("--gpu-memory", help="Memory of each GPU, e.g. 24GiB.")
    ] = None,
    gpu: Annotated[str, GPU] = "",
    multiple_of: Annotated[int, MULTIPLE_OF] = 1,
    scenarios: Annotated[
        str, typer.Option("--scenarios", "-s", help="Comma-separated scenarios.")
    ] = "dp-loss-primary,dp-loss-forward,ddp,single",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    output: Annotated[
        list[Path] | None,
        typer.Option("--output", "-o", help="Also write the result (.json, .html)."),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only errors.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    """The largest global batch each scenario fits on the given GPUs.

    Bisection over emulated steps (meta tensors: the cost does not grow with the batch),
    counting the caching allocator's reserved memory and the CUDA context, not only the
    allocated bytes. Example: dpprof maxbatch -w lm --gpu a100-80gb --multiple-of 8
    """
    from dpprof import cli as main_cli
    from dpprof.maxbatch import run_maxbatch
    from dpprof.reports.answers import maxbatch_renderable
    from dpprof.runner import environment
    from dpprof.scenarios.workloads import load_workload

    try:
        memory, spec = gpu_memory_and_spec(gpu_memory, gpu)
        if gpus < 1:
            raise UsageError(f"--gpus must be at least 1, got {gpus}")
        if multiple_of < 1:
            raise UsageError(f"--multiple-of must be at least 1, got {multiple_of}")
        names = main_cli._parse_scenarios(scenarios)
        paths = main_cli._output_paths(output, "maxbatch") if output else []
        main_cli._check_writable(paths)
        wl = load_workload(workload)
        if not quiet:
            main_cli.err.print(
                f"dpprof: searching the largest batch of {wl.name} on {gpus} emulated GPUs of "
                f"{main_cli.fmt_bytes(memory)}{f' ({spec.key})' if spec else ''}, multiples "
                f"of {multiple_of}"
            )
        mb = run_maxbatch(wl, names, gpus, memory, gpu=spec, multiple_of=multiple_of,
                          seed=seed)
        run = RunResult(
            backend="emulated", workload=wl.name, batch=0, gpus=gpus, gpu_memory_bytes=memory,
            created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            seed=seed, dtype=str(wl.dtype).removeprefix("torch."),
            config=_config(workload, gpus, memory, spec, multiple_of, names),
            environment=environment("emulated"), maxbatch=mb,
        )
        if not quiet:
            main_cli.out.print(maxbatch_renderable(run))
        if paths:
            main_cli.write_reports(run, paths, quiet)
    except DpprofError as e:
        raise main_cli._fail(e, debug) from None
    except Exception as e:
        if debug:
            raise
        print(f"dpprof: internal error: {type(e).__name__}: {e} (rerun with --debug)",
              file=sys.stderr)
        raise typer.Exit(code=1) from None


def _config(workload: str, gpus: int, memory: int, spec: GpuSpec | None, multiple_of: int,
            names: tuple[str, ...]) -> dict[str, Any]:
    return {"command": "maxbatch", "workload": workload, "gpus": gpus,
            "gpu_memory_bytes": memory, "gpu": spec.key if spec else "",
            "multiple_of": multiple_of, "scenarios": list(names)}
