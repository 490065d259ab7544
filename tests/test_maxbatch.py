"""The largest batch: the search itself, the accounting, and consistency with compare."""

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from dpprof.backends.emulated import EmulationConfig, run_scenario
from dpprof.emulator.context import device_context
from dpprof.emulator.nccl_memory import nccl_clique_memory
from dpprof.measure.maxbatch_search import ProbeResult, run_maxbatch, search
from dpprof.pipeline import CompareConfig, run_compare
from dpprof.result import STATUS_OK, STATUS_OOM
from dpprof.scenarios.step import StepConfig
from dpprof.scenarios.workloads import LMConfig, lm, load_workload

SMALL_LM = LMConfig(vocab=8000, seq=64, d_model=128, layers=1)


def _threshold_probe(limit: int, base: int = 1000, per_row: int = 7, calls: list | None = None):
    capacity = base + per_row * limit

    def probe(batch: int) -> ProbeResult:
        if calls is not None:
            calls.append(batch)
        total = base + per_row * batch + (batch % 3)  # not quite affine
        return ProbeResult(total <= capacity, 0, total, STATUS_OK, "")

    return probe, capacity


@pytest.mark.parametrize("limit,multiple", [(1, 1), (2, 1), (63, 1), (64, 1), (1000, 1),
                                            (12345, 8), (777, 64), (100_000, 3)])
def test_search_finds_the_boundary(limit: int, multiple: int) -> None:
    calls: list[int] = []
    probe, capacity = _threshold_probe(limit, calls=calls)
    best, probes, capped = search(probe, multiple, upper=1 << 22, capacity_bytes=capacity)

    def fits(b: int) -> bool:
        return 1000 + 7 * b + (b % 3) <= capacity

    assert not capped
    if best is None:
        assert not fits(multiple)
        return
    assert best % multiple == 0 and fits(best) and not fits(best + multiple)
    assert len(calls) == len(set(calls)) == len(probes)  # nothing emulated twice
    assert len(calls) <= 12  # the secant gets there in a few steps


def test_search_nothing_fits_and_capped() -> None:
    probe, capacity = _threshold_probe(0)
    best, _, _ = search(probe, 4, capacity_bytes=capacity)
    assert best is None
    probe, capacity = _threshold_probe(10**9)
    best, _, capped = search(probe, 1, upper=5000, capacity_bytes=capacity)
    assert capped and best == 5000


def test_count_reserved_over_cpu_tensors_counts_segments_and_context() -> None:
    # CPU tensors: reserved and context only when asked for, from the one model (reserved.py)
    cfg = EmulationConfig(gpus=2, gpu_memory_bytes=80 << 30, compute=True, step=StepConfig(batch=8))
    plain = run_scenario("dp-loss-primary", lm(SMALL_LM), cfg)
    assert all(d.peak_reserved_bytes is None and d.context_bytes is None for d in plain.devices)
    counted = dataclasses.replace(cfg, count_reserved=True)
    s = run_scenario("dp-loss-primary", lm(SMALL_LM), counted)
    ctx = device_context(cfg.compute_capability, uses_cudnn=False)
    assert ctx.outside_allocator_bytes > 250 << 20  # the CUDA context alone is ~254 MiB
    # and DataParallel's NCCL communicator on each GPU
    nccl = nccl_clique_memory(2, compute_capability=cfg.compute_capability).high_bytes
    for d in s.devices:
        assert d.peak_reserved_bytes is not None and d.peak_reserved_bytes >= d.peak_allocated_bytes
        assert d.context_bytes == ctx.outside_allocator_bytes + nccl
        assert d.total_peak_bytes == d.peak_reserved_bytes + d.context_bytes
    # reserved memory comes in segments of at least 2 MiB
    assert s.devices[0].peak_reserved_bytes % (2 << 20) == 0
    # a DDP rank stands for every rank: the same reserved memory on each
    ddp = run_scenario("ddp", lm(SMALL_LM), counted)
    assert len({d.peak_reserved_bytes for d in ddp.devices}) == 1
    assert ddp.devices[-1].peak_reserved_bytes > ddp.devices[-1].peak_allocated_bytes


def test_reported_batch_fits_under_compare_and_the_next_step_does_not() -> None:
    wl = lm(SMALL_LM)
    capacity = 4 << 30  # room for a DDP rank's context and NCCL (~2.4 GiB at 4 GPUs)
    names = ("dp-loss-primary", "ddp")
    mb = run_maxbatch(wl, names, gpus=4, capacity_bytes=capacity, multiple_of=4)
    for e in mb.entries:
        assert e.max_batch is not None and not e.capped and e.max_batch % 4 == 0
        assert e.needed_bytes <= capacity < e.next_needed_bytes
        for batch, expected in ((e.max_batch, STATUS_OK), (e.max_batch + 4, STATUS_OOM)):
            run = run_compare(CompareConfig(
                gpu_memory_bytes=capacity, scenarios=(e.scenario,),
                count_reserved=True, fixes=False, step=StepConfig(batch=batch),
            ), workload=wl)
            assert run.scenarios[0].status == expected, (e.scenario, batch)
    best = {e.scenario: e.max_batch for e in mb.entries}
    assert best["ddp"] > best["dp-loss-primary"]


