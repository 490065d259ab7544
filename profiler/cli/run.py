"""``dpprof run``: your unmodified training script on virtual GPUs.

    dpprof run -- python train.py --batch-size 256
    dpprof run --gpus 8 --gpu a100-80gb -- python train.py
    dpprof run -- torchrun --nproc-per-node 4 train.py
"""

from __future__ import annotations

import datetime as _dt
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from dpprof.cli.common import (
    check_writable,
    err,
    out,
    output_paths,
    progress_bar,
    shown_path,
    write_reports,
)
from dpprof.cli.guard import guarded
from dpprof.cli.live_output import script_output_above
from dpprof.cli.options import (
    GPU,
    INCLUDE_HOST,
    INTERCONNECT,
    MAX_GPUS,
    PANEL_GPUS,
    PANEL_MEASURE,
    PANEL_OUTPUT,
    QUIET,
    check_bounds,
    target_gpu,
)
from dpprof.emulator.catalog import interconnect_problem
from dpprof.errors import EXIT_ERROR, Interrupted, UsageError, interrupt_signal, take_interrupt
from dpprof.reports import terminal
from dpprof.reports.escape import for_terminal, terminal_text
from dpprof.result import STATUS_ERROR, RunResult
from dpprof.script import namespace
from dpprof.script.rank_spec import RANKS_HELP, check_ranks, default_ranks
from dpprof.units import fmt_bytes

if TYPE_CHECKING:
    from dpprof.script.launch import Launch
    from dpprof.script.session import ScriptConfig, ScriptRun

DEFAULT_GPUS = 4


