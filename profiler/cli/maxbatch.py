"""``dpprof maxbatch``: the largest global batch each scenario fits.

    dpprof maxbatch --workload lm --gpu a100-80gb --gpus 4 --multiple-of 8
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from dpprof.answers.answer import settled
from dpprof.cli.common import (
    check_writable,
    err,
    load_user_workload,
    out,
    output_paths,
    parse_scenarios,
    progress_bar,
    write_reports,
)
from dpprof.cli.guard import guarded
from dpprof.cli.options import (
    DEBUG,
    GPU,
    INCLUDE_HOST,
    MULTIPLE_OF,
    PANEL_GPUS,
    PANEL_OUTPUT,
    PANEL_WORKLOAD,
    QUIET,
    check_bounds,
    target_gpu,
)
from dpprof.compare_config import DEFAULT_EMULATED_GPUS, CompareConfig
from dpprof.emulator.catalog import GpuSpec
from dpprof.errors import EXIT_ERROR, UsageError
from dpprof.measure.maxbatch_limits import LADDER_MICRO_BATCHES
from dpprof.reports.answer_sections import maxbatch_renderable
from dpprof.reports.escape import for_terminal, terminal_text
from dpprof.reports.view_builder import build_view
from dpprof.result import RunResult, new_result
from dpprof.scenarios.registry import SCENARIOS
from dpprof.scenarios.step_config import StepConfig
from dpprof.scenarios.workload_names import DEFAULT
from dpprof.units import fmt_bytes

if TYPE_CHECKING:
    from dpprof.measure.maxbatch_search import MaxBatch
    from dpprof.scenarios.workloads import Workload


def maxbatch_cmd(
    workload: Annotated[
        str, typer.Option("--workload", "-w", help="Built-in or module.path:function or "
                          "path/to/file.py:function returning a dpprof.Workload.",
                          rich_help_panel=PANEL_WORKLOAD)
    ] = DEFAULT,
    gpus: Annotated[int, typer.Option("--gpus", "-g", help="GPUs (emulated).",
                                      rich_help_panel=PANEL_GPUS)] = DEFAULT_EMULATED_GPUS,
    gpu_memory: Annotated[
        str | None, typer.Option("--gpu-memory", help="Memory of each GPU, e.g. 24GiB.",
                                 rich_help_panel=PANEL_GPUS)
    ] = None,
    gpu: Annotated[str, GPU] = "",
    multiple_of: Annotated[int, MULTIPLE_OF] = CompareConfig().multiple_of,
    scenarios: Annotated[
        str, typer.Option("--scenarios", "-s", help="Comma-separated scenarios.",
                          rich_help_panel=PANEL_WORKLOAD)
    ] = ",".join(SCENARIOS),
    seed: Annotated[int, typer.Option(
        "--seed", help="Seed shared by every scenario and every batch tried: the weights, "
        "each step's batch, the steps' random draws.", rich_help_panel=PANEL_WORKLOAD)
    ] = StepConfig().seed,
    output: Annotated[
        list[str] | None,  # str: a trailing '/' survives to be refused
        typer.Option("--output", "-o", metavar="FILE",
                     help="Also write the result (.json, .html, .md).",
                     rich_help_panel=PANEL_OUTPUT),
    ] = None,
    ladder: Annotated[bool, typer.Option(
        "--ladder", help="Also the largest batch of each rung of the ladder on ddp (one GPU: "
        "single): bf16 (fp16 below compute capability 8.0) autocast, activation "
        "checkpointing, both, FSDP2 ZeRO-2, ZeRO-3 and ZeRO-3 with its bf16 and checkpointing "
        "(several GPUs), "
        f"{LADDER_MICRO_BATCHES} micro-batches of gradient accumulation.",
        rich_help_panel=PANEL_WORKLOAD)] = False,
    include_host: Annotated[bool, INCLUDE_HOST] = False,
    quiet: Annotated[bool, QUIET] = False,
    debug: Annotated[bool, DEBUG] = False,
) -> None:
    """The largest global batch each scenario fits on the given GPUs.

    Bisection over emulated steps (meta tensors: the cost does not grow with the batch),
    counting the caching allocator's reserved memory and the CUDA context, not only the
    allocated bytes. Example: dpprof maxbatch -w lm --gpu a100-80gb --multiple-of 8
    """
    with guarded(debug):
        target = target_gpu(gpu_memory, gpu)
        memory, spec = target.memory_bytes, (target.spec if target.named else None)
        _check_maxbatch_options(gpus, multiple_of, seed)
        names = parse_scenarios(scenarios)
        paths = output_paths(output, "maxbatch") if output else []
        check_writable(paths)
        wl = load_user_workload(workload)
        if not quiet:
            err.print(
                f"dpprof: searching the largest batch of {terminal_text(wl.name)} on {gpus} "
                "emulated GPUs of "
                f"{fmt_bytes(memory)}{f' ({spec.key})' if spec else ''}, multiples "
                f"of {multiple_of}"
            )
        mb = _search(wl, names, gpus, memory, spec, multiple_of, seed, ladder, quiet)
        run = new_result(
            "emulated", wl.name, batch=0, gpus=gpus, gpu_memory_bytes=memory,
            config=_config(workload, gpus, memory, spec, multiple_of, names) | {
                "ladder": ladder},
            seed=seed, dtype=str(wl.dtype).removeprefix("torch."), maxbatch=mb,
        )
        _show_and_write(run, paths, quiet, include_host)
    _exit_if_errored(mb)


def _check_maxbatch_options(gpus: int, multiple_of: int, seed: int) -> None:
    """One line naming the first option out of its range."""
    if gpus < 1:
        raise UsageError(f"--gpus must be at least 1, got {gpus}")
    if multiple_of < 1:
        raise UsageError(f"--multiple-of must be at least 1, got {multiple_of}")
    check_bounds({"--gpus": gpus, "--multiple-of": multiple_of, "--seed": seed})


def run_maxbatch(*args: Any, **kwargs: Any) -> MaxBatch:
    """:func:`dpprof.measure.maxbatch_search.run_maxbatch`, imported where a search runs:
    torch and the emulator are not loaded for --help or the other commands."""
    from dpprof.measure.maxbatch_search import run_maxbatch as search

    return search(*args, **kwargs)


def _search(wl: Workload, names: tuple[str, ...], gpus: int, memory: int, spec: GpuSpec | None,
            multiple_of: int, seed: int, ladder: bool, quiet: bool) -> MaxBatch:
    """The searches, with a progress bar over them on a terminal unless ``quiet``."""
    if quiet or not err.is_terminal:  # a log gets no progress bar's leftovers
        return run_maxbatch(wl, names, gpus, memory, gpu=spec, multiple_of=multiple_of,
                            step=StepConfig(seed=seed), ladder=ladder)
    # a search takes seconds to minutes: say which scenario it is on
    counter = "{task.completed}/{task.total} " + ("searches" if ladder else "scenarios")
    with progress_bar(counter, err) as bar:
        task = bar.add_task("starting", total=len(names))

        def progress(name: str, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total,
                       description=f"searching {name}")

        return run_maxbatch(wl, names, gpus, memory, gpu=spec, multiple_of=multiple_of,
                            step=StepConfig(seed=seed), progress=progress,
                            ladder=ladder)


def _show_and_write(run: RunResult, paths: list[tuple[Path, str]], quiet: bool,
                    include_host: bool) -> None:
    """The verdict set, the table on the terminal unless ``quiet``, then the files."""
    run = settled(run)
    if not quiet:
        out.print(maxbatch_renderable(build_view(for_terminal(run))))
    if paths:
        write_reports(run, paths, quiet, include_host)


def _exit_if_errored(mb: MaxBatch) -> None:
    errored = [e.scenario for e in mb.entries if e.errored]
    if errored:
        err.print(f"dpprof: {len(errored)} scenario(s) errored: {', '.join(errored)} "
                  "(exit status 1)", markup=False)
        raise typer.Exit(code=EXIT_ERROR)


def _config(workload: str, gpus: int, memory: int, spec: GpuSpec | None, multiple_of: int,
            names: tuple[str, ...]) -> dict[str, Any]:
    return {"command": "maxbatch", "workload": workload, "gpus": gpus,
            "gpu_memory_bytes": memory, "gpu": spec.key if spec else "",
            "multiple_of": multiple_of, "scenarios": list(names)}
