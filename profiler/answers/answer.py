"""The one answer of a result: its verdict, what to change, and the notes beside them.

:func:`build_answer` is the only place that composes these sentences, for every command
(``compare``, ``run``, ``maxbatch``, ``watch``, ``report``) and every format: the renderers
show the :class:`~dpprof.result.Recommendation` it returns, which each command derives once
into its result (:func:`settled`; a result saved before that has it built when read,
:func:`answer_of`). Its rules:

* the recommendation follows the policy by cost (:mod:`dpprof.fixes.policy`): nothing
  where the scenario the user runs fits with a margin and is balanced, else the cheapest
  change that lowers its heaviest GPU and fits with the margin; the cheaper changes passed
  over say why;

* a scenario that is out of memory is never offered as the answer: the verdict names what
  fits, counting what the out-of-memory check counts (:func:`need_bytes`), and what each
  fit needs;
* a fix is measured against a scenario the user ran (:func:`baseline`) and recommended only
  where it lowers that scenario's heaviest GPU; one that raises it says so;
* the words fit the setup (DataParallel, DDP, model parallel, one GPU): "why cuda:0 is
  heavier" is explained for DataParallel scenarios whose cuda:0 is heavier, and nowhere else;
* nothing is claimed that was not measured: a figure is named for what it counts (allocated
  only, or reserved memory and the CUDA context where they were emulated or measured).

The answer fields a comparison computes (attribution, fixes, largest batch, equivalence, the
``--fail-on-*`` checks) are filled by :func:`dpprof.measure.answer_fields.add_answers`, run
after the scenarios. The figures it reads are :mod:`dpprof.answers.answer_figures`; what
``dpprof watch`` says, :mod:`dpprof.answers.post_mortem`.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field

from dpprof.answers.answer_figures import (
    balanced,
    counts,
    device_label,
    excess_over_median,
    heaviest,
    measured,
    need_bytes,
    used,
)
from dpprof.answers.attribution import attribute, lead_causes, why_heavier
from dpprof.answers.comparison import compare
from dpprof.answers.post_mortem import post_mortem, watch_verdict
from dpprof.fixes.fix_kind import MIN_SAVING
from dpprof.fixes.fix_registry import applies_to, as_scenario, from_scenarios
from dpprof.fixes.policy import (
    IMBALANCE_THRESHOLD,
    LADDER_PREFIX,
    Cost,
    cost_of,
    lines_changed,
    margin_bytes,
)
from dpprof.fixes.policy import NOTHING as NO_CHANGE
from dpprof.result import (
    STATUS_OK,
    STATUS_OOM,
    Attribution,
    Fix,
    FixAnswer,
    PassedOver,
    Recommendation,
    RunResult,
    ScenarioResult,
    WatchResult,
)
from dpprof.scenarios.names import (
    DATA_PARALLEL,
    DISTRIBUTED,
    DP_LOSS_PRIMARY,
    ONE_GPU,
    SPLIT_MODEL,
)
from dpprof.scenarios.registry import REGISTRY
from dpprof.units import fmt_bytes

WATCH, MAXBATCH, NOTHING = "watch", "maxbatch", "none"
# each scenario's setup (dpprof.scenarios.registry: DATA_PARALLEL, DISTRIBUTED, ...)
SETUPS = {s.name: s.setup for s in REGISTRY}
# the scenario that stands for what the user runs, the first of these a result holds
BASELINES = tuple(s.name for s in REGISTRY)
# how the verdict names another scenario the user ran, against the baseline
ALTERNATIVE_WORDS = {s.name: s.alternative_words for s in REGISTRY if s.alternative_words}


# ---- the builder -------------------------------------------------------------------------


def settled(run: RunResult) -> RunResult:
    """``run`` with what is derived from its measurements: the comparison (its figures and
    the verdict), the one answer (``recommended``) and each explained attribution's
    sentence. The one place they are computed: every command calls it once its result is
    complete, and every renderer reads what it holds (saved in the JSON, for the readers
    of results)."""
    run = dataclasses.replace(run, comparison=compare(run))
    rec = build_answer(run)
    attribution = {
        name: dataclasses.replace(att, answer=rec.why_heavier[name])
        if name in rec.why_heavier else att
        for name, att in run.attribution.items()}
    return dataclasses.replace(
        run, recommended=rec, comparison=dataclasses.replace(run.comparison, verdict=rec.verdict),
        attribution=attribution)


def answer_of(run: RunResult) -> Recommendation:
    """The answer stored in ``run``; for a result saved before answers were stored, the
    answer built from it."""
    return run.recommended if run.recommended is not None else build_answer(run)


def build_answer(run: RunResult) -> Recommendation:
    """The answer of ``run``: every sentence a report or a command says about it."""
    if run.watch is not None:
        return _watch_answer(run, run.watch)
    if not run.scenarios and run.maxbatch is not None:
        return _maxbatch_answer(run)
    base = baseline(run)
    setup = SETUPS.get(base.name, NOTHING) if base is not None else NOTHING
    fixes = _fix_answers(run, base) if base is not None and measured(base) else []
    pick = _pick(run, base, setup, fixes)
    explained = tuple(s.name for s in run.scenarios if _explains(run, s))
    why = {name: why_heavier(att, _remedy(run, att, fixes, pick.fix))
           for name in explained
           if (att := run.attribution.get(name) or _attribute(run, name)) is not None}
    before, clause, after = _verdict(run, base, pick)
    verdict = _sentence(before + clause + after)
    oom = ""
    if clause:  # _sentence changes the first letter and the end only
        oom = verdict[len(before): len(before) + len(clause)]
    return Recommendation(
        verdict=verdict, verdict_oom=oom, setup=setup,
        baseline=base.name if base is not None else None, fix=pick.fix, title=pick.title,
        why=pick.why, need_bytes=pick.need_bytes, fits=pick.fits,
        margin_bytes=pick.margin_bytes, passed_over=tuple(pick.passed_over),
        fixes=tuple(fixes),
        why_heavier=why)


@dataclass
class _Pick:
    """The policy's choice (:mod:`dpprof.fixes.policy`), before it is stored."""

    fix: str | None = None
    title: str = ""
    why: str = ""
    need_bytes: int | None = None
    fits: bool | None = None
    margin_bytes: int | None = None
    passed_over: list[PassedOver] = field(default_factory=list)
    on: str = ""  # where a rung runs: " on DDP", " on one GPU", ""