def run_cmd(
    command: Annotated[
        list[str] | None,
        typer.Argument(help="The training command, after --: dpprof run -- python train.py"),
    ] = None,
    gpus: Annotated[
        int | None,
        typer.Option("--gpus", "-g", help="Virtual GPUs the script sees (before "
                     "CUDA_VISIBLE_DEVICES; default: torchrun's --nproc-per-node, else 4).",
                     rich_help_panel=PANEL_GPUS)
    ] = None,
    gpu_memory: Annotated[
        str | None,
        typer.Option("--gpu-memory", help="Memory of each GPU, e.g. 80GiB, 24G (default: "
                     "--gpu's, else the A100 80GB's 79.25 GiB).", rich_help_panel=PANEL_GPUS),
    ] = None,
    steps: Annotated[
        int, typer.Option("--steps", help="Stop after this many optimizer steps (the first "
                          "is the warm-up).", rich_help_panel=PANEL_MEASURE)
    ] = 3,
    compute: Annotated[
        bool, typer.Option("--compute", help="Emulate over CPU tensors (real numbers: "
                           "data-dependent shapes work; small models only).",
                           rich_help_panel=PANEL_GPUS)
    ] = False,
    alternatives: Annotated[
        bool, typer.Option("--alternatives/--no-alternatives",
                           help="For a DataParallel script, also run it with DDP in place and "
                           "with the loss inside forward.", rich_help_panel=PANEL_MEASURE)
    ] = True,
    ladder: Annotated[
        bool | None, typer.Option(
            "--ladder/--no-ladder", help="When even DDP does not fit: run the script again "
            "with each rung of the ladder applied (mixed precision; activation "
            "checkpointing of the model's repeated blocks; both) on its DDP alternative "
            "(else as written), with each change to the script; the verdict names the "
            "cheapest rung that fits. Default: only when that run is out of memory.",
            rich_help_panel=PANEL_MEASURE, show_default=False)
    ] = None,
    ranks: Annotated[
        str | None, typer.Option("--ranks", help="Under torchrun, accelerate launch, "
                                 "Lightning's launcher or mp.spawn: " + RANKS_HELP,
                                 rich_help_panel=PANEL_MEASURE, show_default=False)
    ] = None,
    output: Annotated[
        list[str] | None,  # str: a trailing '/' survives to be refused
        typer.Option("--output", "-o", metavar="FILE",
                     help="Report file; repeat for several (.html, .json, "
                     ".md). Default: ./dpprof-reports/run-YYYYmmdd-HHMMSS.{html,json}",
                     rich_help_panel=PANEL_OUTPUT),
    ] = None,
    keep_writes: Annotated[
        str | None,
        typer.Option("--keep-writes", metavar="DIR", help="Keep what the script wrote: each "
                     "run writes into a private overlay (never into your files), copied here "
                     "after it, one folder per run (DIR/as-written/...), with writes.txt "
                     "listing them.", rich_help_panel=PANEL_OUTPUT),
    ] = None,
    quiet: Annotated[bool, QUIET] = False,
    include_host: Annotated[bool, INCLUDE_HOST] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show dpprof's tracebacks.",
                                        rich_help_panel=PANEL_OUTPUT)] = False,
    gpu: Annotated[str, GPU] = "",
    interconnect: Annotated[str, INTERCONNECT] = "",
) -> None:
    """Run your training script unchanged on virtual GPUs and report each GPU's memory.

    The script runs in dpprof's process with CUDA played by virtual devices over meta
    tensors, and is stopped after --steps optimizer steps. nn.DataParallel, DDP (under
    torchrun or mp.spawn) and layers placed on cuda:k by hand are measured as they would
    run; a DataParallel script is also run with DDP in place and with the loss inside
    forward. Where even that does not fit the GPU (--gpu, --gpu-memory), the script runs
    again with mixed precision and activation checkpointing applied (the ladder). The
    script's own error ends the run with its traceback and exit status 1.

    Example: dpprof run --gpus 8 -- python train.py --batch-size 256
    """
    # the seal's kernel line: a mount namespace, entered by the console script before torch
    # was imported (dpprof.cli.entry); where the machine refuses it, the seal keeps its
    # Python line and an audit hook
    namespace.enter()

    main = None
    result: RunResult | None = None
    paths: list[tuple[Path, str]] = []

    def write_partial(partial: RunResult, signum: int) -> list[str]:
        # marked partial where it was measured (run_command); only written here
        return [shown_path(p) for p in write_reports(partial, paths, True, include_host)]

    with guarded(debug, on_interrupt=write_partial):
        # the runs' modules (torch, the emulator, the seal): imported by the console script
        # before a command runs (dpprof.cli.entry), here for a caller that did not
        from dpprof.script.session import (
            ScriptConfig,
            interrupted_while_writing,
            parse_command,
        )

        _check_run_options(DEFAULT_GPUS if gpus is None else gpus, steps)
        target = target_gpu(gpu_memory, gpu)
        interconnect = interconnect.strip().lower()
        problem = interconnect_problem(interconnect, target.spec)
        if problem:
            raise UsageError(problem)
        launch = parse_command(list(command or []), DEFAULT_GPUS if gpus is None else gpus,
                               gpus_given=gpus is not None)
        launch.check_script()  # before the announcement: one line, as for any bad input
        gpus = _gpus_for(launch, gpus)
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        paths[:] = output_paths(output, f"run-{stamp}")
        check_writable(paths)
        cfg = ScriptConfig(launch=launch, gpus=gpus, gpu=target.spec,
                           gpu_memory_bytes=target.memory_bytes, steps=steps, compute=compute,
                           debug=debug, ladder=ladder, keep_writes=_keep_dir(keep_writes),
                           ranks=check_ranks(ranks) if ranks is not None
                           else default_ranks(compute), interconnect=interconnect)
        if debug and namespace.why_not():
            err.print(f"dpprof: no mount namespace for the seal: {namespace.why_not()}",
                      markup=False)
        if not quiet:
            _announce(cfg)
        result, main = _run(cfg, alternatives, quiet)
        try:
            measured = _show_and_write(result, main, paths, quiet, include_host)
        except (KeyboardInterrupt, Interrupted) as e:  # the whole result, marked, written
            signum = interrupt_signal(e)
            take_interrupt(signum)
            raise Interrupted(signum, partial=interrupted_while_writing(result, signum),
                              during="the writing of the reports") from None
    _exit_if_seal_broken(result)
    _exit_with_status(main, result if measured else None)


def _keep_dir(given: str | None) -> str | None:
    """--keep-writes DIR: a folder (made where absent), not a file."""
    if given is None:
        return None
    p = Path(given)
    if p.exists() and not p.is_dir():
        raise UsageError(f"--keep-writes {given}: not a folder; give a folder to keep the "
                         "script's writes in")
    return str(p.resolve())


def _exit_if_seal_broken(result: RunResult | None) -> None:
    """A file of the user's that changed while the script ran: said loudly, exit 1."""
    if result is None or result.seal is None or not result.seal.changed:
        return
    err.print(f"dpprof: SEAL BROKEN: {len(result.seal.changed)} file(s) of yours changed "
              "while the script ran (by a writer dpprof could not redirect): "
              + "; ".join(result.seal.changed[:10]), markup=False, highlight=False,
              soft_wrap=True, style="bold red")
    raise typer.Exit(code=EXIT_ERROR)


