"""The one answer of a result: its verdict, what to change, and the notes beside them.

:func:`build_answer` is the only place that composes these sentences, for every command
(``compare``, ``run``, ``maxbatch``, ``watch``, ``report``) and every format: the renderers
show its :class:`Answer`, the commands store its verdict in the result. Its rules:

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

import statistics
from collections.abc import Mapping
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
from dpprof.answers.attribution import attribute, why_heavier
from dpprof.answers.post_mortem import post_mortem, watch_verdict
from dpprof.fixes.fix_kind import MIN_SAVING
from dpprof.fixes.fix_registry import applies_to, as_scenario, from_scenarios
from dpprof.result import (
    STATUS_OK,
    STATUS_OOM,
    Attribution,
    Fix,
    RunResult,
    ScenarioResult,
    WatchResult,
)
from dpprof.scenarios.names import (
    DATA_PARALLEL,
    DDP,
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
# the ladder's rungs (dpprof.measure.ladder): names start with this; they apply to every setup
LADDER_PREFIX = "ladder-"
# how the verdict names another scenario the user ran, against the baseline
ALTERNATIVE_WORDS = {s.name: s.alternative_words for s in REGISTRY if s.alternative_words}


@dataclass(frozen=True)
class Advice:
    """A fix against the baseline scenario: what it saves there, whether it fits."""

    fix: Fix
    baseline: str
    heaviest_saves_bytes: int  # the baseline's heaviest GPU minus the fix's (allocated)
    primary_saves_bytes: int | None  # the same on cuda:0
    fits: bool | None  # None: the fix's reserved memory and context were not emulated
    why: str  # its detail, what it saves, and what is not known


@dataclass(frozen=True)
class Answer:
    """What every format says about a result (see the module docstring)."""

    setup: str  # DATA_PARALLEL, DISTRIBUTED, SPLIT_MODEL, ONE_GPU, WATCH, MAXBATCH, NOTHING
    verdict: str
    verdict_parts: tuple[str, str, str] | None  # (before, the out-of-memory clause, after)
    baseline: str | None  # the scenario fixes are measured against
    recommended: tuple[Advice, ...]  # lower the baseline's heaviest GPU; first: the answer
    worse: tuple[Advice, ...]  # raise it
    nothing_to_change: str  # what "what to change" says when nothing is recommended
    explained: tuple[str, ...]  # scenarios whose "why cuda:0 is heavier" applies
    why: Mapping[str, str] = field(default_factory=dict)  # scenario -> one sentence
    notes: tuple[str, ...] = ()
    post_mortem: tuple[str, ...] = ()  # watch: what happened at the out-of-memory error
    next_steps: tuple[str, ...] = ()  # watch: the dpprof checks to run next


# ---- the builder -------------------------------------------------------------------------


def build_answer(run: RunResult) -> Answer:
    """The answer of ``run``: every sentence a report or a command says about it."""
    if run.watch is not None:
        return _watch_answer(run, run.watch)
    if not run.scenarios and run.maxbatch is not None:
        return _maxbatch_answer(run)
    base = baseline(run)
    setup = SETUPS.get(base.name, NOTHING) if base is not None else NOTHING
    advice = _advice(run, base) if base is not None and measured(base) else []
    binding = any(s.status == STATUS_OOM for s in run.scenarios)
    recommended = tuple(sorted((a for a in advice if _helps(a, binding)),
                               key=lambda a: -a.heaviest_saves_bytes))
    worse = tuple(a for a in advice if a.heaviest_saves_bytes < 0 and not _noise(a))
    explained = tuple(s.name for s in run.scenarios if _explains(run, s))
    why = {name: why_heavier(att) for name in explained
           if (att := run.attribution.get(name) or _attribute(run, name)) is not None}
    before, clause, after = _verdict(run, base)
    verdict = _sentence(before + clause + after)
    parts = None
    if clause:  # _sentence changes the first letter and the end only
        cut = len(before) + len(clause)
        parts = (verdict[: len(before)], verdict[len(before): cut], verdict[cut:])
    unsure = tuple(a for a in advice if binding and a.fits is None and a.heaviest_saves_bytes > 0
                   and not _noise(a))
    notes = tuple(f"{a.fix.title}: {a.why}" for a in (*worse, *unsure))
    return Answer(setup=setup, verdict=verdict, verdict_parts=parts,
                  baseline=base.name if base is not None else None,
                  recommended=recommended, worse=worse,
                  nothing_to_change=_nothing_to_change(run, base, setup, advice),
                  explained=explained, why=why, notes=notes)


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
        return (f"Partial result: interrupted by {run.interrupted} after {steps} optimizer "
                "step(s) of the script as written; no alternative was run.")
    done = ", ".join(s.name for s in run.scenarios) or "none"
    asked = run.config.get("scenarios") or []
    return (f"Partial result: interrupted by {run.interrupted} after {len(run.scenarios)} of "
            f"{len(asked) or '?'} scenarios ({done}).")


def _verdict(run: RunResult, base: ScenarioResult | None) -> tuple[str, str, str]:
    """(before, the out-of-memory clause, after) of the verdict."""
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
        rung = _ladder_clause(run)
        if rung:
            tail.append(rung)
    elif measured(base) and len(run.scenarios) == 1:
        tail.append(f"it fits: the fullest GPU needs {fmt_bytes(need_bytes(base))} of "
                    f"{fmt_bytes(run.gpu_memory_bytes)} ({counts(run)})")
    if failed:
        tail.append(f"failed: {', '.join(failed)}")
    before = prefix + "; ".join(parts)
    after = "".join("; " + t for t in tail)
    if clause:
        return before + "; ", clause, after
    return before + after, "", ""


def _ladder_clause(run: RunResult) -> str:
    """The cheapest rung of the ladder that fits (the rungs come cheapest first), counting
    what the out-of-memory check counts; or that none does; "" where none was measured."""
    rungs = [f for f in run.fixes if f.name.startswith(LADDER_PREFIX) and f.need_bytes is not None]
    if not rungs:
        return ""
    fit = next((f for f in rungs if (f.need_bytes or 0) <= run.gpu_memory_bytes), None)
    if fit is not None:
        # FSDP2's rungs replace DDP; the others run on it (or on the one GPU; a script's:
        # on the run dpprof run changed, config "ladder_on")
        floor = run.config.get("ladder_on") or ("DDP" if run.gpus > 1 else "one GPU")
        on = "" if "fsdp2" in fit.name else f" on {floor}"
        # CPU offload fits where little else does, at a price in step time: said here
        cost = ("; its optimizer step runs on the CPU, a slower step"
                if "offload" in fit.name else "")
        return (f"the cheapest rung that fits is {fit.title}{on}: its fullest GPU needs "
                f"{fmt_bytes(fit.need_bytes)} (reserved memory and the CUDA context counted"
                f"{cost}; the code is below)")
    lightest = min(rungs, key=lambda f: f.need_bytes or 0)
    return (f"no rung of the ladder measured fits: the lightest, {lightest.title}, needs "
            f"{fmt_bytes(lightest.need_bytes)} on its fullest GPU")


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


def _advice(run: RunResult, base: ScenarioResult) -> list[Advice]:
    """Each fix that changes the baseline's setup, measured against the baseline."""
    out = []
    was_top = heaviest(base)
    for f in _found_fixes(run):
        applies = BASELINES if f.name.startswith(LADDER_PREFIX) else applies_to(f.name)
        if base.name not in applies:
            continue
        if as_scenario(f.name) == base.name or f.max_peak_bytes is None:
            continue
        if base.name == DP_LOSS_PRIMARY and f.heaviest_saves_bytes is not None:
            saving = f.heaviest_saves_bytes
        elif run.backend == "emulated":  # the fix's figures come from the same emulation
            saving = was_top.peak_allocated_bytes - f.max_peak_bytes
        else:  # measured and emulated bytes never mix
            continue
        primary = None
        if f.primary_peak_bytes is not None and run.backend == "emulated":
            primary = used(base)[0].peak_allocated_bytes - f.primary_peak_bytes
        elif base.name == DP_LOSS_PRIMARY:
            primary = f.saves_bytes
        fits = _fix_fits(run, f)
        out.append(Advice(fix=f, baseline=base.name, heaviest_saves_bytes=saving,
                          primary_saves_bytes=primary, fits=fits,
                          why=_why_fix(run, f, base, saving, primary, fits)))
    return out


