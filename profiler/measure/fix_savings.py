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
from dpprof.fixes.fix_kind import FIX_BASELINE, Trial, measured_ok
from dpprof.fixes.fix_registry import FIXES
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
    # each variant reports its peaks only
    base = dataclasses.replace(base, count_reserved=False, peaks_only=True)
    own = run.backend == "emulated"
    if not own or measured is None:
        measured = alongside(base.step.batch, base.gpus)
    trial = Trial(run, wl, base, measured, own, FIXES,
                  lambda *args, **kwargs: run_scenario(*args, **kwargs))
    if not measured_ok(trial.scenario(FIX_BASELINE)) or base.gpus < 2:
        return []
    found = [kind.measure(trial) for kind in FIXES]
    return [f for f in found if f is not None]