def _check_run_options(gpus: int, steps: int) -> None:
    """One line naming the first option out of its range."""
    if gpus < 1:
        raise UsageError(f"--gpus must be at least 1, got {gpus}")
    if steps < 1:
        raise UsageError(f"--steps must be at least 1, got {steps}")
    check_bounds({"--gpus": gpus, "--steps": steps})


def _gpus_for(launch: Launch, given: int | None) -> int:
    """The GPUs of the run: torchrun starts one process per GPU, so without --gpus its
    --nproc-per-node (parse_command refuses a --gpus below it)."""
    if given is not None:
        return given
    if launch.nproc is None:
        return DEFAULT_GPUS
    if launch.nproc > MAX_GPUS:
        raise UsageError(f"{launch.launcher} --nproc-per-node {launch.nproc}: at most "
                         f"{MAX_GPUS} processes (GPUs) per node")
    return launch.nproc


def _announce(cfg: ScriptConfig) -> None:
    """dpprof's one line on stderr before the script runs."""
    launch = cfg.launch
    kind = "CPU tensors" if cfg.compute else "meta tensors, memory only"
    world = int(launch.env.get("WORLD_SIZE", "1"))
    ranks = {"none": f"rank 0 of {world} standing for every rank",
             "all": f"all {world} ranks, each its own emulated process",
             "last": f"ranks 0 and {world - 1} of {world}, each its own emulated process"}.get(
                 cfg.ranks, f"ranks 0,{cfg.ranks} of {world}, each its own emulated process")
    how = f"; {launch.launcher} {ranks}" if world > 1 else ""
    from dpprof.script import namespace

    sealed = ("a private overlay (mount namespace)" if namespace.entered()
              else "a private overlay")
    err.print(f"dpprof: running {terminal_text(launch.display)} on {cfg.gpus} virtual "
              f"{cfg.gpu.name} GPUs of {fmt_bytes(cfg.capacity_bytes)} ({kind}){how}; "
              f"stopping after {cfg.steps} optimizer steps; its writes go to {sealed}",
              markup=False)


def _run(cfg: ScriptConfig, alternatives: bool, quiet: bool) -> tuple[RunResult, ScriptRun]:
    """The script as written (and its alternatives), with a progress bar over the steps
    unless ``quiet``."""
    from dpprof.script.session import run_command

    if quiet:
        return run_command(cfg, alternatives)
    with progress_bar("{task.completed}/{task.total} steps", err, redirect=False) as bar, \
            script_output_above(err):
        task = bar.add_task("as written", total=cfg.steps)

        def progress(what: str, done: int, total: int) -> None:
            bar.update(task, completed=done, description=what)

        return run_command(cfg, alternatives, progress)


def _show_and_write(result: RunResult, main: ScriptRun, paths: list[tuple[Path, str]],
                    quiet: bool, include_host: bool = False) -> bool:
    """The script's traceback, then the terminal report and the files, or the one line
    saying nothing reached a GPU; whether anything was measured."""
    if main.script_traceback:  # verbatim, as the script would have printed it
        sys.stderr.write(main.script_traceback.rstrip() + "\n")
    if not any(d.peak_allocated_bytes for s in result.scenarios for d in s.devices):
        # nothing reached a GPU: that is the answer, and there is no report to write
        from dpprof.script.session import nothing_on_a_gpu

        unwritten = ", ".join(terminal_text(shown_path(p)) for p, _ in paths)
        status = "" if main.exit_status else f" (exit status {EXIT_ERROR})"
        err.print(f"dpprof: {nothing_on_a_gpu(main)}; no report written to {unwritten}"
                  f"{status}", markup=False, highlight=False, soft_wrap=True)
        return False
    if not quiet:
        out.print(terminal.render(for_terminal(result)))
    write_reports(result, paths, quiet, include_host)
    return True


def _exit_with_status(main: ScriptRun | None, measured: RunResult | None) -> None:
    """The script's own status when it failed (its error is its result; the reports are
    written), else the exit table's: 1 where nothing was measured (said by
    :func:`_show_and_write`) or the script's figures could not be reported, 0 where the
    script was measured (an alternative that failed is in the report, as its result)."""
    if main is None:
        return
    if main.exit_status:
        raise typer.Exit(code=main.exit_status if main.exit_status > 0 else EXIT_ERROR)
    if measured is None:
        raise typer.Exit(code=EXIT_ERROR)
    if main.scenario.status == STATUS_ERROR:  # the script ran; its figures could not be
        err.print(f"dpprof: {main.scenario.name}: {main.scenario.message} (exit status "
                  f"{EXIT_ERROR})", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(code=EXIT_ERROR)
