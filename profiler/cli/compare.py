"""``dpprof compare``: the user's training step as paired scenarios, every GPU measured.

    dpprof compare --batch 512
    dpprof compare --workload my_pkg.train:workload --gpus 8 --gpu-memory 40GB
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from dpprof.cli.common import (
    check_writable,
    err,
    load_user_workload,
    out,
    output_paths,
    parse_scenarios,
    progress_bar,
    shown_path,
    write_reports,
)
from dpprof.cli.guard import exit_for_run, guarded
from dpprof.cli.options import (
    COUNT_RESERVED,
    DEBUG,
    FAIL_ON_IMBALANCE,
    FAIL_ON_OOM,
    FIXES,
    GPU,
    INCLUDE_HOST,
    INTERCONNECT,
    LADDER,
    MAXBATCH,
    MULTIPLE_OF,
    PANEL_DDP,
    PANEL_GPUS,
    PANEL_MEASURE,
    PANEL_OUTPUT,
    PANEL_WORKLOAD,
    QUIET,
    check_bounds,
    exit_on_fail_reasons,
    target_gpu,
)
from dpprof.compare_config import DEFAULT_EMULATED_GPUS, CompareConfig
from dpprof.errors import UsageError
from dpprof.reports import terminal
from dpprof.reports.escape import for_terminal, terminal_text
from dpprof.result import RunResult
from dpprof.scenarios.step_config import (
    DEFAULT_MEASURED_STEPS,
    DEFAULT_WARMUP_STEPS,
    DdpOptions,
    StepConfig,
)
from dpprof.scenarios.workload_names import BUILTIN_WORKLOADS
from dpprof.units import fmt_bytes

if TYPE_CHECKING:
    from dpprof.backends.cuda_ddp import RankInfo
    from dpprof.emulator.catalog import TargetGpu
    from dpprof.scenarios.workloads import Workload

# Every default below is read from the one declaration of each option: the step's options
# from StepConfig, the rest from CompareConfig (tests/test_config.py checks each one).
STEP = StepConfig()
CONFIG = CompareConfig()

def compare_cmd(
    batch: Annotated[
        int, typer.Option("--batch", "-b", help="Global batch size (rows), split over the GPUs.",
            rich_help_panel=PANEL_WORKLOAD)
    ] = STEP.batch,
    workload: Annotated[
        str,
        typer.Option(
            "--workload", "-w",
            help=f"Built-in ({', '.join(BUILTIN_WORKLOADS)}) or your own: module.path:function or "
            "path/to/file.py:function returning a dpprof.Workload.",
            rich_help_panel=PANEL_WORKLOAD),
    ] = CONFIG.workload,
    gpus: Annotated[
        int | None,
        typer.Option(
            "--gpus", "-g", help=f"GPUs to use (emulated default {DEFAULT_EMULATED_GPUS}).",
                rich_help_panel=PANEL_GPUS),
    ] = CONFIG.gpus,
    gpu_memory: Annotated[
        str | None,
        typer.Option("--gpu-memory", help="Memory of each GPU, e.g. 80GiB, 40GB, 24G "
                     "(default: --gpu's, else the A100 80GB's 79.25 GiB).",
                     rich_help_panel=PANEL_GPUS),
    ] = None,
    scenarios: Annotated[
        str, typer.Option("--scenarios", "-s", help="Comma-separated scenarios to run.",
            rich_help_panel=PANEL_WORKLOAD)
    ] = ",".join(CONFIG.scenarios),
    backend: Annotated[
        str,
        typer.Option(
            "--backend",
            help="auto (cuda with at least two visible GPUs, else emulated), emulated, "
            "cpu (real computation: DP on virtual devices over CPU tensors, ddp as gloo "
            "processes) or cuda (real GPUs).",
            rich_help_panel=PANEL_GPUS),
    ] = CONFIG.backend,
    devices: Annotated[
        str | None,
        typer.Option("--devices", help="cuda: exactly these CUDA indices, e.g. 2,3.",
            rich_help_panel=PANEL_GPUS),
    ] = None,
    warmup: Annotated[
        int | None,
        typer.Option("--warmup", help="Warm-up steps before measuring (default "
                     f"{DEFAULT_WARMUP_STEPS['emulated']}, cuda "
                     f"{DEFAULT_WARMUP_STEPS['cuda']}).", rich_help_panel=PANEL_MEASURE),
    ] = STEP.warmup,
    steps: Annotated[
        int | None, typer.Option("--steps", help="Measured steps (cuda default "
                                 f"{DEFAULT_MEASURED_STEPS['cuda']}).",
                                     rich_help_panel=PANEL_MEASURE)
    ] = STEP.steps,
    nvml_interval: Annotated[
        float, typer.Option("--nvml-interval", help="cuda: NVML sampling period in seconds.",
            rich_help_panel=PANEL_MEASURE)
    ] = CONFIG.nvml_interval_s,
    ddp_timeout: Annotated[
        float,
        typer.Option("--ddp-timeout", help="cpu and cuda: the ddp ranks' collective timeout "
                     "and the bound on every wait for a rank (s); a hung rank is named "
                     "after it.", rich_help_panel=PANEL_DDP),
    ] = CONFIG.ddp_timeout_s,
    compute: Annotated[
        bool,
        typer.Option(
            "--compute", help="Emulate over CPU tensors (real numbers; small workloads only).",
                rich_help_panel=PANEL_GPUS),
    ] = CONFIG.compute,
    seed: Annotated[int, typer.Option(
        "--seed", help="Seed shared by every scenario: the weights, each step's batch, "
        "the steps' random draws.", rich_help_panel=PANEL_WORKLOAD)] = STEP.seed,
    bucket_cap_mb: Annotated[
        float | None,
        typer.Option("--bucket-cap-mb", help="DDP gradient bucket cap in MiB (torch: 25; "
                     "unset also makes the first bucket 1 MiB).", rich_help_panel=PANEL_DDP),
    ] = STEP.ddp.bucket_cap_mb,
    gradient_as_bucket_view: Annotated[
        bool, typer.Option("--gradient-as-bucket-view",
                           help="DDP: .grad as views of the reducer's buckets.",
                               rich_help_panel=PANEL_DDP)
    ] = STEP.ddp.gradient_as_bucket_view,
    find_unused_parameters: Annotated[
        bool, typer.Option("--find-unused-parameters",
                           help="DDP: search for unused parameters (clones the outputs).",
                               rich_help_panel=PANEL_DDP)
    ] = STEP.ddp.find_unused_parameters,
    compute_capability_text: Annotated[
        str | None,
        typer.Option("--compute-capability", help="The target GPU's compute capability "
                     "(8.0 A100, 9.0 H100, 7.5 T4, or a catalog name such as h100-80gb): "
                     "cuBLAS workspace size and which attention kernel runs. Default: the "
                     "--gpu's, else 8.0.", rich_help_panel=PANEL_GPUS),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option("--dtype", help="float32, bfloat16 or float16: train the workload in "
                     "that dtype (pure low precision).", rich_help_panel=PANEL_WORKLOAD),
    ] = STEP.dtype,
    amp: Annotated[
        str | None,
        typer.Option("--amp", help="bfloat16 or float16: forward and loss under autocast "
                     "(float32 master weights).", rich_help_panel=PANEL_WORKLOAD),
    ] = STEP.amp,
    no_broadcast_buffers: Annotated[
        bool, typer.Option("--no-broadcast-buffers",
                           help="DDP: broadcast_buffers=False (no buffer sync per forward).",
                               rich_help_panel=PANEL_DDP)
    ] = not STEP.ddp.broadcast_buffers,
    output: Annotated[
        list[str] | None,  # str: a trailing '/' survives to be refused
        typer.Option(
            "--output", "-o", metavar="FILE",
            help="Report file; repeat for several. The suffix picks the format (.html, .json, "
            ".md for a GitHub issue). "
            "Default: both, in ./dpprof-reports/compare-YYYYmmdd-HHMMSS.*",
            rich_help_panel=PANEL_OUTPUT),
    ] = None,
    quiet: Annotated[bool, QUIET] = False,
    debug: Annotated[bool, DEBUG] = CONFIG.debug,
    gpu: Annotated[str, GPU] = CONFIG.gpu,
    interconnect: Annotated[str, INTERCONNECT] = CONFIG.interconnect,
    maxbatch: Annotated[bool, MAXBATCH] = CONFIG.maxbatch,
    multiple_of: Annotated[int, MULTIPLE_OF] = CONFIG.multiple_of,
    count_reserved: Annotated[bool, COUNT_RESERVED] = CONFIG.count_reserved,
    fixes: Annotated[bool, FIXES] = CONFIG.fixes,
    ladder: Annotated[bool | None, LADDER] = CONFIG.ladder,
    fail_on_imbalance: Annotated[float | None, FAIL_ON_IMBALANCE] = CONFIG.fail_on_imbalance,
    fail_on_oom: Annotated[bool, FAIL_ON_OOM] = CONFIG.fail_on_oom,
    include_host: Annotated[bool, INCLUDE_HOST] = False,
) -> None:
    """Run your training step as paired scenarios and compare every GPU's peak memory.

    The scenarios: dp-loss-primary (nn.DataParallel, loss on cuda:0), dp-loss-forward
    (the loss inside forward, on every replica), ddp (DistributedDataParallel) and single
    (one GPU with batch ceil(B/N)). Without at least two GPUs, dpprof emulates them.

    Example: dpprof compare --batch 512 --gpus 8 --gpu-memory 40GB
    """
    paths: list[tuple[Path, str]] = []

    def write_partial(partial: RunResult, signum: int) -> list[str]:
        from dpprof.pipeline import mark_partial

        return [shown_path(p) for p in write_reports(mark_partial(partial, signum), paths, True,
                                                     include_host)]

    with guarded(debug, on_interrupt=write_partial):
        from dpprof.backends.ranks import torchrun_info
        # --gpu NAME sets the target generation unless --compute-capability says otherwise
        target = target_gpu(gpu_memory, gpu, compute_capability_text)

        rank = torchrun_info()
        if rank is not None and rank.rank != 0:
            quiet = True  # only rank 0 speaks and writes reports
        cfg = _compare_config(
            target, workload=workload, gpus=gpus, scenarios=scenarios, backend=backend,
            devices=devices, nvml_interval=nvml_interval, ddp_timeout=ddp_timeout,
            compute=compute, debug=debug, fixes=fixes, maxbatch=maxbatch, ladder=ladder,
            multiple_of=multiple_of, count_reserved=count_reserved,
            fail_on_imbalance=fail_on_imbalance, fail_on_oom=fail_on_oom,
            interconnect=interconnect,
            step=StepConfig(
                batch=batch, seed=seed, warmup=warmup, steps=steps, dtype=dtype, amp=amp,
                ddp=DdpOptions(bucket_cap_mb=bucket_cap_mb,
                               gradient_as_bucket_view=gradient_as_bucket_view,
                               find_unused_parameters=find_unused_parameters,
                               broadcast_buffers=not no_broadcast_buffers),
            ),
        )
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        paths[:] = output_paths(output, f"compare-{stamp}")
        check_writable(paths)
        resolved = _resolved_backend(cfg, devices)
        wl = load_user_workload(cfg.workload)
        if not quiet:
            _announce(cfg, resolved, target.memory_bytes, rank, wl.name)
        run = _run(cfg, wl, quiet)
        if run is None:  # a torchrun rank other than 0: rank 0 writes the report
            return
        _show_and_write(run, paths, quiet, include_host)
    exit_for_run(run)
    exit_on_fail_reasons(run, err)


def _compare_config(
    target: TargetGpu, *, workload: str, step: StepConfig, gpus: int | None, scenarios: str,
    backend: str, devices: str | None, nvml_interval: float, ddp_timeout: float,
    compute: bool, debug: bool, fixes: bool, maxbatch: bool, ladder: bool | None,
    multiple_of: int, count_reserved: bool, fail_on_imbalance: float | None,
    fail_on_oom: bool, interconnect: str = "",
) -> CompareConfig:
    """The one configuration from the options, validated, each number in its bounds."""
    cfg = CompareConfig(
        compute_capability=target.compute_capability, workload=workload, step=step,
        gpus=gpus, gpu_memory_bytes=target.memory_bytes,
        scenarios=parse_scenarios(scenarios), backend=backend,
        compute=compute, debug=debug, devices=_parse_devices(devices),
        nvml_interval_s=nvml_interval, ddp_timeout_s=ddp_timeout,
        fixes=fixes, maxbatch=maxbatch, ladder=ladder,
        multiple_of=multiple_of, gpu=target.spec.key if target.named else "",
        count_reserved=count_reserved, fail_on_imbalance=fail_on_imbalance,
        fail_on_oom=fail_on_oom, interconnect=interconnect.strip().lower(),
    )
    cfg.validate()
    check_bounds({"--batch": step.batch, "--gpus": gpus, "--seed": step.seed,
                  "--warmup": step.warmup, "--steps": step.steps, "--multiple-of": multiple_of,
                  "--nvml-interval": nvml_interval, "--ddp-timeout": ddp_timeout,
                  "--bucket-cap-mb": step.ddp.bucket_cap_mb,
                  "--fail-on-imbalance": fail_on_imbalance})
    return cfg


def _resolved_backend(cfg: CompareConfig, devices: str | None) -> str:
    """The backend ``auto`` stands for; ``--devices`` only where it picks real GPUs."""
    from dpprof.pipeline import resolve_backend

    resolved = resolve_backend(cfg.backend)
    if cfg.devices is not None and resolved != "cuda":
        raise UsageError(
            f"--devices {devices}: picks real CUDA GPUs, but the {resolved} backend runs "
            "virtual ones (numbered from 0); give --gpus N instead, or --backend cuda "
            "on a machine with GPUs")
    return resolved


def _announce(cfg: CompareConfig, resolved: str, memory_bytes: int, rank: RankInfo | None,
              workload_name: str) -> None:
    """dpprof's one line on stderr before measuring: where the scenarios run, and why."""
    n = cfg.gpus or DEFAULT_EMULATED_GPUS
    batch = cfg.step.batch
    if resolved == "cpu":
        err.print(
            f"dpprof: --backend cpu: {n} simulated GPUs on the CPU (ddp: {n} gloo "
            f"processes); workload {terminal_text(workload_name)}, batch {batch}",
            soft_wrap=True)  # one line, as a log shows it
    if resolved == "emulated":
        from dpprof.pipeline import visible_cuda_gpus

        found = visible_cuda_gpus()
        why = ("--backend emulated" if cfg.backend != "auto" else "no CUDA GPUs found"
               if found == 0 else f"{found} CUDA GPU found (the comparison needs 2)")
        kind = "CPU tensors" if cfg.compute else "meta tensors, memory only"
        err.print(
            f"dpprof: {why}: emulating {n} devices of {fmt_bytes(memory_bytes)} "
            f"({kind}); workload {terminal_text(workload_name)}, batch {batch}",
            soft_wrap=True)  # one line, as a log shows it
    if resolved == "cuda":
        where = f"torchrun rank 0 of {rank.world_size}" if rank else (
            f"CUDA devices {','.join(map(str, cfg.devices))}" if cfg.devices
            else f"{cfg.gpus or 'every visible'} CUDA GPU(s)"
        )
        err.print(
            f"dpprof: measuring on {where}; workload {terminal_text(workload_name)}, "
            f"batch {batch}, "
            f"{cfg.step.warmup_steps('cuda')} warm-up + "
            f"{cfg.step.measured_steps('cuda')} measured steps",
            soft_wrap=True)  # one line, as a log shows it