def baseline(run: RunResult) -> ScenarioResult | None:
    """The scenario that stands for what the user runs: DataParallel with the loss on cuda:0
    where it was measured, else the first of :data:`BASELINES` measured; of a result that
    measured none, its first scenario."""
    for name in BASELINES:
        s = run.scenario(name)
        if measured(s):
            return s
    return run.scenarios[0] if run.scenarios else None


def _sentence(text: str) -> str:
    text = text.strip()
    if not text:
        return text
    if not text.startswith("cuda"):
        text = text[0].upper() + text[1:]
    return text if text.endswith(".") else text + "."


def partial_sentence(run: RunResult) -> str:
    """What an interrupted comparison holds (``run.interrupted``), or ""."""
    if not run.interrupted:
        return ""
    if run.config.get("command") == "run":
        steps = (run.config.get("steps_done") or {}).get("as-written", 0)
        during = run.config.get("interrupted_in") or "the script as written"
        if during == "the script as written":
            return (f"Partial result: interrupted by {run.interrupted} during the script as "
                    f"written, after {steps} optimizer step(s); no alternative was run.")
        return (f"Partial result: interrupted by {run.interrupted} during {during}, after "
                f"the script as written ran {steps} optimizer step(s); what was not run to "
                "its end is not compared.")
    done = ", ".join(s.name for s in run.scenarios) or "none"
    asked = run.config.get("scenarios") or []
    return (f"Partial result: interrupted by {run.interrupted} after {len(run.scenarios)} of "
            f"{len(asked) or '?'} scenarios ({done}).")


