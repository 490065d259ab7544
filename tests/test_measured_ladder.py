"""The ladder's rungs against what a real H200 measured (tests/data/h200_ladder.json).

scripts/gpu_ladder.py ran each rung through the cuda backend's ``single`` scenario on an
NVIDIA H200 (torch 2.11.0+cu130): mixed precision, checkpointing, both, gradient
accumulation, and FSDP2 as one rank of 4 over torch's fake process group (every buffer
FSDP2 allocates is real, on its own streams; the collectives return at once), ZeRO-2, ZeRO-3,
with bf16 and checkpointing, and with CPU offload. Here the same rung workloads run through
the emulator, with no GPU, and must give what ``max_memory_allocated`` and
``max_memory_reserved`` gave."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
MEASURED: dict[str, Any] = json.loads((ROOT / "tests" / "data" / "h200_ladder.json").read_text())
sys.path.insert(0, str(ROOT / "scripts"))
from gpu_ladder import run_part  # noqa: E402  (the script the GPU ran, its emulated side)

# allocated: the emulator replays the same program's allocations; the difference left is
# torch's version (2.13 here, 2.11 on the GPU) and the cuBLAS/cuDNN workspaces' timing
ALLOCATED_TOLERANCE = 0.01
# reserved: the caching allocator's blocks, simulated (rounding, splitting, pools)
RESERVED_TOLERANCE = 0.03


# Where the emulator is known to be off, found by this comparison and not yet mended: each
# an expected failure, strict, so that the mend shows here as a pass to be unmarked. A key
# is a word of the rung's name, or one case's id (workload-rung). None now: FSDP2's rungs
# (with CPU offload too) reserved 6-11 % more on the H200 until the cuBLAS workspaces were
# placed where their handles allocate them (each thread's first matmul, not the step's
# start): a 32 MiB workspace carved out of a freed 512 MiB block made the next step's
# 512 MiB request take a segment of its own (the H200's segment_alloc events,
# tests/data/h200_measured.json's segments-* parts, show where).
GAPS_ALLOCATED: dict[str, str] = {}
GAPS_RESERVED: dict[str, str] = {**GAPS_ALLOCATED}


def _cases(gaps: dict[str, str]) -> list[Any]:
    out = []
    for run in MEASURED["runs"]:
        for part, real in run["parts"].items():
            if real.get("status") != "ok":
                continue
            words = part.split("@")[0].split("-")
            if "bf16" in words and "fsdp" not in words:  # FSDP2's bf16 is its own policy
                words.append("autocast")
            case = f"{run['workload']}-{part}"
            why = [reason for key, reason in gaps.items() if key in words or key == case]
            marks = [pytest.mark.xfail(strict=True, reason=why[0])] if why else []
            out.append(pytest.param(run, part, real, id=case, marks=marks))
    return out


@functools.cache
def _emulated(workload: str, batch: int, part: str, capacity: int,
              cc: tuple[int, int]) -> dict[str, Any]:
    """The emulator's figures for one rung, once for both tests."""
    emu = run_part(part, workload, batch, emulated=True, capacity=capacity, cc=cc)
    assert emu["status"] == "ok", emu["message"]
    return emu


def _assert_within(run: dict[str, Any], part: str, real: dict[str, Any], key: str,
                   tolerance: float) -> None:
    emu = _emulated(run["workload"], run["batch"], part, run["total_memory_bytes"],
                    tuple(run["compute_capability"]))
    error = (emu[key] - real[key]) / real[key]
    assert abs(error) <= tolerance, (
        f"{part}: emulated {emu[key]:,} B, the H200 {real[key]:,} B ({error:+.1%})")


@pytest.mark.parametrize(("run", "part", "real"), _cases(GAPS_ALLOCATED))
def test_each_rung_allocates_what_the_h200_allocated(run: dict[str, Any], part: str,
                                                      real: dict[str, Any]) -> None:
    _assert_within(run, part, real, "allocated_bytes", ALLOCATED_TOLERANCE)


@pytest.mark.parametrize(("run", "part", "real"), _cases(GAPS_RESERVED))
def test_each_rung_reserves_what_the_h200_reserved(run: dict[str, Any], part: str,
                                                    real: dict[str, Any]) -> None:
    _assert_within(run, part, real, "reserved_bytes", RESERVED_TOLERANCE)
