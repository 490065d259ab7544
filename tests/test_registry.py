"""The scenario and fix registries: a scenario or a fix added there runs everywhere with no
other change (the backends, the comparison, the answers and the reports loop over them)."""

import dataclasses

import pytest

from dpprof.backends.emulated import EmulationConfig, run_scenario
from dpprof.fixes import fix_registry
from dpprof.fixes.fix_kind import ALONE, FixKind, Trial
from dpprof.fixes.policy import Cost
from dpprof.measure.fix_savings import alongside
from dpprof.pipeline import CompareConfig, run_compare
from dpprof.reports.sentences import SCENARIO_COLOURS
from dpprof.result import Fix
from dpprof.scenarios import registry
from dpprof.scenarios.kind import OneGpuScenario
from dpprof.scenarios.names import DP_LOSS_PRIMARY, SINGLE
from dpprof.scenarios.step import StepConfig
from dpprof.scenarios.workloads import classifier

GiB = 2**30


class WholeBatchOnOneGpu(OneGpuScenario):
    """The bare model on one GPU with the whole global batch (not a share of it)."""

    @property
    def rank(self) -> int | None:
        return None

    def rows_of(self, shards: list[int], device: int) -> int:
        return sum(shards)


WHOLE = WholeBatchOnOneGpu(name="whole-batch", description="one GPU, the whole batch",
                           colour="#123456")


@pytest.fixture
def with_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.BY_NAME, WHOLE.name, WHOLE)


def test_the_paired_scenarios_are_the_registrys_in_its_order() -> None:
    assert registry.SCENARIOS == ("dp-loss-primary", "dp-loss-forward", "ddp", "single")
    assert set(SCENARIO_COLOURS) == set(registry.SCENARIOS)
    assert "model-parallel" in registry.BY_NAME and not registry.scenario("model-parallel").paired
    with pytest.raises(ValueError, match="choose from dp-loss-primary"):
        registry.scenario("nope")


def test_a_registered_scenario_runs_on_the_emulator_with_its_rows(with_whole: None) -> None:
    cfg = EmulationConfig(gpus=4, gpu_memory_bytes=80 * GiB, step=StepConfig(batch=64))
    whole = run_scenario(WHOLE.name, classifier(), cfg)
    single = run_scenario(SINGLE, classifier(), cfg)
    assert whole.status == single.status == "ok"
    assert [d.batch_rows for d in whole.devices] == [64]
    assert [d.batch_rows for d in single.devices] == [16]
    # four times single's rows: more activations on its one GPU
    assert whole.devices[0].peak_allocated_bytes > single.devices[0].peak_allocated_bytes


class HalfOnCudaZero(FixKind):
    """A stand-in fix measured alone: dp-loss-primary with half the batch."""

    def measure(self, trial: Trial) -> Fix | None:
        s = trial.emulate(DP_LOSS_PRIMARY, trial.base.with_step(batch=trial.batch // 2))
        return trial.fix(self, s, "half the batch", "-batch\n+batch // 2")


def test_a_registered_fix_is_measured_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    half = HalfOnCudaZero(name="half-batch", title="Half the batch",
                          applies_to=(DP_LOSS_PRIMARY,), measured=ALONE,
                          cost=Cost(5, "the batch halved", ""))
    monkeypatch.setattr(fix_registry, "FIXES", (*fix_registry.FIXES, half))
    monkeypatch.setitem(fix_registry.BY_NAME, half.name, half)
    import dpprof.measure.fix_savings as fixes_module

    monkeypatch.setattr(fixes_module, "FIXES", fix_registry.FIXES)
    run = run_compare(CompareConfig(step=StepConfig(batch=64)), workload=classifier())
    names = [f.name for f in run.fixes]
    assert names[-1] == "half-batch" and names[0] == "loss-in-forward"
    fix = run.fixes[-1]
    assert fix.saves_bytes is not None and fix.saves_bytes > 0  # half the rows on cuda:0
    assert fix_registry.applies_to("half-batch") == (DP_LOSS_PRIMARY,)
    assert fix_registry.applies_to("gone") == (DP_LOSS_PRIMARY,)  # an older result's fix
    # its cost is the one it carries (no table elsewhere to add it to)
    assert fix_registry.cost_of("half-batch") is half.cost
    assert fix_registry.cost_of("gone").rank == 99


def test_alongside_is_what_each_fix_asks_of_its_scenario() -> None:
    seen = alongside(64, 4)
    assert seen.further_steps_in == DP_LOSS_PRIMARY and seen.ledger_in == "ddp"
    assert seen.bucket_view and seen.output_device == 3 and seen.splits is not None
    kinds = {f.name: (f.measured, f.measured_in) for f in fix_registry.FIXES}
    assert kinds["output-device"] == ("further-step", DP_LOSS_PRIMARY)
    assert kinds["gradient-as-bucket-view"] == ("ledger", "ddp")
    # dpprof run's strategies, found by the fixes' one names, in the registry's order
    from dpprof.script.strategy_registry import strategies

    assert [s.name for s in strategies()][:3] == ["loss-in-forward", "ddp",
                                                  "gradient-as-bucket-view"]


def test_a_result_made_by_the_factory_records_version_time_and_environment() -> None:
    from dpprof import __version__
    from dpprof.result import new_result

    run = new_result("emulated", "w", batch=8, gpus=2, gpu_memory_bytes=GiB,
                     config={"command": "x"})
    assert run.dpprof_version == __version__ and run.created.endswith("+00:00")
    assert run.environment and run.config == {"command": "x"}
    kept = new_result("nvml-watch", "w", batch=0, gpus=1, gpu_memory_bytes=GiB, config={},
                      environment={"hostname": "h"}, created="", dpprof_version="0.1")
    assert (kept.environment, kept.created, kept.dpprof_version) == ({"hostname": "h"}, "",
                                                                     "0.1")
    assert dataclasses.asdict(kept)["schema_version"] == dataclasses.asdict(run)[
        "schema_version"]
