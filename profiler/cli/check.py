"""``dpprof check``: dpprof against the user's own GPU, the figures for a bug report.

    dpprof check
    dpprof check --device 1 -w lm -b 32 -o check.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from dpprof.cli.common import err, out, parse_scenarios
from dpprof.cli.guard import guarded
from dpprof.scenarios.registry import SCENARIOS

PANEL = "What to run"


def check_cmd(
    device: Annotated[int, typer.Option(
        "--device", "-d", min=0, help="The CUDA index of the GPU to check.",
        rich_help_panel=PANEL)] = 0,
    workload: Annotated[str, typer.Option(
        "--workload", "-w", help="The workload run for real and emulated (small: the "
        "check takes well under five minutes).", rich_help_panel=PANEL)] = "mlp",
    batch: Annotated[int, typer.Option(
        "--batch", "-b", min=1, max=2**20, help="Rows per step.", rich_help_panel=PANEL)] = 64,
    steps: Annotated[int, typer.Option(
        "--steps", min=1, max=100, help="Measured steps per scenario.",
        rich_help_panel=PANEL)] = 3,
    scenarios: Annotated[str, typer.Option(
        "--scenarios", "-s", help="Comma-separated scenarios.", rich_help_panel=PANEL,
    )] = ",".join(SCENARIOS),
    nvml_interval: Annotated[float, typer.Option(
        "--nvml-interval", min=0.001, max=60.0, help="Seconds between NVML readings.",
        rich_help_panel=PANEL)] = 0.02,
    sampler_steps: Annotated[int, typer.Option(
        "--sampler-steps", min=1, max=10_000, help="Steps timed per round with the NVML "
        "sampler off and on (3 rounds).", rich_help_panel=PANEL)] = 20,
    save_calibration: Annotated[bool, typer.Option(
        "--save-calibration", help="Keep the context and cuBLAS workspace measured here for "
        "later emulations of this GPU's compute capability (their reports say so).",
        rich_help_panel="Output")] = False,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", metavar="FILE",
        help="Also write every figure as JSON (attach it to a bug report).",
        rich_help_panel="Output")] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    """Check the emulator against your GPU: a small workload run for real and emulated.

    Prints, per scenario, emulated against max_memory_allocated / max_memory_reserved /
    NVML; the CUDA context and cuBLAS workspace measured; whether CUDA and NVML devices
    match (MIG, containers); whether per-process NVML works; and the NVML sampler's cost.
    Exits 2 without a GPU."""
    with guarded(debug):
        # the GPU check's own modules (torch, the emulator) only where it runs: --help,
        # dpprof report and the other commands start without them
        from dpprof.self_check import check_lines, run_check, save_measured

        chosen = parse_scenarios(scenarios)
        report = run_check(device=device, workload=workload, batch=batch, steps=steps,
                           scenarios=chosen, nvml_interval_s=nvml_interval,
                           sampler_steps=sampler_steps,
                           progress=lambda text: err.print(f"dpprof check: {text}"))
        for line in check_lines(report):
            out.print(line)
        if save_calibration:
            err.print(f"dpprof check: {save_measured(report)}", markup=False)
        if output is not None:
            output.write_text(json.dumps(report, indent=1, default=str) + "\n")
            err.print(f"wrote {output}")
