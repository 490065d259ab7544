"""Why cuda:0 is heavier: its excess over the median other device, split by cause.

A pure function of one scenario's result. At cuda:0's peak and at the reference device's
peak (the median of the other used devices; the mean of the two middle ones when their
number is even) the emulator files every live byte under a category; the difference per
category is named after its cause under DataParallel:

| category        | cause on cuda:0                                                   |
| --------------- | ----------------------------------------------------------------- |
| outputs         | gathered outputs (the whole batch's outputs on the output device) |
| loss            | the loss, its temporaries and its gradient                        |
| inputs          | the input batch, moved to cuda:0 before the scatter               |
| parameters      | the master parameters (device 0 keeps the originals)              |
| gradients       | the reduced gradients (``.grad`` lives on cuda:0 only)            |
| optimizer_state | optimizer state and the step's temporaries                        |
| communication   | communication buffers (flat broadcast/reduce buffers, buckets)    |
| activations     | cuda:0's larger shard (ceil division), and the rest: the moment   |
|                 | of its peak differs from the other devices'                       |

The causes add up exactly to ``primary_excess_bytes`` (a byte-exact split; the activation
difference is split into the part explained by cuda:0's extra rows and the remainder).

Measured on real GPUs there is no breakdown by category, only the allocator's peak per phase
of the step: the excess is then split by phase (how much more cuda:0 holds in the phase it
peaks in, and how much higher the reference's own peak is in another phase).

This is the only split of the excess: every report renders :data:`CAUSES`' labels, through
:func:`cause_label` (which names the GPU in those that name it).
"""

from __future__ import annotations

import math
import statistics

from dpprof.answers.answer_figures import median_devices, primary_excess
from dpprof.result import (
    STATUS_OK,
    STATUS_OOM,
    Attribution,
    DeviceResult,
    RunResult,
    ScenarioResult,
)

# cause -> its words in every report (the one set of labels: terminal, Markdown, HTML);
# "{gpu}": the GPU whose excess it is (cause_label fills it in)
CAUSES: dict[str, str] = {
    "gathered_outputs": "gathered outputs",
    "loss": "loss, its temporaries and its gradient",
    "input_batch": "input batch moved to {gpu} before the scatter",
    "master_parameters": "master parameters",
    "reduced_gradients": "reduced gradients",
    "optimizer_state": "optimizer state and step temporaries",
    "communication": "communication buffers",
    "larger_shard": "{gpu}'s larger shard (ceil division)",
    "activations_timing": "activations at {gpu}'s peak moment",
    # measured on GPUs without a breakdown: the phase of the step cuda:0 is heavier in
    "phase_inputs": "heavier while the inputs move to the GPUs",
    "phase_forward": "heavier during forward",
    "phase_loss": "heavier during the loss (gathered outputs and the loss)",
    "phase_backward": "heavier during backward",
    "phase_optimizer": "heavier during optimizer.step",
    "phase_zero_grad": "heavier during zero_grad",
    "reference_peak_elsewhere": "the reference GPU peaks in another phase",
    "other": "other",
}

_CATEGORY_CAUSE = {
    "outputs": "gathered_outputs",
    "loss": "loss",
    "inputs": "input_batch",
    "parameters": "master_parameters",
    "gradients": "reduced_gradients",
    "optimizer_state": "optimizer_state",
    "communication": "communication",
    "other": "other",
}


def cause_label(key: str, gpu: str = "cuda:0") -> str:
    """A cause's words in every report, ``gpu`` the one whose excess it explains."""
    return CAUSES.get(key, key.replace("_", " ")).replace("{gpu}", gpu)


def _reference(middle: list[DeviceResult]) -> tuple[dict[str, float], float, str]:
    """Breakdown and rows of the median other device (or the mean of the middle two)."""
    cats: dict[str, float] = {}
    for d in middle:
        for c, b in d.breakdown_bytes.items():
            cats[c] = cats.get(c, 0.0) + b / len(middle)
    rows = statistics.fmean(d.batch_rows for d in middle)
    name = (f"cuda:{middle[0].index}" if len(middle) == 1
            else f"mean of cuda:{middle[0].index} and cuda:{middle[1].index}")
    return cats, rows, name


def _by_category(primary: DeviceResult, middle: list[DeviceResult]) -> dict[str, float]:
    ref, ref_rows, _ = _reference(middle)
    diff: dict[str, float] = {}
    for c in set(primary.breakdown_bytes) | set(ref):
        cause = _CATEGORY_CAUSE.get(c)
        amount = primary.breakdown_bytes.get(c, 0) - ref.get(c, 0.0)
        if cause is None:  # activations: larger shard, then the rest
            extra_rows = primary.batch_rows - ref_rows
            shard = 0.0
            if extra_rows > 0 and ref_rows > 0 and amount > 0:
                shard = min(amount, ref.get(c, 0.0) * extra_rows / ref_rows)
            diff["larger_shard"] = diff.get("larger_shard", 0.0) + shard
            diff["activations_timing"] = diff.get("activations_timing", 0.0) + amount - shard
        else:
            diff[cause] = diff.get(cause, 0.0) + amount
    return diff


