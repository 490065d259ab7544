"""Every fix, once: the one list the fixes' evaluation, the answers and ``dpprof run`` loop
over.

Adding a fix is its module under :mod:`dpprof.fixes.kinds` (a ``FIX``, see
:mod:`dpprof.fixes.fix_kind`, its cost among its fields) and one line in :data:`MODULES`; for
``dpprof run`` to measure it too, its strategy in the script layer
(:mod:`dpprof.script.strategy_registry`). The order is the order in which they are measured
and reported.
"""

from __future__ import annotations

import importlib

from dpprof.fixes.fix_kind import AS_SCENARIO, FIX_BASELINE, FixKind, measured_ok
from dpprof.fixes.policy import Cost, rung_cost
from dpprof.result import Fix, RunResult

MODULES = (
    "dpprof.fixes.kinds.loss_in_forward",
    "dpprof.fixes.kinds.ddp_in_place",
    "dpprof.fixes.kinds.bucket_view",
    "dpprof.fixes.kinds.output_device",
    "dpprof.fixes.kinds.balanced_split",
)


def _load(module: str) -> FixKind:
    fix = importlib.import_module(module).FIX
    assert isinstance(fix, FixKind), module
    return fix


FIXES: tuple[FixKind, ...] = tuple(_load(m) for m in MODULES)
BY_NAME: dict[str, FixKind] = {f.name: f for f in FIXES}


def applies_to(name: str) -> tuple[str, ...]:
    """The scenarios fix ``name`` changes (a fix no longer listed: the baseline's)."""
    kind = BY_NAME.get(name)
    return kind.applies_to if kind is not None else (FIX_BASELINE,)


def as_scenario(name: str) -> str | None:
    """The scenario fix ``name`` is, where it is one of the paired scenarios."""
    kind = BY_NAME.get(name)
    return kind.measured_in if kind is not None and kind.measured == AS_SCENARIO else None


def cost_of(name: str) -> Cost:
    """What fix ``name`` costs the user: a fix kind's own cost, else the ladder's rung's
    (:func:`dpprof.fixes.policy.rung_cost`; ``UNKNOWN`` for a name this dpprof does not
    know)."""
    kind = BY_NAME.get(name)
    return kind.cost if kind is not None else rung_cost(name)


def from_scenarios(run: RunResult) -> list[Fix]:
    """The fixes the run's own scenarios measure, without emulating anything: for results
    saved without fixes (``--no-fixes``, older files)."""
    primary = run.scenario(FIX_BASELINE)
    if not measured_ok(primary) or run.gpus < 2 or run.batch < 1:  # no step: no batch
        return []
    assert primary is not None
    found = [kind.from_scenario(run.scenario(kind.measured_in or ""), primary, run.gpus,
                                run.batch) for kind in FIXES]
    return [f for f in found if f is not None]
