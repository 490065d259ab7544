"""What to change: each fix read against the scenario the user ran (what it saves there,
needs, costs, whether it fits) and the policy's choice among them (:mod:`dpprof.fixes.policy`):
nothing where that scenario fits with the margin and is balanced, else the cheapest change
that lowers its heaviest GPU and fits with the margin; why each cheaper one was passed over.
The answer (:mod:`dpprof.answers.answer`) says it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dpprof.answers.answer_figures import (
    budget_bytes,
    budget_words,
    counts,
    device_label,
    heaviest,
    measured,
    need_bytes,
    primary_label,
    used,
)
from dpprof.answers.setups import (
    BASELINES,
    NOTHING,
    SETUPS,
    baseline,
    distributed_words,
)
from dpprof.fixes.fix_kind import MIN_SAVING
from dpprof.fixes.fix_registry import applies_to, as_scenario, cost_of, from_scenarios
from dpprof.fixes.policy import (
    IMBALANCE_FLOOR,
    IMBALANCE_THRESHOLD,
    LADDER_PREFIX,
    Cost,
    lines_changed,
    margin_bytes,
)
from dpprof.fixes.policy import NOTHING as NO_CHANGE
from dpprof.result import (
    STATUS_OK,
    Fix,
    FixAnswer,
    PassedOver,
    RunResult,
    ScenarioResult,
)
from dpprof.scenarios.names import (
    DISTRIBUTED,
    DP_LOSS_PRIMARY,
    ONE_GPU,
    SPLIT_MODEL,
)
from dpprof.units import fmt_bytes


@dataclass
class Pick:
    """The policy's choice (:mod:`dpprof.fixes.policy`), before it is stored."""

    fix: str | None = None
    title: str = ""
    why: str = ""
    need_bytes: int | None = None
    fits: bool | None = None
    margin_bytes: int | None = None
    passed_over: list[PassedOver] = field(default_factory=list)
    on: str = ""  # where a rung runs: " on DDP", " on one GPU", ""


# ---- what to change ------------------------------------------------------------------------


def _found_fixes(run: RunResult) -> list[Fix]:
    if run.fixes:
        return list(run.fixes)
    return from_scenarios(run)


def fix_answers(run: RunResult, base: ScenarioResult) -> list[FixAnswer]:
    """Each fix that changes the baseline's setup, measured against the baseline (the
    scenario the user ran): what it saves, needs and costs, in the policy's order."""
    out = []
    was_top = heaviest(base)
    found = _found_fixes(run)
    for f in found:
        applies = BASELINES if f.name.startswith(LADDER_PREFIX) else applies_to(f.name)
        if base.name not in applies:
            continue
        if as_scenario(f.name) == base.name or f.max_peak_bytes is None:
            continue
        against = f.baseline or DP_LOSS_PRIMARY
        if against == base.name and f.heaviest_saves_bytes is not None:
            saving = f.heaviest_saves_bytes
        elif run.backend == "emulated":  # the fix's figures come from the same emulation
            saving = was_top.peak_allocated_bytes - f.max_peak_bytes
        else:  # measured and emulated bytes never mix
            continue
        primary = None
        if f.primary_peak_bytes is not None and run.backend == "emulated":
            primary = used(base)[0].peak_allocated_bytes - f.primary_peak_bytes
        elif against == base.name:
            primary = f.saves_bytes
        need = _fix_need(run, f)
        cost = cost_of(f.name)
        cap = budget_bytes(run, base)
        fits = None if need is None else need <= cap
        if need is None and f.max_peak_bytes > cap:
            fits = False  # its allocated peak alone is more than the GPU
        if fits and need is not None and cap - need < cost.understated * need:
            fits = None  # within what its need may be understated by: not known to fit
        out.append(FixAnswer(
            fix=f.name, title=f.title, baseline=base.name, heaviest_saves_bytes=saving,
            primary_saves_bytes=primary, max_peak_bytes=f.max_peak_bytes, need_bytes=need,
            fits=fits,
            spare_bytes=None if need is None else cap - need,
            cost_rank=cost.rank, cost=_cost_words(cost, f, added := _step_time_added(
                base, run.scenario(as_scenario(f.name) or ""), f)),
            step_time_cost_s=cost.step_time_s if added is None else added,
            why=""))
    out.sort(key=lambda a: a.cost_rank)  # stable: the registry's order among equals
    by_name = {f.name: f for f in found}
    return [dataclasses.replace(a, why=_why_fix(run, by_name[a.fix], base, a)) for a in out]


