"""What a fix is, once: its name and title, the scenarios it changes, its code, how it is
measured and what it costs. Its one name is also ``dpprof run``'s: the script layer finds a
fix's strategy there by it (:mod:`dpprof.script.strategy_registry`).

Each fix is one object (:class:`FixKind`) in its own module under
:mod:`dpprof.fixes.kinds`, listed once in :mod:`dpprof.fixes.fix_registry`;
:func:`dpprof.measure.fix_savings.evaluate` measures them in the registry's order, the answers
read which scenario each changes.

How a fix is measured (:attr:`FixKind.measured`):

* :data:`AS_SCENARIO`: it is one of the paired scenarios (:attr:`FixKind.measured_in`); the
  comparison's own result where it ran, else that scenario emulated;
* :data:`FURTHER_STEP`: one more step of :attr:`~FixKind.measured_in`'s own loop, after its
  measured step (:class:`dpprof.backends.emulated.Alongside`), else emulated alone;
* :data:`LEDGER`: followed in a ledger while :attr:`~FixKind.measured_in` runs plain, else
  emulated alone;
* :data:`ALONE`: emulated on its own.

Every fix is measured against the scenario that stands for what the user runs, the first of
the registry's the run measured (:func:`baseline_of`: ``dp-loss-primary`` where it ran), and
only where it changes that scenario's setup (:attr:`FixKind.applies_to`): never against a
scenario the user did not run. Each has a need (:attr:`Fix.need_bytes`: its fullest GPU,
counted as the run's out-of-memory check counts), from its own emulation where it ran alone,
else from emulating it alone once more with that count (:meth:`FixKind.alone`); and a cost
(:attr:`FixKind.cost`: its place in the policy's order, :mod:`dpprof.fixes.policy`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dpprof.fixes.policy import Cost
from dpprof.result import STATUS_OK, STATUS_OOM, Fix, RunResult, ScenarioResult
from dpprof.scenarios.names import DP_LOSS_PRIMARY
from dpprof.scenarios.registry import REGISTRY

if TYPE_CHECKING:
    from dpprof.backends.emulated import Alongside, EmulationConfig
    from dpprof.scenarios.workloads import Workload

# A difference under 1 % of the heaviest GPU's peak is noise (a loss tensor), not a change:
# a fix that saves less is not recommended (dpprof.answers.answer), nor searched further.
MIN_SAVING = 0.01
FIX_BASELINE = DP_LOSS_PRIMARY  # what every fix's saving is measured against
AS_SCENARIO, FURTHER_STEP, LEDGER, ALONE = "scenario", "further-step", "ledger", "alone"


def measured_ok(s: ScenarioResult | None) -> bool:
    """A scenario with figures to compare: it ran (or ran out of memory) on some device."""
    return s is not None and s.status in (STATUS_OK, STATUS_OOM) and bool(s.devices)


def baseline_of(run: RunResult) -> str | None:
    """The scenario the fixes are measured against: the first of the registry's (so
    ``dp-loss-primary`` where it ran) that the run measured; None where it measured none."""
    return next((k.name for k in REGISTRY if measured_ok(run.scenario(k.name))), None)


def need_of(s: ScenarioResult) -> int | None:
    """What ``s``'s fullest GPU needs as the out-of-memory check counts it (reserved and the
    context where they were emulated or measured); None where only allocated is known."""
    used = [d for d in s.devices if d.used]
    if not any(d.peak_reserved_bytes is not None or d.context_bytes is not None for d in used):
        return None
    return max(d.total_peak_bytes for d in used)


def peaks(s: ScenarioResult) -> tuple[int, int]:
    """(cuda:0's peak, the heaviest used device's peak)."""
    used = [d for d in s.devices if d.used]
    return used[0].peak_allocated_bytes, max(d.peak_allocated_bytes for d in used)


def against(name: str, title: str, s: ScenarioResult | None, baseline: ScenarioResult,
            detail: str, code: str, chunks: list[int] | None = None) -> Fix | None:
    """``s`` (the step with the fix) against ``baseline`` (the scenario the user ran)."""
    if not measured_ok(s):
        return None
    assert s is not None
    p0, pmax = peaks(baseline)
    q0, qmax = peaks(s)
    return Fix(name=name, title=title, primary_peak_bytes=q0, max_peak_bytes=qmax,
               saves_bytes=p0 - q0, heaviest_saves_bytes=pmax - qmax, detail=detail,
               code=code, chunk_sizes=tuple(chunks or ()), need_bytes=need_of(s),
               baseline=baseline.name, predicted_step_time_s=s.predicted_step_time_s)


class Trial:
    """One evaluation of the fixes on a run's workload and batch: the emulation each fix
    asks for, each scenario emulated at most once.

    ``base``: the emulation (peaks only); ``measured``: what the run's own scenarios
    measured alongside (used where the emulator made the run, ``own``); ``run_scenario``:
    :func:`dpprof.backends.emulated.run_scenario`."""

    def __init__(self, run: RunResult, wl: Workload, base: EmulationConfig,
                 measured: Alongside, own: bool, kinds: tuple[FixKind, ...],
                 run_scenario: Callable[..., ScenarioResult],
                 baseline: str = FIX_BASELINE) -> None:
        self.run, self.wl, self.base, self.measured, self.own = run, wl, base, measured, own
        self.kinds = kinds
        self.baseline = baseline  # the scenario the user ran that the fixes are against
        self._run_scenario = run_scenario
        self.gpus, self.batch = base.gpus, base.step.batch
        self._scenarios: dict[str, ScenarioResult | None] = {}
        self._primary: ScenarioResult | None = None

    @property
    def primary(self) -> ScenarioResult:
        """The baseline every fix is measured against (:meth:`scenario` of
        :attr:`baseline`, measured)."""
        assert self._primary is not None
        return self._primary

    def scenario(self, name: str) -> ScenarioResult | None:
        """Scenario ``name``: the run's own where the emulator made it and it measured, else
        emulated here (measuring, as it runs, what the fixes it hosts ask of it)."""
        if name not in self._scenarios:
            s = self.run.scenario(name) if self.own else None
            if not measured_ok(s):
                for kind in self.kinds:  # afresh: what an earlier emulation left is not this
                    if kind.measured_in == name and kind.measured in (FURTHER_STEP, LEDGER):
                        kind.ask(self.measured, self.batch, self.gpus)
                s = self.emulate(name, self.base, self.measured)
            self._scenarios[name] = s
            if name == self.baseline and measured_ok(s):
                self._primary = s
        return self._scenarios[name]

    def emulate(self, name: str, cfg: EmulationConfig,
                alongside: Alongside | None = None) -> ScenarioResult:
        """Scenario ``name`` emulated with ``cfg`` (a variant of :attr:`base`)."""
        if alongside is None:
            return self._run_scenario(name, self.wl, cfg)
        return self._run_scenario(name, self.wl, cfg, alongside=alongside)

    def variant(self, **changes: object) -> EmulationConfig:
        """:attr:`base` with ``changes`` (``dp_output_device=...``)."""
        return dataclasses.replace(self.base, **changes)  # type: ignore[arg-type]

    def fix(self, kind: FixKind, s: ScenarioResult | None, detail: str, code: str,
            chunks: list[int] | None = None) -> Fix | None:
        """``s`` (the step with ``kind``) against the baseline."""
        return against(kind.name, kind.title, s, self.primary, detail, code, chunks)


@dataclass(frozen=True)
class FixKind:
    """One fix (see the module)."""

    # the one name: the result's Fix.name, `dpprof run`'s alternative and its strategy's
    # module (dpprof.script.<name, "-" as "_">_run)
    name: str
    title: str
    applies_to: tuple[str, ...]  # the scenarios whose setup it changes (others: not offered)
    measured: str  # AS_SCENARIO, FURTHER_STEP, LEDGER or ALONE
    # what it costs the user: its place in the policy's order (cheaper than every rung of
    # the ladder), its change to the code, what it does to the step time
    cost: Cost
    measured_in: str | None = None  # the scenario it is, or whose loop measures it

    def alone(self, trial: Trial, fix: Fix) -> tuple[str, EmulationConfig] | None:
        """The scenario and configuration that run ``fix``'s step on its own (its need is
        emulated so where the step that measured it counted peaks only)."""
        return None

    def ask(self, alongside: Alongside, batch: int, gpus: int) -> None:
        """Ask (afresh) the scenario that measures it in its loop (:attr:`measured_in`) to
        measure it as it runs: FURTHER_STEP and LEDGER fixes."""

    def measure(self, trial: Trial) -> Fix | None:
        """What it saves on the trial's workload, or None where it cannot be measured."""
        raise NotImplementedError

    def from_scenario(self, s: ScenarioResult | None, primary: ScenarioResult, gpus: int,
                      batch: int) -> Fix | None:
        """An AS_SCENARIO fix from its scenario's result, without emulating anything."""
        return None
