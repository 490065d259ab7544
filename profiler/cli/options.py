"""The options ``compare`` and ``maxbatch`` share, declared once, and the CI exit check.

    dpprof compare --batch 512 --maxbatch --fail-on-imbalance 1.5 --fail-on-oom
"""

from __future__ import annotations

import math
from typing import Any

import typer
from rich.console import Console

from dpprof.emulator.catalog import TargetGpu, compute_capability_of, known_gpus, lookup_gpu
from dpprof.errors import EXIT_CHECK_FAILED, UsageError
from dpprof.result import RunResult
from dpprof.units import has_unit, parse_bytes

# Every numeric option's range (inclusive), checked after the options' own lower-bound
# messages: upper bounds keep a typo from running for minutes (--gpus 10000), floats must be
# finite (NaN passes every comparison).
MAX_GPUS = 64  # nn.DataParallel is one process on one node; 64 emulated GPUs take ~20 s
MAX_BATCH = 2**30  # rows
# --seed's published range (within torch.manual_seed's; the batches' and the steps' seeds
# are hashed from it, dpprof.scenarios.step.derived_seed, so any value in it is valid)
MAX_SEED = 2**63 - 1 - 10**6
MAX_GPU_MEMORY_BYTES = 2**50  # 1 PiB per GPU
BOUNDS: dict[str, tuple[float, float]] = {
    "--batch": (1, MAX_BATCH),
    "--gpus": (1, MAX_GPUS),
    "--seed": (0, MAX_SEED),
    "--warmup": (0, 1000),
    "--steps": (1, 100_000),
    "--multiple-of": (1, MAX_BATCH),
    "--nvml-interval": (0.001, 60.0),
    "--ddp-timeout": (1.0, 7 * 24 * 3600.0),
    "--bucket-cap-mb": (1e-6, 2**20),
    "--fail-on-imbalance": (1.0, 1e6),
    "--gpu-memory": (1, MAX_GPU_MEMORY_BYTES),
    "--interval": (0.001, 3600.0),
    "--kill-after": (0.0, 7 * 24 * 3600.0),
}

# The --help panels: compare has some 30 options; grouped, each panel's table is narrow
# enough that no option's name is cut at 80 columns.
PANEL_WORKLOAD = "Workload"
PANEL_GPUS = "GPUs"
PANEL_MEASURE = "Measurement"
PANEL_DDP = "DDP"
PANEL_OUTPUT = "Output and CI"

# A compute capability dpprof knows kernels and workspaces for (Kepler 3.0 to Blackwell 12.x)
MIN_COMPUTE_CAPABILITY = (3, 0)
MAX_COMPUTE_CAPABILITY = (12, 9)


def _gpu_given(ctx: typer.Context, param: Any, value: str | None) -> str | None:
    """``--gpu ""`` is a typo, not "no GPU": refused (the default, unset, is "")."""
    source = ctx.get_parameter_source(param.name)
    given = source is not None and source.name == "COMMANDLINE"
    if given and value is not None and not value.strip():
        # a parse error (exit 2), worded by the app's one-line error handler
        raise typer.BadParameter(f"empty; give a GPU from the catalog, one of "
                                 f"{', '.join(known_gpus())} (or leave --gpu out)")
    return value


GPU = typer.Option(
    "--gpu", help="A GPU from the catalog (e.g. a100-80gb, h100-80gb, rtx-4090): its memory, "
    "and its context counted. Unknown names list the known ones.", callback=_gpu_given,
    rich_help_panel=PANEL_GPUS)
INTERCONNECT = typer.Option(
    "--interconnect", help="The link between the GPUs for the predicted step time: nvlink or "
    "pcie (default: NVLink where the --gpu has it, else PCIe).", rich_help_panel=PANEL_GPUS)
MAXBATCH = typer.Option(
    "--maxbatch", help="Also find the largest batch each scenario fits (reserved memory and "
    "the CUDA context counted).", rich_help_panel=PANEL_MEASURE)
MULTIPLE_OF = typer.Option("--multiple-of", help="Batch granularity of the largest-batch search.",
                           rich_help_panel=PANEL_MEASURE)
COUNT_RESERVED = typer.Option(
    "--count-reserved", help="With --compute: count simulated reserved memory and the CUDA "
    "context in the out-of-memory check (meta emulation always counts them).",
    rich_help_panel=PANEL_MEASURE)
LADDER = typer.Option(
    "--ladder/--no-ladder", help="Measure the ladder on ddp (one GPU: single) at your batch: "
    "mixed precision, activation checkpointing, both, gradient accumulation; the verdict "
    "names the cheapest rung that fits. Default: only when ddp (or single) is out of memory.",
    rich_help_panel=PANEL_MEASURE, show_default=False)