def _fix_need(run: RunResult, f: Fix) -> int | None:
    """What the fix's fullest GPU needs, counted as the out-of-memory check counts it: its
    own figure, else its scenario's (where it is one the run measured), else (where the
    run counts allocated memory only) its allocated peak."""
    if f.need_bytes is not None:
        return f.need_bytes
    own = run.scenario(as_scenario(f.name) or "")
    if measured(own):
        assert own is not None
        return need_bytes(own)
    if counts(run).startswith("allocated"):
        return f.max_peak_bytes
    return None


def _step_time_added(base: ScenarioResult, own: ScenarioResult | None,
                     fix: Fix) -> float | None:
    """What the fix's scenario (else the fix's own run: a rung, a variant) adds to the
    baseline's predicted step (negative: it saves); None where either was not predicted."""
    if own is not None:
        step = own.predicted_step_time_s if own.status == STATUS_OK else None
    else:
        step = fix.predicted_step_time_s
    if step is None or base.predicted_step_time_s is None:
        return None
    return step - base.predicted_step_time_s


def _cost_words(cost: Cost, f: Fix, added_s: float | None = None) -> str:
    lines = lines_changed(f.code)
    words = (f.change or cost.change) + (f" ({lines} lines changed)" if lines else "")
    words += f"; step time: {cost.step_time}" if cost.step_time else ""
    if added_s is not None:
        words += f" (predicted {added_s * 1e3:+.1f} ms a step)"
    return words


def within_noise(a: FixAnswer) -> bool:
    """A saving (or a loss) under :data:`MIN_SAVING` of the heaviest GPU: a loss tensor."""
    top = a.max_peak_bytes or 0
    return abs(a.heaviest_saves_bytes) < MIN_SAVING * (top + max(a.heaviest_saves_bytes, 0))


def _why_fix(run: RunResult, f: Fix, base: ScenarioResult, a: FixAnswer) -> str:
    """The fix's sentence: its detail, what it does to the baseline's heaviest GPU and
    cuda:0, what its fullest GPU needs and whether that fits, and what it costs."""
    detail = f.detail.rstrip(".") + "." if f.detail else ""
    top = fmt_bytes(f.max_peak_bytes)
    saving, primary = a.heaviest_saves_bytes, a.primary_saves_bytes
    if saving >= 0:
        effect = f"Against {base.name}: the heaviest GPU peaks at {top}, {fmt_bytes(saving)} less"
    else:
        effect = (f"Against {base.name}: it makes the heaviest GPU worse, {top} at its peak, "
                  f"{fmt_bytes(-saving)} more")
    if primary is not None and primary != saving:
        gpu = primary_label(base)
        effect += (f"; {gpu} {fmt_bytes(primary)} less" if primary >= 0
                   else f"; {gpu} {fmt_bytes(-primary)} more")
    effect += "."
    cap = budget_words(run, base)
    understated = cost_of(a.fix).understated
    if a.need_bytes is None and a.fits is False:
        need = f" Its heaviest GPU alone holds more than {cap}: it does not fit."
    elif a.need_bytes is None:
        need = (f" Its fullest GPU's need (reserved memory and the CUDA context) was not "
                f"emulated, since it decides nothing (it does not lower the heaviest GPU, or a "
                f"cheaper change is the answer): whether it fits in {cap} is not known.")
    elif a.fits is None:
        need = (f" Its fullest GPU needs {fmt_bytes(a.need_bytes)} as emulated "
                f"({counted_words(run)}), {fmt_bytes(a.spare_bytes)} under {cap}: less than the "
                f"{understated:.0%} by which its need may be understated, so it may not fit.")
    elif a.fits:
        need = (f" Its fullest GPU needs {fmt_bytes(a.need_bytes)} ({counted_words(run)}): it "
                f"fits in {cap}, {fmt_bytes(a.spare_bytes)} to spare.")
    else:
        need = (f" Its fullest GPU needs {fmt_bytes(a.need_bytes)} ({counted_words(run)}): it "
                f"does not fit in {cap}.")
    return " ".join(x for x in (detail, effect) if x) + need + f" Cost: {a.cost}."


def counted_words(run: RunResult) -> str:
    return ("allocated only" if counts(run).startswith("allocated")
            else "reserved memory and the CUDA context counted")