def _fix_fits(run: RunResult, f: Fix) -> bool | None:
    if f.need_bytes is not None:  # counted as the out-of-memory check counts
        return f.need_bytes <= run.gpu_memory_bytes
    own = run.scenario(as_scenario(f.name) or "")
    if measured(own):
        assert own is not None
        return own.status == STATUS_OK
    if f.max_peak_bytes is not None and f.max_peak_bytes > run.gpu_memory_bytes:
        return False
    if counts(run).startswith("allocated"):
        return True  # the out-of-memory check counts allocated only, as the fix's figure does
    return None


def _noise(a: Advice) -> bool:
    top = a.fix.max_peak_bytes or 0
    return abs(a.heaviest_saves_bytes) < MIN_SAVING * (top + max(a.heaviest_saves_bytes, 0))


def _helps(a: Advice, binding: bool) -> bool:
    """Lowers the heaviest GPU, and is not out of memory; where the memory binds (some
    scenario ran out), it must be known to fit."""
    return (a.heaviest_saves_bytes > 0 and not _noise(a)
            and (a.fits is True or (a.fits is None and not binding)))


def _why_fix(run: RunResult, f: Fix, base: ScenarioResult, saving: int, primary: int | None,
             fits: bool | None) -> str:
    detail = f.detail.rstrip(".") + "." if f.detail else ""
    top = fmt_bytes(f.max_peak_bytes)
    if saving >= 0:
        effect = f"Against {base.name}: the heaviest GPU peaks at {top}, {fmt_bytes(saving)} less"
    else:
        effect = (f"Against {base.name}: it makes the heaviest GPU worse, {top} at its peak, "
                  f"{fmt_bytes(-saving)} more")
    if primary is not None and primary != saving:
        effect += (f"; cuda:0 {fmt_bytes(primary)} less" if primary >= 0
                   else f"; cuda:0 {fmt_bytes(-primary)} more")
    effect += "."
    caveat = ""
    if fits is None:
        caveat = (f" Its reserved memory and CUDA context were not emulated: whether it fits "
                  f"in {fmt_bytes(run.gpu_memory_bytes)} is not known.")
    elif fits is False:
        caveat = f" It does not fit in {fmt_bytes(run.gpu_memory_bytes)}."
    return " ".join(x for x in (detail, effect) if x) + caveat


