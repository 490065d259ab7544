"""Why cuda:0 is heavier, and what removes it: the lead cause of a DataParallel scenario's
excess (:mod:`dpprof.answers.attribution`) and the change that removes it, with what that
change was measured to do here."""

from __future__ import annotations

from dpprof.answers.answer_figures import (
    balanced,
    heaviest,
    measured,
    need_bytes,
    primary_label,
    used,
)
from dpprof.answers.attribution import attribute, lead_causes
from dpprof.answers.recommendation import within_noise
from dpprof.answers.setups import (
    SETUPS,
)
from dpprof.fixes.fix_kind import MIN_SAVING
from dpprof.fixes.fix_registry import as_scenario
from dpprof.result import (
    STATUS_OOM,
    Attribution,
    FixAnswer,
    RunResult,
    ScenarioResult,
)
from dpprof.scenarios.names import (
    DATA_PARALLEL,
    DP_LOSS_FORWARD,
)
from dpprof.units import fmt_bytes

# ---- why cuda:0 is heavier ------------------------------------------------------------------


def attribution_of(run: RunResult, name: str) -> Attribution | None:
    s = run.scenario(name)
    return attribute(s) if s is not None else None


def explains(run: RunResult, s: ScenarioResult) -> bool:
    """"Why cuda:0 is heavier" applies: a DataParallel scenario whose cuda:0 is heavier."""
    if SETUPS.get(s.name) != DATA_PARALLEL or not measured(s) or len(used(s)) < 2:
        return False
    att = run.attribution.get(s.name) or attribution_of(run, s.name)
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
            "optimizer state on {gpu} only; DDP gives every GPU its own"),
    "balanced-split": "a smaller share of the batch on {gpu} (or a batch divisible by the "
                      "GPU count) removes it",
    "input-batch": "moving the inputs straight to their GPUs (DDP) removes it",
    # the replicas compute their loss already (a Hugging Face model returns it beside its
    # logits): what is gathered is the rest of what forward returns
    "outputs-beside-loss": ("the replicas compute their loss already, and DataParallel "
                            "gathers on {gpu} what forward returns beside it (its "
                            "outputs: a Hugging Face model's logits): returning the loss "
                            "alone removes it, and DDP gathers nothing"),
}


def remedy(run: RunResult, att: Attribution, fixes: list[FixAnswer], picked: str | None
            ) -> str:
    """What removes the lead cause of ``att``, and what it was measured to do here (never
    advised where it was measured to make the heaviest GPU worse or not to fit)."""
    lead = lead_causes(att)
    if not lead:
        return ""
    first = lead[0]
    kind = ("loss-in-forward" if first in LOSS_SIDE else "balanced-split"
            if first == "larger_shard" else "input-batch" if first == "input_batch" else "ddp")
    if kind == "loss-in-forward" and att.scenario == DP_LOSS_FORWARD:
        kind = "outputs-beside-loss"
    fix_name = "ddp" if kind in ("input-batch", "outputs-beside-loss") else kind
    here = run.scenario(att.scenario)
    words = REMEDY_WORDS[kind].replace("{gpu}", primary_label(here))
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
        if answer is not None and answer.heaviest_saves_bytes < 0 and not within_noise(answer):
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