def _margin(run: RunResult, a: FixAnswer) -> int:
    return margin_bytes(budget_bytes(run, run.scenario(a.baseline)), a.need_bytes or 0,
                        cost_of(a.fix))


def choose(run: RunResult, base: ScenarioResult | None, setup: str,
           fixes: list[FixAnswer]) -> Pick:
    """The policy (:mod:`dpprof.fixes.policy`): nothing where the scenario the user runs
    fits with the margin and is balanced; else the cheapest change that lowers its heaviest
    GPU and fits with the margin (else, the cheapest that fits at all, said to be tight)."""
    if base is None or not any(measured(s) for s in run.scenarios):
        return Pick(why="No recommendation: no scenario produced a measurement (see the "
                     "errors above).")
    if not measured(base):
        return Pick(why=f"No recommendation: {base.name}, the scenario fixes are measured "
                     "against, failed.")
    cap = budget_bytes(run, base)
    need = need_bytes(base)
    base_margin = margin_bytes(cap, need, NO_CHANGE)
    comp = run.comparison.scenarios.get(base.name)
    imbalance = comp.imbalance if comp is not None else 1.0
    fits = base.status == STATUS_OK
    roomy = fits and need + base_margin <= cap
    above_mean = int(comp.max_bytes - comp.mean_bytes) if comp is not None else 0
    slight = above_mean < IMBALANCE_FLOOR * cap  # under the floor: nothing a GPU notices
    within_ratio = imbalance <= IMBALANCE_THRESHOLD or len(used(base)) < 2
    balanced_enough = within_ratio or slight
    if roomy and balanced_enough:
        balance = (f"its heaviest GPU is {imbalance:.2f}x the mean, within the policy's "
                   f"{IMBALANCE_THRESHOLD:.2f}x" if within_ratio else
                   f"its heaviest GPU, {imbalance:.2f}x the mean, is above it by less than "
                   f"the policy's {IMBALANCE_FLOOR:.0%} of the GPU (what the imbalance costs "
                   "at a larger batch: dpprof maxbatch)")
        return Pick(why=(
            f"Nothing to change: {base.name} fits, its fullest GPU needs {fmt_bytes(need)} of "
            f"{budget_words(run, base)} ({counted_words(run)}), and {balance}."),
            need_bytes=need, fits=True, margin_bytes=base_margin)
    helpful = [a for a in fixes if a.heaviest_saves_bytes > 0 and not within_noise(a)
               and a.fits is True]
    chosen = next((a for a in helpful if (a.spare_bytes or 0) >= _margin(run, a)), None)
    tight = chosen is None and bool(helpful)
    if chosen is None and helpful:
        chosen = helpful[0]
    if chosen is None:
        return Pick(why=_nothing_fits(run, base, setup, fixes, fits), fits=fits,
                     need_bytes=need, passed_over=[_passed(run, a) for a in fixes])
    margin = _margin(run, chosen)
    passed = [_passed(run, a) for a in fixes if a.cost_rank < chosen.cost_rank
              or (a.cost_rank == chosen.cost_rank and fixes.index(a) < fixes.index(chosen))]
    room = (f"{fmt_bytes(chosen.spare_bytes)} to spare, the margin the policy asks being "
            f"{fmt_bytes(margin)}" if not tight else
            f"only {fmt_bytes(chosen.spare_bytes)} to spare, under the margin of "
            f"{fmt_bytes(margin)} the policy asks (no change measured leaves that much)")
    why = (f"The cheapest change measured that fits: its fullest GPU needs "
           f"{fmt_bytes(chosen.need_bytes)} of {budget_words(run, base)} ({room}); against "
           f"{base.name} "
           f"the heaviest GPU is {fmt_bytes(chosen.heaviest_saves_bytes)} lower. Cost: "
           f"{chosen.cost}.")
    if not fits:
        why = f"{base.name} does not fit ({fmt_bytes(need)} needed). " + why
    elif not balanced_enough:
        why = (f"{base.name} fits but its heaviest GPU is {imbalance:.2f}x the mean, above "
               f"the policy's {IMBALANCE_THRESHOLD:.2f}x. " + why)
    else:
        why = (f"{base.name} fits with {fmt_bytes(cap - need)} to spare, under the "
               f"margin of {fmt_bytes(base_margin)}. " + why)
    return Pick(fix=chosen.fix, title=chosen.title, why=why, need_bytes=chosen.need_bytes,
                 fits=True, margin_bytes=margin, passed_over=passed,
                 on=where_it_runs(run, chosen.fix))


