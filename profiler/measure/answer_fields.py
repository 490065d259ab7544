"""The answer fields a comparison computes after its scenarios: the attribution, the fixes,
the ladder's rungs, the largest batch, the math against ``single``, the ``--fail-on-*``
reasons, and the verdict last (:func:`add_answers`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from dpprof.answers.answer import settled
from dpprof.answers.attribution import attribute_run
from dpprof.answers.comparison import compare
from dpprof.answers.recommendation import needs_wanted
from dpprof.emulator.catalog import lookup_gpu
from dpprof.measure import ladder as rungs
from dpprof.measure.equivalence import check
from dpprof.measure.fix_savings import evaluate, fill_needs
from dpprof.measure.maxbatch_search import run_maxbatch
from dpprof.result import STATUS_OOM, RunResult

if TYPE_CHECKING:
    from dpprof.backends.emulated import Alongside, EmulationConfig
    from dpprof.emulator.catalog import GpuSpec
    from dpprof.scenarios.workloads import Workload


def fail_reasons(run: RunResult, fail_on_imbalance: float | None = None,
                 fail_on_oom: bool = False) -> list[str]:
    """Why a CI job should fail: a scenario's max/mean above the ratio, or an OOM."""
    reasons: list[str] = []
    if fail_on_imbalance is not None:
        for name, c in run.comparison.scenarios.items():
            if c.imbalance > fail_on_imbalance:
                reasons.append(f"{name}: max/mean {c.imbalance:.3f} exceeds "
                               f"--fail-on-imbalance {fail_on_imbalance:g}")
    if fail_on_oom:
        for s in run.scenarios:
            if s.status == STATUS_OOM:
                reasons.append(f"{s.name}: {s.message or 'out of memory'} (--fail-on-oom)")
    return reasons


def gpu_spec(name: str) -> GpuSpec | None:
    """The catalog GPU named ``name``; None for ""."""
    return lookup_gpu(name) if name else None


def add_answers(
    run: RunResult, wl: Workload, ecfg: EmulationConfig, *, fixes: bool = True,
    maxbatch: bool = False, multiple_of: int = 1, gpu: GpuSpec | None = None,
    equivalence: bool = False, scenarios: tuple[str, ...] = (),
    fail_on_imbalance: float | None = None, fail_on_oom: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
    alongside: Alongside | None = None, ladder: bool | None = None,
) -> RunResult:
    """``run`` with its answer fields, its verdict last (:func:`settled`);
    ``alongside``: what the run's own scenarios measured for the fixes
    (:func:`dpprof.measure.fix_savings.alongside`); ``ladder``: measure the ladder's rungs
    (:mod:`dpprof.measure.ladder`), also without ``fixes``; None: with the fixes, where the
    data-parallel floor is out of memory."""
    run = dataclasses.replace(run, comparison=compare(run))  # the answers below read it
    run = dataclasses.replace(run, attribution=attribute_run(run))
    n = len(run.scenarios)

    def step(name: str, i: int = 0, total: int = 0) -> None:
        if progress and name:  # the scenarios' bar stays full while the answers run
            progress(name, n, n)

    if fixes:
        step("the fixes")
        run = dataclasses.replace(run, fixes=tuple(evaluate(run, wl, ecfg, alongside)))
    if ladder or (ladder is None and fixes and rungs.wanted(run)):
        step("the ladder")
        notes = list(run.notes)
        rung_fixes = rungs.evaluate(run, wl, ecfg, notes=notes)
        run = dataclasses.replace(run, fixes=run.fixes + tuple(rung_fixes), notes=tuple(notes))
    if maxbatch:
        run = dataclasses.replace(run, maxbatch=run_maxbatch(
            wl, scenarios or tuple(s.name for s in run.scenarios), ecfg.gpus,
            ecfg.gpu_memory_bytes, gpu=gpu, multiple_of=multiple_of, emulation=ecfg,
            ladder=bool(ladder),
            progress=lambda name, i, total: step(f"largest batch: {name}" if name else ""),
        ))
    if equivalence:
        step("the math against single")
        run = dataclasses.replace(run, equivalence=check(
            wl, run.batch, ecfg.gpus, ecfg.step.seed,
            scenarios or tuple(s.name for s in run.scenarios), backend=run.backend))
    run = dataclasses.replace(
        run, fail_reasons=tuple(fail_reasons(run, fail_on_imbalance, fail_on_oom)))
    tried: set[str] = set()
    wanted = needs_wanted(run)
    while wanted:  # the needs that decide the answer, each emulated once
        step("what the fixes need")
        run = dataclasses.replace(run, fixes=fill_needs(run, wl, ecfg, wanted))
        tried |= set(wanted)
        wanted = [n for n in needs_wanted(run) if n not in tried]
    return settled(run)  # the comparison's verdict and the one answer, derived once
