"""``dpprof watch``: an NVML timeline of any command on real GPUs.

    dpprof watch -- python train.py --lr 3e-4
    dpprof watch --interval 0.05 --gpus 0,1 -o run.html -- torchrun --nproc-per-node 2 train.py
    dpprof watch --load dpprof-reports/watch-20261122-001500.samples.jsonl -o run.html

dpprof prints one line on stderr before the command starts and one after it ends; everything
else on the terminal is the command's. See :mod:`dpprof.watch.monitor` for the semantics.
"""

from __future__ import annotations

import datetime as _dt
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from dpprof.cli.common import check_writable, err, output_paths, write_reports
from dpprof.cli.options import check_bounds
from dpprof.errors import DpprofError, UsageError
from dpprof.nvml import libnvml
from dpprof.reports.escape import terminal_text
from dpprof.result import RunResult
from dpprof.saved_result import ResultFileError
from dpprof.units import fmt_bytes
from dpprof.watch.analysis import load_run
from dpprof.watch.monitor import SpawnError, WatchConfig, Watcher, select_devices

if TYPE_CHECKING:
    from dpprof.watch.monitor import WatchOutcome

__all__ = ["watch_cmd"]

def _samples_path(outputs: list[tuple[Path, str]]) -> Path:
    first = outputs[0][0]
    return first.with_name(first.stem + ".samples.jsonl")


def _summary(run: RunResult, written: list[Path], samples: Path) -> str:
    """dpprof's one line after the command."""
    w = run.watch
    assert w is not None
    if w.ooms:
        o = w.ooms[0]
        where = f" on cuda:{o.cuda_index}" if o.cuda_index is not None else ""
        head = f"CUDA out of memory{where}"
    elif w.signal:
        head = f"command killed by {w.signal}"
    else:
        head = f"command exited with status {w.returncode}"
    peaks = ", ".join(
        f"cuda:{d.cuda_index} {fmt_bytes(d.peak_used_bytes)}"
        for d in w.devices if d.peak_used_bytes is not None
    )
    c = next(iter(run.comparison.scenarios.values()), None)
    imbalance = f" (max/mean {c.imbalance:.2f})" if c and len(w.devices) > 1 else ""
    where_to = str(written[0]) if written else str(samples)
    what = "post-mortem" if w.ooms else "report"
    return (f"dpprof: {head}; peak {peaks or 'n/a'}{imbalance}; {what}: "
            f"{terminal_text(where_to)}")