def needs_wanted(run: RunResult) -> list[str]:
    """The fixes whose need is not known and could change the answer: those that lower the
    heaviest GPU of the scenario the user ran and are cheaper than the change the policy
    picks (every one, where it picks none), unless the scenario itself needs no change.
    A comparison emulates their needs (:func:`dpprof.measure.fix_savings.fill_needs`) before it
    settles the answer; the others' needs decide nothing and cost a scenario each."""
    base = baseline(run)
    if base is None or not measured(base):
        return []
    setup = SETUPS.get(base.name, NOTHING)
    fixes = fix_answers(run, base)
    pick = choose(run, base, setup, fixes)
    if pick.fix is None and pick.fits and not pick.passed_over:
        return []  # it fits with the margin and is balanced: nothing to change
    rank = next((a.cost_rank for a in fixes if a.fix == pick.fix), None)
    return [a.fix for a in fixes if a.need_bytes is None and a.fits is not False
            and a.heaviest_saves_bytes > 0 and not within_noise(a)
            and (rank is None or a.cost_rank < rank)]


def where_it_runs(run: RunResult, name: str) -> str:
    """Where a rung runs, as the verdict says it: FSDP2's replace DDP; the others run on
    DDP, on one GPU, or on the run ``dpprof run`` changed (config ``ladder_on``)."""
    if not name.startswith(LADDER_PREFIX) or "fsdp2" in name:
        return ""
    return " on " + (run.config.get("ladder_on") or ("DDP" if run.gpus > 1 else "one GPU"))


def _passed(run: RunResult, a: FixAnswer) -> PassedOver:
    """Why a change is not the answer."""
    cap_words = budget_words(run, run.scenario(a.baseline))
    if a.heaviest_saves_bytes < 0 and not within_noise(a):
        reason = (f"it makes the heaviest GPU of {a.baseline} worse "
                  f"({fmt_bytes(-a.heaviest_saves_bytes)} more)")
    elif a.heaviest_saves_bytes <= 0 or within_noise(a):
        reason = (f"it does not lower the heaviest GPU of {a.baseline} "
                  f"({fmt_bytes(abs(a.heaviest_saves_bytes))} of difference)")
    elif a.need_bytes is None and a.fits is False:
        reason = f"it does not fit: its heaviest GPU alone holds more than {cap_words}"
    elif a.need_bytes is None:
        reason = "its need (reserved memory and the CUDA context) was not measured"
    elif a.fits is None:
        reason = (f"it may not fit: its fullest GPU needs {fmt_bytes(a.need_bytes)} of "
                  f"{cap_words} as emulated, and its need may be understated by "
                  f"{cost_of(a.fix).understated:.0%}")
    elif not a.fits:
        reason = (f"it does not fit: its fullest GPU needs {fmt_bytes(a.need_bytes)} of "
                  f"{cap_words}")
    else:
        reason = (f"it fits with only {fmt_bytes(a.spare_bytes)} to spare, under the margin "
                  f"of {fmt_bytes(_margin(run, a))}")
    return PassedOver(fix=a.fix, title=a.title, reason=reason)


def _nothing_fits(run: RunResult, base: ScenarioResult, setup: str, fixes: list[FixAnswer],
                  fits: bool) -> str:
    """Why nothing is recommended where something would be wanted."""
    if setup == SPLIT_MODEL and not fixes:
        return ("No fix of dpprof's applies: the script places its layers on the GPUs "
                f"itself (model parallel); its heaviest GPU is {device_label(heaviest(base))}.")
    if setup == ONE_GPU and not fixes:
        return "No fix applies: the step runs on one GPU."
    if setup == DISTRIBUTED and not fixes and fits:
        return (f"Nothing to change: {distributed_words(base.name)} already gives every GPU "
                "its own share.")
    if not fits:
        if fixes:
            return (f"Nothing measured fits in {budget_words(run, base)}: no change "
                    f"measured lowers {base.name}'s heaviest GPU enough (see below).")
        return (f"Nothing measured fits in {budget_words(run, base)}, and no change "
                "was measured (the fixes and the ladder were not run).")
    if fixes:
        return (f"Nothing to change: no change measured here lowers the heaviest GPU's peak "
                f"under {base.name} and fits (see below).")
    return "Nothing to change: no change was measured against it."