def _verdict(run: RunResult, base: ScenarioResult | None, pick: _Pick) -> tuple[str, str, str]:
    """(before, the out-of-memory clause, after) of the verdict; it ends with the
    recommended change, the one every format shows."""
    partial = partial_sentence(run)
    prefix = partial + " " if partial else ""
    if base is None:
        return prefix + "no scenario was run", "", ""
    script = run.config.get("command") == "run"
    head = _headline(run, base) if measured(base) or script else (
        "no scenario produced a measurement")
    others = [s for s in run.scenarios if s is not base and measured(s)
              and s.status == STATUS_OK and s.name in ALTERNATIVE_WORDS]
    parts = [head] + [c for s in others if (c := _alternative(base, s))]
    ooms = [s for s in run.scenarios if measured(s) and s.status == STATUS_OOM]
    fits = [s for s in run.scenarios if measured(s) and s.status == STATUS_OK]
    failed = [s.name for s in run.scenarios if not measured(s) and (s is not base or not script)]
    tail: list[str] = []
    clause = ""
    if ooms:
        verb = "tried to allocate" if run.backend == "cuda" else "needs"
        clause = (f"out of memory at {fmt_bytes(run.gpu_memory_bytes)} per GPU: " + ", ".join(
            f"{s.name} (cuda:{s.oom_device} {verb} "
            f"{fmt_bytes(s.oom_bytes or need_bytes(s))})" if s.oom_device is not None
            else s.name for s in ooms))
        if len(fits) == 1:
            tail.append(f"only {fits[0].name} fits: {_fit_cost(run, fits[0], 'its')} "
                        f"({counts(run)})")
        elif fits:
            tail.append(f"{', '.join(s.name for s in fits)} fit: " + ", ".join(
                f"{s.name}: {_fit_cost(run, s, 'the')}" for s in fits) + f" ({counts(run)})")
        else:
            lightest = min(ooms, key=need_bytes)
            tail.append(f"none of the scenarios run fits: the lightest, {lightest.name}, "
                        f"needs {fmt_bytes(need_bytes(lightest))} on its fullest GPU "
                        f"({counts(run)})")
    elif measured(base) and len(run.scenarios) == 1:
        tail.append(f"it fits: the fullest GPU needs {fmt_bytes(need_bytes(base))} of "
                    f"{fmt_bytes(run.gpu_memory_bytes)} ({counts(run)})")
    if failed:
        tail.append(f"failed: {', '.join(failed)}")
    if pick.fix is not None:
        tail.append(f"recommended: {pick.title}{pick.on}, the cheapest change measured that "
                    "fits (the code is below)")
    elif measured(base) and (pick.fix is None) and pick.why:
        tail.append("recommended: nothing to change")
    before = prefix + "; ".join(parts)
    after = "".join("; " + t for t in tail)
    if clause:
        return before + "; ", clause, after
    return before + after, "", ""


def _fit_cost(run: RunResult, s: ScenarioResult, article: str) -> str:
    cost = f"{article} fullest GPU needs {fmt_bytes(need_bytes(s))}"
    if SETUPS.get(s.name) == ONE_GPU and s.batch and s.batch < run.batch:
        cost += f" (one GPU, {s.batch} of the {run.batch} rows)"
    return cost


def _distributed_words(name: str) -> str:
    """How the verdict names a one-process-per-GPU scenario: DDP, or FSDP2 for a script that
    shards its model with fully_shard."""
    return ALTERNATIVE_WORDS.get(name) or "DDP"


def _placement(s: ScenarioResult) -> str:
    return ", ".join(f"{device_label(d)} ({fmt_bytes(d.peak_allocated_bytes)})" for d in used(s))


