"""The one answer (``dpprof.answers.answer.build_answer``) against the numbers of the result
it speaks of: every saved result in ``tests/data/`` and results hypothesis generates.

Each claim of the text is checked: every size it names is a figure of the result (a peak,
what a GPU needs, a difference of two peaks, the capacity); an out-of-memory scenario is
never said to fit nor its fix recommended; a recommended fix lowers the heaviest GPU of a
scenario the user ran; the words fit the setup; reserved memory is claimed only where it
was measured or modelled.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reports_data import SAVED, saved

from dpprof.answers.answer import baseline, build_answer
from dpprof.answers.answer_figures import budget_bytes, heaviest, measured, need_bytes
from dpprof.answers.comparison import compare
from dpprof.fixes.fix_registry import cost_of
from dpprof.fixes.policy import MARGIN, margin_bytes
from dpprof.result import (
    STATUS_ERROR,
    STATUS_OK,
    STATUS_OOM,
    DeviceResult,
    Fix,
    Recommendation,
    RunResult,
    ScenarioResult,
)
from dpprof.scenarios.names import DDP, DP_LOSS_FORWARD, DP_LOSS_PRIMARY, MODEL_PARALLEL, SINGLE
from dpprof.units import fmt_bytes

MiB, GiB = 2**20, 2**30
SIZE = re.compile(r"(?<![\w.])\d+(?:\.\d+)? (?:B|KiB|MiB|GiB|TiB)\b")
DP_WORDS = ("scatter", "gathered", "reduced gradients", "DataParallel", "loss inside forward",
            "more than the other GPUs")


def _figures(run: RunResult) -> set[str]:
    """Every size a claim about ``run`` may name, formatted as the answer formats it: a
    figure of the result, a difference of two of them, what a need leaves of the GPU, or
    the margin the policy asks (:mod:`dpprof.fixes.policy`)."""
    values: set[int] = {run.gpu_memory_bytes, int(MARGIN * run.gpu_memory_bytes)}
    peaks: list[int] = []
    needs: list[int] = []
    for s in run.scenarios:
        for d in s.devices:
            values |= {d.peak_allocated_bytes, d.total_peak_bytes}
        if s.oom_bytes is not None:
            values.add(s.oom_bytes)
        if s.devices and any(d.used for d in s.devices):
            needs.append(need_bytes(s))
            top = heaviest(s).peak_allocated_bytes
            peaks += [top, next(d for d in s.devices if d.used).peak_allocated_bytes]
    for c in run.comparison.scenarios.values():
        values |= {abs(c.primary_excess_bytes), c.max_bytes}
    for f in run.fixes:
        values |= {abs(x) for x in (f.max_peak_bytes, f.primary_peak_bytes, f.saves_bytes,
                                    f.heaviest_saves_bytes) if x is not None}
        peaks += [x for x in (f.max_peak_bytes, f.primary_peak_bytes) if x is not None]
        if f.need_bytes is not None:
            needs.append(f.need_bytes)
    values |= {abs(a - b) for a, b in itertools.combinations(peaks, 2)}
    # where the script limits its caching allocator (a memory fraction): the limit, and the
    # budget it leaves a need (the limit and the context)
    budgets = {run.gpu_memory_bytes} | {budget_bytes(run, s) for s in run.scenarios}
    values |= budgets | {int(MARGIN * b) for b in budgets} | {
        s.allocator_limit_bytes for s in run.scenarios if s.allocator_limit_bytes is not None}
    values |= set(needs) | {b - n for n in needs for b in budgets}
    values |= {int(u * n) for n in needs for u in (0.10, 0.11)}  # FSDP2's understatement
    if run.maxbatch is not None:
        values |= {e.needed_bytes for e in run.maxbatch.entries if e.needed_bytes}
        values.add(run.maxbatch.capacity_bytes)
    return {fmt_bytes(v) for v in values}


def _claims(answer: Recommendation, run: RunResult) -> str:
    """The builder's own sentences (a fix's stored detail is the fix's, not the answer's)."""
    details = {f.name: f.detail for f in run.fixes}
    whys = [a.why.replace(details[a.fix].rstrip(".") + ".", "") if details.get(a.fix) else a.why
            for a in answer.fixes]
    return " ".join([answer.verdict, answer.why, *whys, *answer.why_heavier.values(),
                     *(p.reason for p in answer.passed_over)])


def check(run: RunResult) -> Recommendation:
    answer = build_answer(run)
    text = _claims(answer, run)
    # every size is a figure of the result
    figures = _figures(run)
    stray = [m for m in SIZE.findall(text) if m not in figures]
    assert not stray, (stray, text)
    # out of memory: never said to fit, never the answer
    ooms = [s for s in run.scenarios if measured(s) and s.status == STATUS_OOM]
    fits = [s for s in run.scenarios if measured(s) and s.status == STATUS_OK]
    verdict = answer.verdict
    for s in ooms:
        assert re.search(rf"\b{re.escape(s.name)} \(cuda:\d+ (needs|tried)", verdict), verdict
        assert f"only {s.name} fits" not in verdict
    if ooms and fits:
        clause = re.split(r"out of memory(?: at [^:]+ per GPU)?:", verdict, maxsplit=1)[1]
        for s in fits:
            assert s.name in clause and fmt_bytes(need_bytes(s)) in clause, verdict
        fit_clause = re.search(r"(only [\w-]+ fits|[\w, -]+ fit):", clause)
        assert fit_clause, verdict
        assert not any(s.name in fit_clause.group(1) for s in ooms), verdict
    if ooms and not fits:
        assert "none of the scenarios run fits" in verdict
    if not ooms and "it fits" in verdict:
        assert len(fits) == 1
    check_policy(run, answer)
    # the words fit the setup
    if not any(s.name in (DP_LOSS_PRIMARY, DP_LOSS_FORWARD) for s in run.scenarios):
        said = [w for w in DP_WORDS if w in text]
        assert not said, (said, text)
        assert not answer.why_heavier
    for name in answer.why_heavier:
        s = run.scenario(name)
        assert s is not None and name in (DP_LOSS_PRIMARY, DP_LOSS_FORWARD)
        c = run.comparison.scenarios[name]
        assert c.primary_excess_bytes > 0
    # reserved memory and the context are claimed only where they were counted
    devs = [d for s in run.scenarios for d in s.devices]
    if not any(d.peak_reserved_bytes is not None for d in devs):
        assert "reserved memory and the CUDA context counted" not in text
    return answer


def check_policy(run: RunResult, answer: Recommendation) -> None:
    """The recommendation follows the policy: it lowers the heaviest GPU of a scenario the
    user ran, fits, and no cheaper change that lowers it fits with the margin; nothing is
    recommended only where that scenario fits with the margin and is balanced, or where no
    change lowers it and fits."""
    fixes = {a.fix: a for a in answer.fixes}
    for a in answer.fixes:
        assert run.scenario(a.baseline) is not None  # against a scenario the user ran
        if a.fits:  # within the GPU, or the share of it the script's memory fraction allows
            assert a.need_bytes is not None
            assert a.need_bytes <= budget_bytes(run, run.scenario(a.baseline)), a
    if answer.fix is not None:
        chosen = fixes[answer.fix]
        base = run.scenario(chosen.baseline)
        assert base is not None and measured(base), chosen
        assert chosen.heaviest_saves_bytes > 0
        assert chosen.fits is True and chosen.need_bytes is not None
        assert chosen.need_bytes <= budget_bytes(run, base)
        assert answer.need_bytes == chosen.need_bytes
        own = {"loss-in-forward": DP_LOSS_FORWARD, "ddp": DDP}.get(chosen.fix)
        own_s = run.scenario(own) if own else None
        assert own_s is None or own_s.status != STATUS_OOM, chosen
        for a in answer.fixes:
            if a.cost_rank < chosen.cost_rank and a.fits and a.heaviest_saves_bytes > 0:
                # a cheaper change that fits was passed over: under the margin or noise
                assert a.fix in {p.fix for p in answer.passed_over}
                assert (a.spare_bytes or 0) < margin_bytes(
                    budget_bytes(run, base), a.need_bytes or 0, cost_of(a.fix)) or (
                    "does not lower" in next(p.reason for p in answer.passed_over
                                             if p.fix == a.fix)), (a, answer)
    for a in answer.fixes:
        if a.heaviest_saves_bytes < 0 and a.fix != answer.fix:
            assert answer.fix != a.fix


def test_every_saved_result() -> None:
    for name in SAVED:
        check(saved(name))


# ---- generated results ---------------------------------------------------------------------

peaks = st.integers(min_value=1 * MiB, max_value=100 * GiB)


@st.composite
def devices(draw: st.DrawFn, n: int, overheads: bool, capacity: int) -> list[DeviceResult]:
    out = []
    for i in range(n):
        alloc = draw(peaks)
        d = DeviceResult(index=i, peak_allocated_bytes=alloc, capacity_bytes=capacity,
                         batch_rows=8)
        if overheads:
            d = dataclasses.replace(
                d, peak_reserved_bytes=alloc + draw(st.integers(0, 4 * GiB)),
                context_bytes=draw(st.integers(200 * MiB, 600 * MiB)))
        out.append(d)
    return out


@st.composite
def results(draw: st.DrawFn) -> RunResult:
    gpus = draw(st.integers(2, 4))
    capacity = draw(st.sampled_from([24 * GiB, 40 * GiB, 80 * GiB]))
    overheads = draw(st.booleans())
    setup = draw(st.sampled_from(["dp", "ddp", "model-parallel", "single"]))
    if setup == "dp":
        names = draw(st.lists(st.sampled_from([DP_LOSS_PRIMARY, DP_LOSS_FORWARD, DDP, SINGLE]),
                              min_size=1, max_size=4, unique=True))
    else:
        names = [{"ddp": DDP, "model-parallel": MODEL_PARALLEL, "single": SINGLE}[setup]]
    run = RunResult(backend="emulated", workload="w", batch=8 * gpus, gpus=gpus,
                    gpu_memory_bytes=capacity, config={"command": draw(
                        st.sampled_from(["compare", "run"]))})
    scenarios = []
    # a script's memory fraction (set_per_process_memory_fraction): a limit on every
    # scenario's caching allocator, out of memory where a reserve exceeds it
    limit = (draw(st.integers(1 * GiB, capacity // 2)) if overheads and draw(st.booleans())
             and run.config["command"] == "run" else None)
    for name in names:
        n = 1 if name == SINGLE else gpus
        s = ScenarioResult(name=name, devices=tuple(draw(devices(n, overheads, capacity))),
                           batch=8, allocator_limit_bytes=limit)
        over = [d for d in s.devices if d.total_peak_bytes > capacity]
        beyond = [d for d in s.devices if limit is not None
                  and (d.peak_reserved_bytes or 0) > limit]
        if draw(st.integers(0, 9)) == 0:
            s = dataclasses.replace(s, status=STATUS_ERROR,
                                    message="the script raised RuntimeError: boom")
        elif beyond:
            s = dataclasses.replace(s, status=STATUS_OOM, oom_device=beyond[0].index,
                                    oom_bytes=beyond[0].peak_reserved_bytes)
        elif over:
            s = dataclasses.replace(s, status=STATUS_OOM, oom_device=over[0].index,
                                    oom_bytes=over[0].total_peak_bytes)
        scenarios.append(s)
    run = dataclasses.replace(run, scenarios=tuple(scenarios))
    fixes = []
    primary = run.scenario(DP_LOSS_PRIMARY)
    if primary is not None and primary.status != STATUS_ERROR:
        p0 = primary.devices[0].peak_allocated_bytes
        pmax = max(d.peak_allocated_bytes for d in primary.devices)
        for fname in draw(st.lists(st.sampled_from(
                ["gradient-as-bucket-view", "output-device", "balanced-split"]), unique=True)):
            q0, qmax = sorted([draw(peaks), draw(peaks)])
            need = qmax + (draw(st.integers(200 * MiB, 4 * GiB)) if overheads else 0)
            fixes.append(Fix(name=fname, title=fname, primary_peak_bytes=q0,
                                 max_peak_bytes=qmax, saves_bytes=p0 - q0,
                                 heaviest_saves_bytes=pmax - qmax, need_bytes=need,
                                 baseline=DP_LOSS_PRIMARY))
    base = baseline(run)
    if base is not None and measured(base) and draw(st.booleans()):  # the ladder's rungs, on any setup
        b0 = base.devices[0].peak_allocated_bytes
        bmax = max(d.peak_allocated_bytes for d in base.devices)
        for rung in draw(st.lists(st.sampled_from(
                ["ladder-bf16", "ladder-checkpoint", "ladder-accumulate",
                 "ladder-fsdp2-zero2", "ladder-fsdp2-zero3-bf16-checkpoint"]), unique=True)):
            q0, qmax = sorted([draw(peaks), draw(peaks)])
            need = qmax + (draw(st.integers(200 * MiB, 4 * GiB)) if overheads else 0)
            fixes.append(Fix(name=rung, title=rung, primary_peak_bytes=q0,
                                 max_peak_bytes=qmax, saves_bytes=b0 - q0,
                                 heaviest_saves_bytes=bmax - qmax, need_bytes=need,
                                 baseline=base.name))
    run = dataclasses.replace(run, fixes=tuple(fixes))
    return dataclasses.replace(run, comparison=compare(run))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(results())
def test_generated_results(run: RunResult) -> None:
    check(run)