def test_reserved_is_counted_not_only_allocated() -> None:
    """The emulator predicts out of memory from reserved + context (what a GPU must hold),
    not from the allocated bytes alone: at a capacity between the two, it is an OOM."""
    wl = lm(SMALL_LM)
    plain = run_compare(CompareConfig(scenarios=("ddp",), fixes=False, step=StepConfig(batch=8)), workload=wl)
    d = plain.scenarios[0].devices[0]
    assert d.peak_reserved_bytes is not None and d.context_bytes
    assert d.total_peak_bytes >= d.peak_allocated_bytes + (200 << 20)  # the context alone
    between = run_compare(CompareConfig(
        scenarios=("ddp",), fixes=False,
        gpu_memory_bytes=d.peak_allocated_bytes + (64 << 20),
        step=StepConfig(batch=8),
    ),
                          workload=wl)
    assert between.scenarios[0].status == STATUS_OOM
    fits = run_compare(CompareConfig(
        scenarios=("ddp",), fixes=False, gpu_memory_bytes=d.total_peak_bytes,
        step=StepConfig(batch=8),
    ), workload=wl)
    assert fits.scenarios[0].status == STATUS_OK


def test_maxbatch_ladder_searches_each_rung_on_ddp(tmp_path: Path) -> None:
    """--ladder: one entry per rung after the scenarios, in the table and the reports;
    each rung's largest batch fits and the next step does not, as for a scenario; k
    micro-batches fit a larger batch than plain DDP."""
    import json

    from typer.testing import CliRunner

    from dpprof.cli.app import app
    from dpprof.measure.maxbatch_limits import LADDER_MICRO_BATCHES

    out = tmp_path / "mb.json"
    md = tmp_path / "mb.md"
    r = CliRunner().invoke(app, ["maxbatch", "-w", "mlp", "-g", "2", "--gpu-memory", "2GiB",
                                 "-s", "ddp", "--multiple-of", "64", "--ladder",
                                 "-o", str(out), "-o", str(md)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    entries = {e["scenario"]: e for e in json.loads(out.read_text())["maxbatch"]["entries"]}
    acc = f"ddp + {LADDER_MICRO_BATCHES} micro-batches"
    assert list(entries) == ["ddp", "ddp + bf16", acc]  # mlp: no repeated blocks
    for e in entries.values():
        assert e["needed_bytes"] <= 2 << 30 < e["next_needed_bytes"]
    assert entries[acc]["max_batch"] > entries["ddp"]["max_batch"]
    assert acc in r.output and acc in md.read_text()


def test_maxbatch_ladder_searches_fsdp2_as_compare_counts_it(tmp_path: Path) -> None:
    """--ladder on several GPUs, a model with repeated blocks: FSDP2's rungs too, each its
    largest global batch; at that batch compare's rung needs what the search found (reserved,
    the context and NCCL's memory) and fits, at the next step it needs the next total and
    does not."""
    import json

    from typer.testing import CliRunner

    from dpprof.cli.app import app

    # a small lm (two blocks: the search's cost is the ops each probe dispatches) on a GPU
    # just larger than its context and NCCL's memory
    capacity, step = 7 << 28, 8
    spec = f"{Path(__file__).parent / 'ladder_models.py'}:lm_two_blocks"
    out = tmp_path / "mb.json"
    r = CliRunner().invoke(app, ["maxbatch", "-w", spec, "-g", "2", "--gpu-memory",
                                 f"{capacity}B", "-s", "ddp", "--multiple-of", str(step),
                                 "--ladder", "-q", "-o", str(out)])
    assert r.exit_code == 0, r.output
    entries = {e["scenario"]: e for e in json.loads(out.read_text())["maxbatch"]["entries"]}
    names = list(entries)
    fsdp = ["fsdp2-zero2", "fsdp2-zero3", "fsdp2-zero3-bf16-checkpoint", "fsdp2-zero3-offload"]
    assert names[names.index("ddp + bf16-checkpoint") + 1:][:4] == fsdp
    # FSDP2's own bf16 and checkpointing: the largest batch of the ladder's non-accumulating
    # rungs
    assert entries[fsdp[2]]["max_batch"] > max(
        e["max_batch"] for name, e in entries.items() if "micro-batches" not in name
        and name != fsdp[2])
    runs: dict[int, Any] = {}  # one compare per batch: it measures every rung at once

    def compare_at(batch: int) -> Any:
        if batch not in runs:
            runs[batch] = run_compare(CompareConfig(gpus=2, gpu_memory_bytes=capacity,
                                                    scenarios=("ddp",), ladder=True,
                                                    step=StepConfig(batch=batch)),
                                      workload=load_workload(spec))
        return runs[batch]

    for name in fsdp:
        e = entries[name]
        assert e["max_batch"] and e["max_batch"] % step == 0 and not e["errored"]
        assert e["needed_bytes"] <= capacity < e["next_needed_bytes"]
        for batch, need in ((e["max_batch"], e["needed_bytes"]),
                            (e["max_batch"] + step, e["next_needed_bytes"])):
            run = compare_at(batch)
            fix = next((f for f in run.fixes if f.name == f"ladder-{name}"), None)
            if name == "fsdp2-zero3-offload":
                # compare leaves the last resort out where a rung before it fits (here
                # FSDP2's own bf16 with checkpointing does); maxbatch measures it anyway
                assert fix is None
                assert any("CPU offload not measured: a rung before it fits" in n
                           for n in run.notes)
                continue
            assert fix is not None and fix.need_bytes == need, (name, batch)