def _headline(run: RunResult, s: ScenarioResult) -> str:
    """The first clause: what the baseline scenario does, in its setup's words."""
    script = run.config.get("command") == "run"
    devs = used(s)
    if not measured(s):
        if not any(d.peak_allocated_bytes for d in devs):
            who = "the script" if script else s.name
            return f"{who} failed before it put anything on a GPU: {s.message}"
        top = heaviest(s)
        what = s.message if script and s.message.startswith("the script") else (
            f"{s.name} failed ({s.message})")
        return (f"{what}; up to the failure it peaked at {fmt_bytes(top.peak_allocated_bytes)} "
                f"on {device_label(top)}")
    c = run.comparison.scenarios.get(s.name)
    top = heaviest(s)
    setup = SETUPS.get(s.name)
    if setup == DATA_PARALLEL:
        if len(devs) < 2:
            return f"{s.name} uses a single GPU at this batch size"
        excess = c.primary_excess_bytes if c else int(excess_over_median(
            devs[0].peak_allocated_bytes, [d.peak_allocated_bytes for d in devs[1:]]))
        imbalance = f" ({c.imbalance:.2f}x the mean)" if c else ""
        if balanced(excess, top.peak_allocated_bytes):
            return (f"under {s.name} cuda:0 is within {fmt_bytes(abs(excess))} of the other "
                    f"GPUs; the heaviest peaks at {fmt_bytes(top.peak_allocated_bytes)}")
        if excess < 0:
            return (f"under {s.name} cuda:0 holds {fmt_bytes(-excess)} less than the other "
                    f"GPUs; the heaviest, {device_label(top)}, peaks at "
                    f"{fmt_bytes(top.peak_allocated_bytes)}")
        return f"cuda:0 needs {fmt_bytes(excess)} more than the other GPUs under {s.name}" \
               + imbalance
    if setup == DISTRIBUTED:
        who = _distributed_words(s.name)
        if len(devs) < 2:
            return f"{who} runs one rank, peaking at {fmt_bytes(top.peak_allocated_bytes)}"
        mean = statistics.fmean(d.peak_allocated_bytes for d in devs)
        if s.status == STATUS_OOM:
            return f"{who} spreads the step over {len(devs)} GPUs"
        if balanced(top.peak_allocated_bytes - mean, top.peak_allocated_bytes):
            return f"{who} balances all {len(devs)} GPUs at {fmt_bytes(top.peak_allocated_bytes)}"
        return (f"under {who} the heaviest of the {len(devs)} GPUs, {device_label(top)}, peaks at "
                f"{fmt_bytes(top.peak_allocated_bytes)} ({top.peak_allocated_bytes / mean:.2f}x "
                "the mean)")
    if len(devs) == 1:
        who = "the script" if script else s.name
        return f"{who} peaks at {fmt_bytes(top.peak_allocated_bytes)} on {device_label(top)}"
    who = "the script places its work" if script else "the model places its work"
    return f"{who} on {_placement(s)}; the heaviest is {device_label(top)}"


def _alternative(base: ScenarioResult, s: ScenarioResult) -> str:
    """One clause: what another scenario the user ran does to the baseline's heaviest GPU."""
    if not measured(base) or SETUPS.get(base.name) == ONE_GPU:
        return ""
    was = heaviest(base).peak_allocated_bytes
    now = heaviest(s).peak_allocated_bytes
    words = ALTERNATIVE_WORDS[s.name]
    if SETUPS.get(s.name) == DISTRIBUTED:
        devs = used(s)
        words = (f"DDP balances all {len(devs)} GPUs at {fmt_bytes(now)}"
                 if balanced(now - statistics.fmean(d.peak_allocated_bytes for d in devs), now)
                 else f"DDP's heaviest GPU peaks at {fmt_bytes(now)}")
        if abs(was - now) < MIN_SAVING * max(was, now):
            return f"{words}, about the same as under {base.name}"
        if now < was:
            return f"{words}, {fmt_bytes(was - now)} less than the heaviest under {base.name}"
        buckets = heaviest(s).breakdown_bytes.get("communication", 0)
        why = (f" (its gradient buckets hold {fmt_bytes(buckets)} at its peak: a second copy "
               "of the gradients, which gradient_as_bucket_view=True shares with .grad)"
               if buckets else "")
        return (f"{words}, {fmt_bytes(now - was)} more than the heaviest under {base.name}"
                f"{why}")
    if abs(was - now) < MIN_SAVING * max(was, now):
        return (f"{words} does not lower the heaviest GPU ({fmt_bytes(now)} against "
                f"{fmt_bytes(was)})")
    if now < was:
        return f"{words} lowers the heaviest GPU to {fmt_bytes(now)} ({fmt_bytes(was - now)} less)"
    return f"{words} raises the heaviest GPU to {fmt_bytes(now)} ({fmt_bytes(now - was)} more)"