def watch_cmd(
    command: Annotated[
        list[str] | None,
        typer.Argument(help="The command to run, after --: dpprof watch -- python train.py"),
    ] = None,
    interval: Annotated[
        float, typer.Option("--interval", "-i", help="Seconds between two NVML readings.")
    ] = 0.1,
    output: Annotated[
        list[str] | None,  # str: a trailing '/' survives to be refused
        typer.Option(
            "--output", "-o", metavar="FILE",
            help="Report file; repeat for several (.html, .json). The samples are written "
            "next to the first, as NAME.samples.jsonl. Default: "
            "./dpprof-reports/watch-YYYYmmdd-HHMMSS.{html,json}",
        ),
    ] = None,
    gpus: Annotated[
        str | None,
        typer.Option(
            "--gpus", "-g", help="CUDA indices to watch, e.g. 0,2 (default: every GPU the "
            "command can see)."
        ),
    ] = None,
    kill_after: Annotated[
        float,
        typer.Option(
            "--kill-after",
            help="After a signal is passed on, seconds until dpprof escalates to SIGTERM, "
            "then to SIGKILL (a second Ctrl-C escalates at once).",
        ),
    ] = 10.0,
    load: Annotated[
        Path | None,
        typer.Option(
            "--load", help="Do not run anything: turn a samples file (complete or cut "
            "short) into reports."
        ),
    ] = None,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Print nothing of dpprof's own but errors.")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    """Run a command, sample every GPU it uses through NVML, and explain an OOM.

    The command's stdin, stdout, stderr and exit status pass through; dpprof adds one line
    before and one after, on stderr. A per-GPU memory timeline, the peak per GPU and the
    imbalance are written as reports, and, when the output held a CUDA out-of-memory error,
    a post-mortem: which GPU, how much was asked for, how full each GPU was, what to run next.

    Example: dpprof watch -- python train.py --batch-size 256
    """
    try:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        paths = output_paths(output, f"watch-{stamp}")
        if load is not None:
            _report_loaded(load, command, paths, quiet)
            return
        _check_watch_options(command, interval, kill_after)
        outcome = _watch(list(command or []), paths, interval, kill_after, gpus, quiet)
    except KeyboardInterrupt:  # before the command started
        err.print("dpprof: interrupted")
        raise typer.Exit(code=130) from None
    except SpawnError as e:
        err.print(f"dpprof: {e}", markup=False, soft_wrap=True)
        raise typer.Exit(code=e.exit_code) from None
    except ResultFileError as e:
        err.print(f"dpprof: error: {e}", markup=False, soft_wrap=True)
        raise typer.Exit(code=1) from None
    except DpprofError as e:
        err.print(f"dpprof: error: {e}", markup=False, soft_wrap=True)
        raise typer.Exit(code=e.exit_code) from None
    # The command ran: from here on dpprof exits with the command's status, whatever happens
    # to the reports (the samples file stays for `dpprof report`).
    _write_watch_reports(outcome, paths, quiet, debug)
    sys.stdout.flush()
    raise typer.Exit(code=outcome.exit_status)


def _report_loaded(load: Path, command: list[str] | None, paths: list[tuple[Path, str]],
                   quiet: bool) -> None:
    """``--load``: the reports of a samples file already written; nothing runs."""
    if command:
        raise UsageError("--load runs nothing: give either --load FILE or -- CMD")
    run = load_run(load)
    check_writable(paths)
    written = write_reports(run, paths, quiet=True)
    if not quiet:
        err.print(_summary(run, written, load), markup=False, soft_wrap=True)


def _check_watch_options(command: list[str] | None, interval: float, kill_after: float) -> None:
    """One line naming the first option out of its range, before anything runs."""
    if not command:
        raise UsageError("no command given: dpprof watch -- python train.py")
    if not interval > 0:
        raise UsageError(f"--interval {interval}: give a positive number of seconds")
    if not kill_after >= 0:
        raise UsageError(f"--kill-after {kill_after}: give seconds, 0 or more")
    check_bounds({"--interval": interval, "--kill-after": kill_after})


def _watch(command: list[str], paths: list[tuple[Path, str]], interval: float,
           kill_after: float, gpus: str | None, quiet: bool) -> WatchOutcome:
    """The command run under NVML's sampling, once NVML answers and the reports' place is
    writable."""
    nvml = libnvml.default_nvml()
    status = nvml.status()
    if not status.available:
        hint = f"; {status.hint}" if status.hint else ""
        raise UsageError(
            f"cannot watch GPUs: NVML is not available ({status.reason}){hint}; "
            "the command was not run"
        )
    devices, notes = select_devices(nvml, gpus)
    check_writable(paths)
    samples = _samples_path(paths)
    cfg = WatchConfig(
        command=command, samples_path=samples, interval_s=interval,
        kill_after_s=kill_after, gpus=gpus,
    )
    if not quiet:
        names = ", ".join(f"cuda:{d.cuda_index}" for d in devices)
        err.print(
            f"dpprof: watching {names} every {interval:g} s; samples: {samples}",
            markup=False, soft_wrap=True,
        )
    return Watcher(cfg, nvml, devices, notes=notes).run()


def _write_watch_reports(outcome: WatchOutcome, paths: list[tuple[Path, str]], quiet: bool,
                         debug: bool) -> None:
    """The reports of a command that ran, and dpprof's line after it; a failure here is
    told in one line and never changes the command's exit status."""
    try:
        if outcome.run is None:
            raise DpprofError("; ".join(outcome.notes) or "no result")
        written = write_reports(outcome.run, paths, quiet=True)
        if not quiet:
            err.print(
                _summary(outcome.run, written, outcome.samples_path), markup=False,
                soft_wrap=True,
            )
    except (DpprofError, OSError) as e:
        err.print(
            f"dpprof: could not write the reports ({e}); the samples are in "
            f"{outcome.samples_path} (dpprof report {outcome.samples_path} -o run.html)",
            markup=False, soft_wrap=True,
        )
    except Exception as e:
        if debug:
            raise
        err.print(
            f"dpprof: internal error while reporting: {type(e).__name__}: {e}; the samples "
            f"are in {outcome.samples_path} (rerun dpprof report with --debug)",
            markup=False, soft_wrap=True,
        )
