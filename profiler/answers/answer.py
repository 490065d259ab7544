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
after the scenarios. The figures it reads are :mod:`dpprof.answers.answer_figures`; the
scenario that stands for the user's run, :mod:`dpprof.answers.setups`; the policy's choice
of a change, :mod:`dpprof.answers.recommendation`; why cuda:0 is heavier and what removes
it, :mod:`dpprof.answers.remedy`; what ``dpprof watch`` says,
:mod:`dpprof.answers.post_mortem`.
"""

from __future__ import annotations

import dataclasses
import statistics

from dpprof.answers.answer_figures import (
    balanced,
    budget_words,
    counts,
    device_label,
    excess_over_median,
    heaviest,
    measured,
    need_bytes,
    primary_label,
    used,
)
from dpprof.answers.attribution import why_heavier
from dpprof.answers.comparison import compare
from dpprof.answers.post_mortem import post_mortem, watch_verdict
from dpprof.answers.recommendation import Pick, choose, fix_answers
from dpprof.answers.remedy import attribution_of, explains, remedy
from dpprof.answers.setups import (
    ALTERNATIVE_WORDS,
    MAXBATCH,
    NOTHING,
    SETUPS,
    WATCH,
    baseline,
    distributed_words,
)
from dpprof.fixes.fix_kind import MIN_SAVING
from dpprof.result import (
    STATUS_OK,
    STATUS_OOM,
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
)
from dpprof.units import fmt_bytes

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
    fixes = fix_answers(run, base) if base is not None and measured(base) else []
    pick = choose(run, base, setup, fixes)
    explained = tuple(s.name for s in run.scenarios if explains(run, s))
    why = {name: why_heavier(att, remedy(run, att, fixes, pick.fix),
                             primary_label(run.scenario(name)))
           for name in explained
           if (att := run.attribution.get(name) or attribution_of(run, name)) is not None}
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


def _verdict(run: RunResult, base: ScenarioResult | None, pick: Pick) -> tuple[str, str, str]:
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
        limited = all(s.allocator_limit_bytes is not None for s in ooms)
        clause = ("out of memory: " if limited else
                  f"out of memory at {fmt_bytes(run.gpu_memory_bytes)} per GPU: ") + ", ".join(
            (f"{s.name} (cuda:{s.oom_device} needs {fmt_bytes(s.oom_bytes or 0)} of reserve, "
             f"its memory fraction allows {fmt_bytes(s.allocator_limit_bytes)})")
            if s.allocator_limit_bytes is not None and s.oom_device is not None else
            f"{s.name} (cuda:{s.oom_device} {verb} "
            f"{fmt_bytes(s.oom_bytes or need_bytes(s))})" if s.oom_device is not None
            else s.name for s in ooms)
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
                    f"{budget_words(run, base)} ({counts(run)})")
    if failed:
        tail.append(f"failed: {', '.join(failed)}")
    if pick.fix is not None:
        tail.append(f"recommended: {pick.title}{pick.on}, the cheapest change measured that "
                    "fits (the code is below)")
    elif measured(base) and pick.why:
        # "nothing to change" only where what the user runs fits as it is
        tail.append("recommended: nothing to change" if pick.fits else
                    "no recommendation: no change measured fits")
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


def _all(gpus: int) -> str:
    """``gpus`` GPUs, all of them, in words: "both GPUs", "all 4 GPUs"."""
    return "both GPUs" if gpus == 2 else f"all {gpus} GPUs" if gpus > 2 else "its one GPU"


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
            rows = s.batch or run.batch
            why = (f" (a batch of {rows} row{'s' if rows != 1 else ''} splits no further)"
                   if rows and rows < len(s.devices) else "")
            return (f"under {s.name} DataParallel runs on one GPU, {device_label(top)}, "
                    f"peaking at {fmt_bytes(top.peak_allocated_bytes)}{why}")
        excess = c.primary_excess_bytes if c else int(excess_over_median(
            devs[0].peak_allocated_bytes, [d.peak_allocated_bytes for d in devs[1:]]))
        imbalance = f" ({c.imbalance:.2f}x the mean)" if c else ""
        gpu = primary_label(s)  # DataParallel's first device: cuda:0 unless named otherwise
        if balanced(excess, top.peak_allocated_bytes):
            return (f"under {s.name} {gpu} is within {fmt_bytes(abs(excess))} of the other "
                    f"GPUs; the heaviest peaks at {fmt_bytes(top.peak_allocated_bytes)}")
        if excess < 0:
            return (f"under {s.name} {gpu} holds {fmt_bytes(-excess)} less than the other "
                    f"GPUs; the heaviest, {device_label(top)}, peaks at "
                    f"{fmt_bytes(top.peak_allocated_bytes)}")
        return f"{gpu} needs {fmt_bytes(excess)} more than the other GPUs under {s.name}" \
               + imbalance
    if setup == DISTRIBUTED:
        who = distributed_words(s.name)
        if len(devs) < 2:
            return f"{who} runs one rank, peaking at {fmt_bytes(top.peak_allocated_bytes)}"
        mean = statistics.fmean(d.peak_allocated_bytes for d in devs)
        if s.status == STATUS_OOM:
            return f"{who} spreads the step over {len(devs)} GPUs"
        if balanced(top.peak_allocated_bytes - mean, top.peak_allocated_bytes):
            return f"{who} balances {_all(len(devs))} at {fmt_bytes(top.peak_allocated_bytes)}"
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
        words = (f"DDP balances {_all(len(devs))} at {fmt_bytes(now)}"
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