# ---- what to change ------------------------------------------------------------------------


def _found_fixes(run: RunResult) -> list[Fix]:
    if run.fixes:
        return list(run.fixes)
    return from_scenarios(run)


def _fix_answers(run: RunResult, base: ScenarioResult) -> list[FixAnswer]:
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
        fits = None if need is None else need <= run.gpu_memory_bytes
        if need is None and f.max_peak_bytes > run.gpu_memory_bytes:
            fits = False  # its allocated peak alone is more than the GPU
        if fits and need is not None and run.gpu_memory_bytes - need < cost.understated * need:
            fits = None  # within what its need may be understated by: not known to fit
        out.append(FixAnswer(
            fix=f.name, title=f.title, baseline=base.name, heaviest_saves_bytes=saving,
            primary_saves_bytes=primary, max_peak_bytes=f.max_peak_bytes, need_bytes=need,
            fits=fits,
            spare_bytes=None if need is None else run.gpu_memory_bytes - need,
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
    words = cost.change + (f" ({lines} lines changed)" if lines else "")
    words += f"; step time: {cost.step_time}" if cost.step_time else ""
    if added_s is not None:
        words += f" (predicted {added_s * 1e3:+.1f} ms a step)"
    return words


def _noise(a: FixAnswer) -> bool:
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
        effect += (f"; cuda:0 {fmt_bytes(primary)} less" if primary >= 0
                   else f"; cuda:0 {fmt_bytes(-primary)} more")
    effect += "."
    cap = fmt_bytes(run.gpu_memory_bytes)
    understated = cost_of(a.fix).understated
    if a.need_bytes is None and a.fits is False:
        need = f" Its heaviest GPU alone holds more than {cap}: it does not fit."
    elif a.need_bytes is None:
        need = (f" Its fullest GPU's need (reserved memory and the CUDA context) was not "
                f"emulated, since it decides nothing (it does not lower the heaviest GPU, or a "
                f"cheaper change is the answer): whether it fits in {cap} is not known.")
    elif a.fits is None:
        need = (f" Its fullest GPU needs {fmt_bytes(a.need_bytes)} as emulated "
                f"({_counted(run)}), {fmt_bytes(a.spare_bytes)} under {cap}: less than the "
                f"{understated:.0%} by which its need may be understated, so it may not fit.")
    elif a.fits:
        need = (f" Its fullest GPU needs {fmt_bytes(a.need_bytes)} ({_counted(run)}): it "
                f"fits in {cap}, {fmt_bytes(a.spare_bytes)} to spare.")
    else:
        need = (f" Its fullest GPU needs {fmt_bytes(a.need_bytes)} ({_counted(run)}): it "
                f"does not fit in {cap}.")
    return " ".join(x for x in (detail, effect) if x) + need + f" Cost: {a.cost}."


def _counted(run: RunResult) -> str:
    return ("allocated only" if counts(run).startswith("allocated")
            else "reserved memory and the CUDA context counted")


def _margin(run: RunResult, a: FixAnswer) -> int:
    return margin_bytes(run.gpu_memory_bytes, a.need_bytes or 0, cost_of(a.fix))


def _pick(run: RunResult, base: ScenarioResult | None, setup: str,
          fixes: list[FixAnswer]) -> _Pick:
    """The policy (:mod:`dpprof.fixes.policy`): nothing where the scenario the user runs
    fits with the margin and is balanced; else the cheapest change that lowers its heaviest
    GPU and fits with the margin (else, the cheapest that fits at all, said to be tight)."""
    if base is None or not any(measured(s) for s in run.scenarios):
        return _Pick(why="No recommendation: no scenario produced a measurement (see the "
                     "errors above).")
    if not measured(base):
        return _Pick(why=f"No recommendation: {base.name}, the scenario fixes are measured "
                     "against, failed.")
    cap = run.gpu_memory_bytes
    need = need_bytes(base)
    base_margin = margin_bytes(cap, need, NO_CHANGE)
    comp = run.comparison.scenarios.get(base.name)
    imbalance = comp.imbalance if comp is not None else 1.0
    fits = base.status == STATUS_OK
    roomy = fits and need + base_margin <= cap
    balanced_enough = imbalance <= IMBALANCE_THRESHOLD or len(used(base)) < 2
    if roomy and balanced_enough:
        return _Pick(why=(
            f"Nothing to change: {base.name} fits, its fullest GPU needs {fmt_bytes(need)} of "
            f"{fmt_bytes(cap)} ({_counted(run)}), and its heaviest GPU is {imbalance:.2f}x "
            f"the mean, within the policy's {IMBALANCE_THRESHOLD:.2f}x."),
            need_bytes=need, fits=True, margin_bytes=base_margin)
    helpful = [a for a in fixes if a.heaviest_saves_bytes > 0 and not _noise(a)
               and a.fits is True]
    chosen = next((a for a in helpful if (a.spare_bytes or 0) >= _margin(run, a)), None)
    tight = chosen is None and bool(helpful)
    if chosen is None and helpful:
        chosen = helpful[0]
    if chosen is None:
        return _Pick(why=_nothing_fits(run, base, setup, fixes, fits), fits=fits,
                     need_bytes=need, passed_over=[_passed(run, a) for a in fixes])
    margin = _margin(run, chosen)
    passed = [_passed(run, a) for a in fixes if a.cost_rank < chosen.cost_rank
              or (a.cost_rank == chosen.cost_rank and fixes.index(a) < fixes.index(chosen))]
    room = (f"{fmt_bytes(chosen.spare_bytes)} to spare, the margin the policy asks being "
            f"{fmt_bytes(margin)}" if not tight else
            f"only {fmt_bytes(chosen.spare_bytes)} to spare, under the margin of "
            f"{fmt_bytes(margin)} the policy asks (no change measured leaves that much)")
    why = (f"The cheapest change measured that fits: its fullest GPU needs "
           f"{fmt_bytes(chosen.need_bytes)} of {fmt_bytes(cap)} ({room}); against {base.name} "
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
    return _Pick(fix=chosen.fix, title=chosen.title, why=why, need_bytes=chosen.need_bytes,
                 fits=True, margin_bytes=margin, passed_over=passed,
                 on=_on(run, chosen.fix))


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
    fixes = _fix_answers(run, base)
    pick = _pick(run, base, setup, fixes)
    if pick.fix is None and pick.fits and not pick.passed_over:
        return []  # it fits with the margin and is balanced: nothing to change
    rank = next((a.cost_rank for a in fixes if a.fix == pick.fix), None)
    return [a.fix for a in fixes if a.need_bytes is None and a.fits is not False
            and a.heaviest_saves_bytes > 0 and not _noise(a)
            and (rank is None or a.cost_rank < rank)]


def _on(run: RunResult, name: str) -> str:
    """Where a rung runs, as the verdict says it: FSDP2's replace DDP; the others run on
    DDP, on one GPU, or on the run ``dpprof run`` changed (config ``ladder_on``)."""
    if not name.startswith(LADDER_PREFIX) or "fsdp2" in name:
        return ""
    return " on " + (run.config.get("ladder_on") or ("DDP" if run.gpus > 1 else "one GPU"))


def _passed(run: RunResult, a: FixAnswer) -> PassedOver:
    """Why a change is not the answer."""
    cap = run.gpu_memory_bytes
    if a.heaviest_saves_bytes < 0 and not _noise(a):
        reason = (f"it makes the heaviest GPU of {a.baseline} worse "
                  f"({fmt_bytes(-a.heaviest_saves_bytes)} more)")
    elif a.heaviest_saves_bytes <= 0 or _noise(a):
        reason = (f"it does not lower the heaviest GPU of {a.baseline} "
                  f"({fmt_bytes(abs(a.heaviest_saves_bytes))} of difference)")
    elif a.need_bytes is None and a.fits is False:
        reason = f"it does not fit: its heaviest GPU alone holds more than {fmt_bytes(cap)}"
    elif a.need_bytes is None:
        reason = "its need (reserved memory and the CUDA context) was not measured"
    elif a.fits is None:
        reason = (f"it may not fit: its fullest GPU needs {fmt_bytes(a.need_bytes)} of "
                  f"{fmt_bytes(cap)} as emulated, and its need may be understated by "
                  f"{cost_of(a.fix).understated:.0%}")
    elif not a.fits:
        reason = (f"it does not fit: its fullest GPU needs {fmt_bytes(a.need_bytes)} of "
                  f"{fmt_bytes(cap)}")
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
    if setup == DISTRIBUTED and not fixes:
        return (f"Nothing to change: {_distributed_words(base.name)} already gives every GPU "
                "its own share.")
    if not fits:
        if fixes:
            return (f"Nothing measured fits in {fmt_bytes(run.gpu_memory_bytes)}: no change "
                    f"measured lowers {base.name}'s heaviest GPU enough (see below).")
        return (f"Nothing measured fits in {fmt_bytes(run.gpu_memory_bytes)}, and no change "
                "was measured (the fixes and the ladder were not run).")
    if fixes:
        return (f"Nothing to change: no change measured here lowers the heaviest GPU's peak "
                f"under {base.name} and fits (see below).")
    return "Nothing to change: no change was measured against it."


# ---- why cuda:0 is heavier ------------------------------------------------------------------


def _attribute(run: RunResult, name: str) -> Attribution | None:
    s = run.scenario(name)
    return attribute(s) if s is not None else None


def _explains(run: RunResult, s: ScenarioResult) -> bool:
    """"Why cuda:0 is heavier" applies: a DataParallel scenario whose cuda:0 is heavier."""
    if SETUPS.get(s.name) != DATA_PARALLEL or not measured(s) or len(used(s)) < 2:
        return False
    att = run.attribution.get(s.name) or _attribute(run, s.name)
    if att is None:
        return False
    return att.excess_bytes > 0 and not balanced(att.excess_bytes,
                                                 used(s)[0].peak_allocated_bytes)


# the change that removes each kind of cause, and what it does, in words
LOSS_SIDE = {"gathered_outputs", "loss", "phase_loss", "phase_forward"}
STATE_SIDE = {"optimizer_state", "reduced_gradients", "master_parameters", "phase_backward",
              "phase_optimizer"}
REMEDY_WORDS = {
    "loss-in-forward": "computing the loss inside forward (dpprof.ModelWithLoss) removes it",
    "ddp": ("the loss is not the problem: DataParallel keeps the parameters, gradients and "
            "optimizer state on cuda:0 only; DDP gives every GPU its own"),
    "balanced-split": "a smaller share of the batch on cuda:0 (or a batch divisible by the "
                      "GPU count) removes it",
    "input-batch": "moving the inputs straight to their GPUs (DDP) removes it",
}


def _remedy(run: RunResult, att: Attribution, fixes: list[FixAnswer], picked: str | None
            ) -> str:
    """What removes the lead cause of ``att``, and what it was measured to do here (never
    advised where it was measured to make the heaviest GPU worse or not to fit)."""
    lead = lead_causes(att)
    if not lead:
        return ""
    first = lead[0]
    kind = ("loss-in-forward" if first in LOSS_SIDE else "balanced-split"
            if first == "larger_shard" else "input-batch" if first == "input_batch" else "ddp")
    words = REMEDY_WORDS[kind]
    fix_name = "ddp" if kind == "input-batch" else kind
    here = run.scenario(att.scenario)
    own = as_scenario(fix_name)
    other = run.scenario(own) if own else None
    if here is not None and measured(here) and measured(other) and other is not here:
        assert other is not None
        was, now = heaviest(here).peak_allocated_bytes, heaviest(other).peak_allocated_bytes
        if now > was and not abs(now - was) < MIN_SAVING * max(was, now):
            words += (f"; measured here, {other.name} is heavier: its heaviest GPU peaks at "
                      f"{fmt_bytes(now)}, {fmt_bytes(now - was)} more than under {here.name}")
        elif abs(now - was) < MIN_SAVING * max(was, now):
            words += f"; measured here, {other.name} does not lower the heaviest GPU"
        if other.status == STATUS_OOM:
            words += f"; {other.name} does not fit (it needs {fmt_bytes(need_bytes(other))})"
    else:
        answer = next((f for f in fixes if f.fix == fix_name and f.baseline == att.scenario),
                      None)
        if answer is not None and answer.heaviest_saves_bytes < 0 and not _noise(answer):
            words += (f"; measured here, it makes the heaviest GPU worse "
                      f"({fmt_bytes(-answer.heaviest_saves_bytes)} more)")
        elif answer is not None and answer.fits is False:
            words += f"; measured here, it does not fit (it needs {fmt_bytes(answer.need_bytes)})"
        elif answer is None and not other:
            words += " (not measured here)"
    if picked is not None and fixes and att.scenario == fixes[0].baseline:
        title = next((f.title for f in fixes if f.fix == picked), picked)
        words += ("; it is the recommended change (below)" if picked == fix_name else
                  f"; the recommended change is {title} (below)")
    return words


# ---- maxbatch ------------------------------------------------------------------------------


def maxbatch_ratio(run: RunResult) -> tuple[str, int, int, float] | None:
    """(the scenario that fits the largest batch, that batch, dp-loss-primary's largest, their
    ratio) where both fit some batch and the best is not dp-loss-primary itself."""
    if run.maxbatch is None:
        return None
    fitting = [e for e in run.maxbatch.entries if e.max_batch and not e.errored]
    prim = next((e.max_batch for e in fitting if e.scenario == DP_LOSS_PRIMARY), None)
    best = max(fitting, key=lambda e: e.max_batch or 0, default=None)
    if best is None or not prim or best.scenario == DP_LOSS_PRIMARY or not best.max_batch:
        return None
    return best.scenario, best.max_batch, prim, best.max_batch / prim


def _maxbatch_answer(run: RunResult) -> Recommendation:
    mb = run.maxbatch
    assert mb is not None
    cells = []
    for e in mb.entries:
        if e.errored:
            cells.append(f"{e.scenario} errored")
        elif e.max_batch is None:
            cells.append(f"{e.scenario} fits no batch")
        else:
            need = f" (needs {fmt_bytes(e.needed_bytes)})" if e.needed_bytes else ""
            cells.append(f"{e.scenario} {'at least ' if e.capped else ''}{e.max_batch}{need}")
    gpu = f" ({mb.gpu})" if mb.gpu else ""
    text = (f"Largest global batch on {run.gpus} GPUs of {fmt_bytes(mb.capacity_bytes)}{gpu}, "
            f"multiples of {mb.multiple_of}: " + (", ".join(cells) or "no scenario searched"))
    ratio = maxbatch_ratio(run)
    if ratio is not None:
        text += (f"; {ratio[0]} fits the largest, {ratio[3]:.2f}x the batch of "
                 f"{DP_LOSS_PRIMARY} ({ratio[1]} vs {ratio[2]})")
    fitting = [e for e in mb.entries if e.max_batch]
    best = max(fitting, key=lambda e: e.max_batch or 0) if fitting else None
    why = ("No recommendation: no scenario fits a batch." if best is None else
           f"{best.scenario} fits the largest batch ({best.max_batch}).")
    return Recommendation(verdict=_sentence(text), setup=MAXBATCH, why=why)


# ---- watch ---------------------------------------------------------------------------------


def _watch_answer(run: RunResult, w: WatchResult) -> Recommendation:
    c = next(iter(run.comparison.scenarios.values()), None)
    return Recommendation(verdict=watch_verdict(w, c.imbalance if c else None), setup=WATCH,
                          why=" ".join(w.post_mortem or post_mortem(w)[0]))