def run_compare(cfg: CompareConfig, **kwargs: Any) -> RunResult | None:
    """:func:`dpprof.pipeline.run_compare`, imported where a comparison runs: torch and the
    backends are not loaded for --help or the other commands."""
    from dpprof.pipeline import run_compare as run_pipeline

    return run_pipeline(cfg, **kwargs)


def _run(cfg: CompareConfig, wl: Workload, quiet: bool) -> RunResult | None:
    """The pipeline's run, with a progress bar over the scenarios unless ``quiet``; None on
    a torchrun rank other than 0."""
    if quiet:
        return run_compare(cfg, workload=wl)
    with progress_bar("{task.completed}/{task.total}", err) as bar:
        task = bar.add_task("starting", total=len(cfg.scenarios))

        def progress(name: str, i: int, total: int) -> None:
            desc = f"running {name}" if name else "analysing"
            bar.update(task, completed=i, description=desc)

        return run_compare(cfg, progress=progress, workload=wl)


def _show_and_write(run: RunResult, paths: list[tuple[Path, str]], quiet: bool,
                    include_host: bool) -> None:
    """The terminal report (unless ``quiet``), then the report files."""
    if not quiet:
        out.print(terminal.render(for_terminal(run)))
    write_reports(run, paths, quiet, include_host)


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
