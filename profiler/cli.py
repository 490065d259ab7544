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
from dpprof import cli_answers as answer_opts
from dpprof.errors import DpprofError, UsageError
from dpprof.result import ResultFileError, RunResult, load, write_atomic
from dpprof.runner import (
    DEFAULT_EMULATED_GPUS,
    CompareConfig,
    resolve_backend,
)
from dpprof.scenarios.base import SCENARIOS
from dpprof.scenarios.workloads import BUILTINS, DEFAULT
from dpprof.units import fmt_bytes

app = typer.Typer(
    name="dpprof",
    help="Why does cuda:0 run out of memory under nn.DataParallel, and what should you "
    "change? dpprof runs your training step as paired scenarios and tells you.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
err = Console(stderr=True, highlight=False)
# Piped output gets room for a table of 8 GPUs instead of rich's 80 columns.
out = Console(highlight=False, width=None if sys.stdout.isatty() else 140)

FORMATS = {".html": "html", ".json": "json", ".md": "markdown"}
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
    if fmt == "markdown":
        from dpprof.reports import markdown

        return markdown.render(run)
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
        str | None,
        typer.Option("--gpu-memory", help="Memory of each GPU, e.g. 80GiB, 40GB, 24G "
                     "(default: --gpu's, else 80GiB)."),
    ] = None,
    scenarios: Annotated[
        str, typer.Option("--scenarios", "-s", help="Comma-separated scenarios to run.")
    ] = ",".join(SCENARIOS),
    backend: Annotated[
        str,
        typer.Option(
            "--backend",
            help="auto (cuda with at least two visible GPUs, else emulated), emulated, "
            "cpu (real computation: DP on virtual devices over CPU tensors, ddp as gloo "
            "processes) or cuda (real GPUs).",
        ),
    ] = "auto",
    devices: Annotated[
        str | None,
        typer.Option("--devices", help="cuda: exactly these CUDA indices, e.g. 2,3."),
    ] = None,
    warmup: Annotated[
        int | None,
        typer.Option("--warmup", help="Warm-up steps before measuring (cuda default 3)."),
    ] = None,
    steps: Annotated[
        int | None, typer.Option("--steps", help="Measured steps (cuda default 10).")
    ] = None,
    nvml_interval: Annotated[
        float, typer.Option("--nvml-interval", help="cuda: NVML sampling period in seconds.")
    ] = 0.02,
    ddp_timeout: Annotated[
        float,
        typer.Option("--ddp-timeout", help="cuda: collective timeout of the ddp ranks (s)."),
    ] = 300.0,
    cpu_test_mode: Annotated[
        bool,
        typer.Option("--cpu-test-mode", hidden=True,
                     help="Run the cuda backend's code on CPU tensors with gloo (tests)."),
    ] = False,
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
        str | None,
        typer.Option("--compute-capability", help="The target GPU's compute capability "
                     "(8.0 A100, 9.0 H100, 7.5 T4, or a catalog name such as h100-80gb): "
                     "cuBLAS workspace size and which attention kernel runs. Default: the "
                     "--gpu's, else 8.0."),
    ] = None,
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
            help="Report file; repeat for several. The suffix picks the format (.html, .json, "
            ".md for a GitHub issue). "
            "Default: both, in ./dpprof-reports/compare-YYYYmmdd-HHMMSS.*",
        ),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only errors.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
    gpu: Annotated[str, answer_opts.GPU] = "",
    maxbatch: Annotated[bool, answer_opts.MAXBATCH] = False,
    multiple_of: Annotated[int, answer_opts.MULTIPLE_OF] = 1,
    count_reserved: Annotated[bool, answer_opts.COUNT_RESERVED] = False,
    fixes: Annotated[bool, answer_opts.FIXES] = True,
    fail_on_imbalance: Annotated[float | None, answer_opts.FAIL_ON_IMBALANCE] = None,
    fail_on_oom: Annotated[bool, answer_opts.FAIL_ON_OOM] = False,
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
        memory, spec = answer_opts.gpu_memory_and_spec(gpu_memory, gpu)
        from dpprof.ddp_launch import torchrun_info

        rank = torchrun_info()
        if rank is not None and rank.rank != 0:
            quiet = True  # only rank 0 speaks and writes reports
        from dpprof.gpus import _cc_of

        try:
            # --gpu NAME sets the target generation unless --compute-capability says otherwise
            cc = _cc_of(spec if spec is not None and compute_capability is None
                        else compute_capability or "8.0")
        except (KeyError, ValueError) as e:
            raise UsageError(f"--compute-capability {compute_capability!r}: {e}") from e
        cfg = CompareConfig(
            compute_capability=cc,
            workload=workload, batch=batch, gpus=gpus, gpu_memory_bytes=memory,
            scenarios=_parse_scenarios(scenarios), backend=backend, seed=seed,
            compute=compute, debug=debug, devices=_parse_devices(devices), warmup=warmup,
            steps=steps, nvml_interval_s=nvml_interval, ddp_timeout_s=ddp_timeout,
            device_kind="cpu" if cpu_test_mode else "cuda",
            fixes=fixes, maxbatch=maxbatch,
            multiple_of=multiple_of, gpu=spec.key if spec else "",
            count_reserved=count_reserved, fail_on_imbalance=fail_on_imbalance,
            fail_on_oom=fail_on_oom,
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
            find_unused_parameters=find_unused_parameters,
            broadcast_buffers=not no_broadcast_buffers, dtype=dtype, amp=amp,
        )
        cfg.validate()
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        paths = _output_paths(output, f"compare-{stamp}")
        _check_writable(paths)
        resolved = resolve_backend(cfg.backend, cfg.device_kind)
        from dpprof.scenarios.workloads import load_workload

        wl = load_workload(cfg.workload)
        n = cfg.gpus or DEFAULT_EMULATED_GPUS
        if resolved == "cpu" and not quiet:
            err.print(
                f"dpprof: --backend cpu: {n} simulated GPUs on the CPU (ddp: {n} gloo "
                f"processes); workload {wl.name}, batch {batch}"
            )
        if resolved == "emulated" and not quiet:
            from dpprof.runner import visible_cuda_gpus

            found = visible_cuda_gpus()
            why = ("--backend emulated" if cfg.backend != "auto" else "no CUDA GPUs found"
                   if found == 0 else f"{found} CUDA GPU found (the comparison needs 2)")
            kind = "CPU tensors" if compute else "meta tensors, memory only"
            err.print(
                f"dpprof: {why}: emulating {n} devices of {fmt_bytes(memory)} "
                f"({kind}); workload {wl.name}, batch {batch}"
            )
        if resolved == "cuda" and not quiet:
            where = f"torchrun rank 0 of {rank.world_size}" if rank else (
                f"CUDA devices {','.join(map(str, cfg.devices))}" if cfg.devices
                else f"{cfg.gpus or 'every visible'} CUDA GPU(s)"
            )
            mode = " (test mode: CPU tensors, gloo)" if cpu_test_mode else ""
            err.print(
                f"dpprof: measuring on {where}{mode}; workload {wl.name}, batch {batch}, "
                f"{cfg.warmup if cfg.warmup is not None else 3} warm-up + "
                f"{cfg.steps or 10} measured steps"
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
        if run is None:  # a torchrun rank other than 0: rank 0 writes the report
            return
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
    answer_opts.exit_on_fail_reasons(run, err)


def _parse_devices(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        found = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        found = ()
    if not found or any(d < 0 for d in found):
        raise UsageError(f"--devices {text!r}: give CUDA indices separated by commas, e.g. 2,3")
    return found


@app.command("env")
def env_cmd(
    markdown: Annotated[
        bool, typer.Option("--markdown", help="Markdown ready to paste into a GitHub issue.")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    """GPUs, driver, CUDA/NCCL/torch versions, GPU links, CUDA_VISIBLE_DEVICES."""
    from rich.table import Table

    from dpprof.env import collect_environment, environment_markdown, environment_rows

    try:
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
    except Exception as e:
        raise _fail(e, debug) from None


def _load_any(path: Path) -> RunResult:
    """A saved result, or a `dpprof watch` samples file (maybe cut short)."""
    if path.suffix == ".jsonl":
        from dpprof.watch import load_run

        return load_run(path)
    return load(path)


@app.command("report")
def report_cmd(
    results: Annotated[
        list[Path],
        typer.Argument(
            help="A result saved by dpprof (JSON); give two (before.json after.json) to "
            "compare them.",
            show_default=False,
        ),
    ],
    output: Annotated[
        list[Path] | None,
        typer.Option(
            "--output", "-o",
            help="Write these files instead of printing; the suffix picks the format (.html, "
            ".md, and .json for a single result).",
        ),
    ] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    """Re-render a saved result without running anything, or compare two.

    Example: dpprof report run.json -o run.md; dpprof report before.json after.json
    """
    from dpprof.reports import terminal

    try:
        if len(results) > 2:
            raise UsageError(
                f"report takes one result, or two to compare (before after); got {len(results)}"
            )
        paths = _output_paths(output, "report") if output else []
        runs = [_load_any(r) for r in results]
        if len(runs) == 1:
            if not paths:
                out.print(terminal.render(runs[0]))
                return
            _check_writable(paths)
            write_reports(runs[0], paths, quiet=False)
            return
        from dpprof.reports import diff

        rd = diff.diff(runs[0], runs[1])
        if not paths:
            out.print(diff.render_terminal(rd))
            return
        renderers = {"html": diff.render_html, "markdown": diff.render_markdown}
        for p, fmt in paths:
            if fmt not in renderers:
                raise UsageError(
                    f"--output {p}: a comparison of two results is written as .html or .md"
                )
        _check_writable(paths)
        for p, fmt in paths:
            try:
                write_atomic(p, renderers[fmt](rd))
            except OSError as e:
                raise DpprofError(f"could not write {p}: {e.strerror or e}") from e
            out.print(f"wrote {p}")
    except ResultFileError as e:
        raise _fail(DpprofError(str(e)), debug) from None
    except DpprofError as e:
        raise _fail(e, debug) from None


from dpprof.watch_cli import register as _register_watch  # noqa: E402

_register_watch(app)
answer_opts.register(app)


def main() -> None:
    try:
        app()
    except BrokenPipeError:  # `dpprof ... | head`
        sys.stderr.close()


if __name__ == "__main__":
    main()