FIXES = typer.Option("--fixes/--no-fixes", help="Emulate each fix and what it saves.",
                     rich_help_panel=PANEL_MEASURE)
FAIL_ON_IMBALANCE = typer.Option(
    "--fail-on-imbalance", metavar="RATIO",
    help="Exit 3 when a scenario's max/mean peak exceeds RATIO (for CI).",
    rich_help_panel=PANEL_OUTPUT)
FAIL_ON_OOM = typer.Option(
    "--fail-on-oom", help="Exit 3 when any scenario runs out of memory (for CI).",
    rich_help_panel=PANEL_OUTPUT)
INCLUDE_HOST = typer.Option(
    "--include-host", help="Keep the host name, GPU UUIDs and PCI bus ids in the reports "
    "and the JSON result (left out by default: a report is made to be shared).",
    rich_help_panel=PANEL_OUTPUT)
QUIET = typer.Option("--quiet", "-q", help="Print only errors.", rich_help_panel=PANEL_OUTPUT)
DEBUG = typer.Option("--debug", help="Show tracebacks.", rich_help_panel=PANEL_OUTPUT)


def target_gpu(gpu_memory: str | None, gpu: str,
               compute_capability: str | None = None) -> TargetGpu:
    """The GPU a command emulates or predicts for, from ``--gpu``, ``--gpu-memory`` and
    ``--compute-capability``: each given one wins over the catalog model's (``--gpu``, else
    :data:`~dpprof.emulator.catalog.DEFAULT_GPU`); an unknown GPU lists the known ones."""
    spec = None
    if gpu and gpu.strip():
        try:
            spec = lookup_gpu(gpu)
        except KeyError:
            raise UsageError(
                f"--gpu {gpu}: unknown GPU; known GPUs: {', '.join(known_gpus())} (or give "
                "--gpu-memory, e.g. 80GiB)"
            ) from None
    memory = None if gpu_memory is None else _memory_bytes(gpu_memory)
    cc = None if compute_capability is None else _compute_capability(compute_capability)
    return TargetGpu.of(spec, memory, cc)


def _memory_bytes(gpu_memory: str) -> int:
    """``--gpu-memory``: a size with its unit, at most 1 PiB."""
    try:
        memory = parse_bytes(gpu_memory)
    except (ValueError, OverflowError) as e:
        raise UsageError(f"--gpu-memory: {e}") from e
    if not has_unit(gpu_memory):  # "80" would be 80 bytes: every scenario out of memory
        raise UsageError(f"--gpu-memory {gpu_memory.strip()}: a size needs its unit; write "
                         f"{gpu_memory.strip()}GiB (or GB, MiB)")
    if memory > MAX_GPU_MEMORY_BYTES:
        raise UsageError(f"--gpu-memory {gpu_memory}: more than 1 PiB per GPU; give the "
                         "memory of one GPU, e.g. 80GiB")
    return memory


def _compute_capability(given: str) -> tuple[int, int]:
    """``--compute-capability``: a version dpprof knows GPUs of, or a catalog name."""
    try:
        cc = compute_capability_of(given)
    except (KeyError, ValueError) as e:
        raise UsageError(f"--compute-capability {given!r}: {str(e).strip(chr(34) + chr(39))}"
                         ) from e
    if not MIN_COMPUTE_CAPABILITY <= cc <= MAX_COMPUTE_CAPABILITY:
        raise UsageError(f"--compute-capability {given}: no GPU has it; give one from 3.0 to "
                         "12.x (8.0 A100, 9.0 H100, 7.5 T4) or a catalog name such as h100-80gb")
    return cc


def check_bounds(values: dict[str, float | int | None]) -> None:
    """Refuse a value outside :data:`BOUNDS` (or not finite) in one line naming the option."""
    for opt, value in values.items():
        if value is None or isinstance(value, bool):
            continue
        lo, hi = BOUNDS[opt]
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{opt} {value}: give a finite number from {_num(lo)} to "
                             f"{_num(hi)}")
        if not lo <= value <= hi:
            raise UsageError(f"{opt} {value}: out of range; give a number from {_num(lo)} to "
                             f"{_num(hi)}")


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


def exit_on_fail_reasons(run: RunResult, err: Console) -> None:
    """Exit 3 with one line per failed --fail-on-* check."""
    for reason in run.fail_reasons:
        err.print(f"dpprof: check failed: {reason}", markup=False, soft_wrap=True)
    if run.fail_reasons:
        raise typer.Exit(code=EXIT_CHECK_FAILED)