def _nothing_to_change(run: RunResult, base: ScenarioResult | None, setup: str,
                       advice: list[Advice]) -> str:
    if not any(measured(s) for s in run.scenarios):
        return "No recommendation: no scenario produced a measurement (see the errors above)."
    assert base is not None
    rungs = [a.fix for a in advice if a.fix.name.startswith(LADDER_PREFIX)
             and a.fix.need_bytes is not None]
    if rungs:  # measured because nothing fit, and none of them fits either
        return (f"Nothing measured fits in {fmt_bytes(run.gpu_memory_bytes)}, no rung of the "
                "ladder either; their fullest GPU needs: " + "; ".join(
                    f"{f.title} {fmt_bytes(f.need_bytes)}" for f in rungs)
                + " (reserved memory and the CUDA context counted).")
    if setup == SPLIT_MODEL:
        return ("No fix of dpprof's applies: the script places its layers on the GPUs "
                f"itself (model parallel); its heaviest GPU is {device_label(heaviest(base))}.")
    if setup == ONE_GPU:
        return "No fix applies: the step runs on one GPU."
    if setup == DISTRIBUTED and not advice:
        return (f"Nothing to change: {_distributed_words(base.name)} already gives every GPU "
                "its own share.")
    if not measured(base):
        return f"No recommendation: {base.name}, the scenario fixes are measured against, failed."
    if advice:
        return (f"Nothing to change: no fix measured here lowers the heaviest GPU's peak under "
                f"{base.name}.")
    return "Nothing to change: cuda:0 carries no excess worth a change in any scenario measured."


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


# ---- maxbatch ------------------------------------------------------------------------------


def maxbatch_ratio(run: RunResult) -> tuple[int, int, float] | None:
    """(DDP's largest batch, dp-loss-primary's, their ratio) where both fit some batch."""
    if run.maxbatch is None:
        return None
    best = {e.scenario: e.max_batch for e in run.maxbatch.entries}
    prim, ddp = best.get(DP_LOSS_PRIMARY), best.get(DDP)
    return (ddp, prim, ddp / prim) if prim and ddp else None


def _maxbatch_answer(run: RunResult) -> Answer:
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
        text += (f"; DDP fits {ratio[2]:.2f}x the batch of DataParallel with the loss on cuda:0 "
                 f"({ratio[0]} vs {ratio[1]})")
    fitting = [e for e in mb.entries if e.max_batch]
    best = max(fitting, key=lambda e: e.max_batch or 0) if fitting else None
    nothing = ("No recommendation: no scenario fits a batch." if best is None else
               f"{best.scenario} fits the largest batch ({best.max_batch}).")
    return Answer(setup=MAXBATCH, verdict=_sentence(text), verdict_parts=None, baseline=None,
                  recommended=(), worse=(), nothing_to_change=nothing, explained=())


# ---- watch ---------------------------------------------------------------------------------


def _watch_answer(run: RunResult, w: WatchResult) -> Answer:
    c = next(iter(run.comparison.scenarios.values()), None)
    lines, steps = post_mortem(w)
    return Answer(setup=WATCH, verdict=watch_verdict(w, c.imbalance if c else None),
                  verdict_parts=None, baseline=None, recommended=(), worse=(),
                  nothing_to_change="", explained=(), post_mortem=tuple(lines),
                  next_steps=tuple(steps))
