"""The options ``compare`` and ``maxbatch`` share, declared once, and the CI exit check.

    dpprof compare --batch 512 --maxbatch --fail-on-imbalance 1.5 --fail-on-oom
"""

from __future__ import annotations

import typer
from rich.console import Console

from dpprof.emulator.gpus import GpuSpec, known_gpus, lookup_gpu
from dpprof.errors import UsageError
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
    from dpprof.analysis.answers import EXIT_CHECK_FAILED

    for reason in run.fail_reasons:
        err.print(f"dpprof: check failed: {reason}", markup=False, soft_wrap=True)
    if run.fail_reasons:
        raise typer.Exit(code=EXIT_CHECK_FAILED)