def _by_phase(primary: DeviceResult, middle: list[DeviceResult]) -> dict[str, float]:
    """Measured peaks per phase (real GPUs): the phase cuda:0 peaks in, what the reference
    holds in that phase, and how much higher the reference's own peak is elsewhere."""
    phases = primary.phase_peak_allocated_bytes
    ph = primary.peak_phase if primary.peak_phase in phases else max(phases, key=phases.__getitem__)
    ref_here = statistics.fmean(d.phase_peak_allocated_bytes.get(ph, d.peak_allocated_bytes)
                                for d in middle)
    ref_peak = statistics.fmean(d.peak_allocated_bytes for d in middle)
    key = f"phase_{ph}" if f"phase_{ph}" in CAUSES else "other"
    return {key: phases[ph] - ref_here, "reference_peak_elsewhere": ref_here - ref_peak,
            "other": primary.peak_allocated_bytes - phases[ph]}


def attribute(s: ScenarioResult) -> Attribution | None:
    """Split cuda:0's excess over the median other used device by cause, byte-exact.

    By memory category where the backend files every byte under one (the emulator); by
    phase of the step where it measured per-phase peaks only (real GPUs); else "other".
    """
    if s.status not in (STATUS_OK, STATUS_OOM):
        return None
    devs = [d for d in s.devices if d.used]
    if len(devs) < 2:
        return None
    primary, middle = devs[0], median_devices(devs[1:])
    excess = primary_excess(devs)  # the comparison's own figure, so the two always agree
    if any(d.breakdown_bytes for d in devs) or not primary.phase_peak_allocated_bytes:
        diff = _by_category(primary, middle)
    else:
        diff = _by_phase(primary, middle)
    causes = _exact_split(diff, excess)
    ordered = {k: causes[k] for k in CAUSES if causes.get(k)}
    att = Attribution(scenario=s.name, excess_bytes=excess, reference=_reference(middle)[2],
                      causes_bytes=ordered)
    return att  # its answer is the one answer's (dpprof.answers.answer.settled)


def _exact_split(diff: dict[str, float], total: int) -> dict[str, int]:
    """Whole bytes per cause summing to ``total`` (largest remainder): the fractions come
    from a reference averaged over two devices, and ``total`` from an integer median.
    More than rounding left (breakdowns that do not sum to the peaks, a backend without
    any) is filed under "other"."""
    floors = {k: math.floor(v) for k, v in diff.items()}
    residue = total - sum(floors.values())
    by_fraction = sorted(diff, key=lambda k: diff[k] - floors[k], reverse=residue > 0)
    if by_fraction and abs(residue) <= len(by_fraction):
        for k in by_fraction[: abs(residue)]:
            floors[k] += 1 if residue > 0 else -1
    elif residue:
        floors["other"] = floors.get("other", 0) + residue
    return floors


def attribute_run(run: RunResult) -> dict[str, Attribution]:
    """Attribution for every scenario with at least two used devices (DP and DDP)."""
    out: dict[str, Attribution] = {}
    for s in run.scenarios:
        att = attribute(s)
        if att is not None:
            out[s.name] = att
    return out


def lead_causes(att: Attribution) -> list[str]:
    """The causes that make most of cuda:0's excess (a tenth of it each at least; three at
    most; else the largest)."""
    positive = {k: v for k, v in att.causes_bytes.items() if v > 0}
    top = sorted(positive, key=lambda k: -positive[k])
    total = sum(positive.values()) or 1
    return [k for k in top if positive[k] / total >= 0.1][:3] or top[:1]


def why_heavier(att: Attribution, remedy: str = "", gpu: str = "cuda:0") -> str:
    """The dominant causes of ``gpu``'s excess (cuda:0's, unless DataParallel's first device
    is another), and ``remedy``: what removes them, as the one answer says it from what was
    measured (:func:`dpprof.answers.answer.build_answer`)."""
    positive = {k: v for k, v in att.causes_bytes.items() if v > 0}
    if att.excess_bytes <= 0 or not positive:
        return f"{att.scenario}: {gpu} is not heavier than {att.reference}"
    total = sum(positive.values())
    named = ", ".join(f"{cause_label(k, gpu)} ({positive[k] / total:.0%})"
                      for k in lead_causes(att))
    return f"{att.scenario}: {gpu}'s excess is mostly {named}" + (
        f"; {remedy}" if remedy else "")
