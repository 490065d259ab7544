"""What each fix buys on the user's workload, and the code for it.

Every fix is measured, not estimated: the step with the change
(``DataParallel(output_device=...)``, ``DDP(gradient_as_bucket_view=True)``, an uneven
scatter) is emulated and cuda:0's peak is compared with ``dp-loss-primary``'s. Each fix is
an object of :mod:`dpprof.fixes.fix_registry` that knows how it is measured: a
comparison's own scenarios measure some as they run (:func:`alongside`: further steps of
``dp-loss-primary``'s loop, a ledger beside ``ddp``); what they could not is emulated here
on its own. The balanced split (:mod:`dpprof.fixes.kinds.balanced_split`) is solved
from the even split's peaks and what grows with each device's rows there (each device's peak
taken as affine in its rows), measured, and refined once by a secant where that still
promises a saving.
"""

from __future__ import annotations

import dataclasses

from dpprof.backends.emulated import Alongside, EmulationConfig, run_scenario
from dpprof.fixes.fix_kind import FIX_BASELINE, Trial, baseline_of, measured_ok, need_of
from dpprof.fixes.fix_registry import BY_NAME, FIXES
from dpprof.result import Fix, RunResult
from dpprof.scenarios.workloads import Workload

TYPICAL_LOOP = """\
model = nn.DataParallel(model.cuda())
for inputs, targets in loader:
    loss = loss_fn(model(inputs.cuda()), targets.cuda())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()"""


def alongside(batch: int, gpus: int) -> Alongside:
    """What a comparison's own scenarios measure for the fixes as they run: each fix's ask
    of the scenario whose loop measures it (the balanced split's search and then
    ``output_device`` in ``dp-loss-primary``'s loop, ``gradient_as_bucket_view`` beside
    ``ddp``)."""
    out = Alongside()
    for kind in FIXES:
        kind.ask(out, batch, gpus)
    return out


def evaluate(run: RunResult, wl: Workload, base: EmulationConfig,
             measured: Alongside | None = None) -> list[Fix]:
    """Emulate each fix on the run's workload and batch; what it saves on cuda:0.

    The run's own scenarios are the baseline where the emulator made them (the same
    emulation as the variants); for a measured run (cpu, cuda) every figure is the
    emulator's prediction for ``base``, so that measured and emulated bytes never mix.
    ``measured``: what the run's own scenarios measured alongside (:func:`alongside`);
    what they did not is emulated here.
    """
    # each variant reports its peaks only (a need, where one decides the answer, is emulated
    # afterwards: fill_needs)
    base = dataclasses.replace(base, count_reserved=False, peaks_only=True)
    own = run.backend == "emulated"
    if not own or measured is None:
        measured = alongside(base.step.batch, base.gpus)
    against = baseline_of(run) or FIX_BASELINE
    kinds = tuple(k for k in FIXES if against in k.applies_to)
    trial = Trial(run, wl, base, measured, own, kinds,
                  lambda *args, **kwargs: run_scenario(*args, **kwargs), baseline=against)
    if not kinds or not measured_ok(trial.scenario(against)) or base.gpus < 2:
        return []
    return [f for kind in kinds if (f := kind.measure(trial)) is not None]


def fill_needs(run: RunResult, wl: Workload, base: EmulationConfig,
               names: list[str]) -> tuple[Fix, ...]:
    """``run``'s fixes, each of ``names`` whose need is not known (one measured in a step
    that counted peaks only: a further step of a loop, a ledger) emulated on its own,
    counting as the run counts (reserved memory and the context, or allocated only), with
    its ``need_bytes``."""
    trial = Trial(run, wl, dataclasses.replace(base, count_reserved=False, peaks_only=True),
                  Alongside(), run.backend == "emulated", FIXES,
                  lambda *args, **kwargs: run_scenario(*args, **kwargs),
                  baseline=baseline_of(run) or FIX_BASELINE)
    return tuple(
        dataclasses.replace(f, need_bytes=_need_alone(trial, f, base))
        if f.name in names and f.need_bytes is None and f.name in BY_NAME else f
        for f in run.fixes)


def _need_alone(trial: Trial, fix: Fix, counted: EmulationConfig) -> int | None:
    """What ``fix``'s fullest GPU needs, its step emulated on its own and counted as
    ``counted`` counts."""
    plan = BY_NAME[fix.name].alone(trial, fix)
    if plan is None:
        return None
    name, cfg = plan
    s = trial.emulate(name, dataclasses.replace(cfg, count_reserved=counted.count_reserved,
                                                peaks_only=False))
    if not measured_ok(s):
        return None
    need = need_of(s)
    return need if need is not None else max(d.peak_allocated_bytes for d in s.devices
                                             if d.used)
