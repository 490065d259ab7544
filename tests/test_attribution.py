"""Attribution of cuda:0's excess: byte-exact, and the answers it gives."""

import pytest

from dpprof.answers.attribution import attribute, attribute_run
from dpprof.answers.comparison import compare_scenario
from dpprof.pipeline import CompareConfig, run_compare
from dpprof.result import DeviceResult, ScenarioResult
from dpprof.scenarios.step import StepConfig


def _dev(i: int, rows: int, **cats: int) -> DeviceResult:
    return DeviceResult(index=i, peak_allocated_bytes=sum(cats.values()), breakdown_bytes=cats,
                        batch_rows=rows)


@pytest.mark.parametrize("workload,batch,gpus", [
    ("mlp", 10, 4), ("mlp", 8, 3), ("classifier", 7, 2), ("convnet", 9, 4),
])
def test_causes_add_up_to_the_excess(workload: str, batch: int, gpus: int) -> None:
    run = run_compare(CompareConfig(
        workload=workload, gpus=gpus, fixes=False,
        scenarios=("dp-loss-primary", "dp-loss-forward", "ddp"),
        step=StepConfig(batch=batch),
    ))
    atts = attribute_run(run)
    assert set(atts) == {"dp-loss-primary", "dp-loss-forward", "ddp"}
    for name, att in atts.items():
        excess = run.comparison.scenarios[name].primary_excess_bytes
        assert att.excess_bytes == excess
        assert sum(att.causes_bytes.values()) == excess, (name, att.causes_bytes)
    assert run.attribution == atts  # the runner stores them in the result


def test_even_number_of_other_devices_uses_the_middle_two_and_stays_exact() -> None:
    s = ScenarioResult(name="dp-loss-primary", devices=[
        _dev(0, 4, parameters=1001, optimizer_state=2000, activations=500, loss=7),
        _dev(1, 3, parameters=301, activations=400),
        _dev(2, 3, parameters=300, activations=403),
    ])
    att = attribute(s)
    assert att is not None
    c = compare_scenario(s)
    assert c is not None and att.excess_bytes == c.primary_excess_bytes
    assert sum(att.causes_bytes.values()) == att.excess_bytes
    assert att.reference == "mean of cuda:1 and cuda:2"
    assert att.causes_bytes["optimizer_state"] == 2000
    assert att.causes_bytes["loss"] == 7
    # 4 rows against 3: up to a third of the reference's activations (133.8 B) is the
    # larger shard; cuda:0 holds only 98.5 B more, all of it explained by the extra row
    assert att.causes_bytes["larger_shard"] in (98, 99)
    assert att.causes_bytes["master_parameters"] in (700, 701)


def test_loss_inside_forward_and_still_heavier_points_to_optimizer_state_and_ddp() -> None:
    # classifier uses SGD with momentum... lm uses AdamW: optimizer state on cuda:0 only.
    from dpprof.scenarios.workloads import LMConfig, lm

    wl = lm(LMConfig(vocab=2000, seq=16, d_model=64, layers=1))
    run = run_compare(CompareConfig(
        fixes=False, scenarios=("dp-loss-forward",), step=StepConfig(batch=8),
    ),
                      workload=wl)
    att = run.attribution["dp-loss-forward"]
    assert att.excess_bytes > 0
    top = max(att.causes_bytes, key=lambda k: att.causes_bytes[k])
    assert top in ("optimizer_state", "reduced_gradients", "master_parameters")
    assert att.causes_bytes.get("optimizer_state", 0) > 0
    assert "DistributedDataParallel" in att.answer


def test_single_device_scenario_has_no_attribution() -> None:
    s = ScenarioResult(name="single", devices=[_dev(0, 4, parameters=10)])
    assert attribute(s) is None


def test_larger_shard_is_named_when_cuda0_has_more_rows() -> None:
    from dpprof.scenarios.workloads import LMConfig, lm

    wl = lm(LMConfig(vocab=2000, seq=64, d_model=64, layers=1))  # activations dominate
    run = run_compare(CompareConfig(
        gpus=2, fixes=False, scenarios=("dp-loss-forward",),
        step=StepConfig(batch=7),
    ), workload=wl)  # 4, 3 rows
    att = run.attribution["dp-loss-forward"]
    assert att.causes_bytes.get("larger_shard", 0) > 0
    assert sum(att.causes_bytes.values()) == att.excess_bytes


def test_median_other_device_by_category() -> None:
    s = ScenarioResult(name="dp-loss-primary", devices=[
        _dev(0, 2, parameters=100, outputs=500, activations=50),
        _dev(1, 2, parameters=100, activations=70),
        _dev(2, 2, parameters=100, activations=40),
        _dev(3, 2, parameters=100, activations=60),
    ])
    att = attribute(s)
    assert att is not None
    assert att.reference == "cuda:3"  # the median of 170, 140, 160
    assert att.causes_bytes == {"gathered_outputs": 500, "activations_timing": -10}
    assert att.excess_bytes == 490


def test_breakdown_that_does_not_sum_to_the_peak_goes_to_other() -> None:
    a = DeviceResult(index=0, peak_allocated_bytes=1000, breakdown_bytes={"loss": 600})
    b = DeviceResult(index=1, peak_allocated_bytes=300, breakdown_bytes={})
    att = attribute(ScenarioResult(name="x", devices=[a, b]))
    assert att is not None and att.causes_bytes == {"loss": 600, "other": 100}


def test_measured_gpus_are_split_by_the_phase_of_the_peak() -> None:
    """Real GPUs give the allocator's peak per phase, no categories."""
    def dev(i: int, **phases: int) -> DeviceResult:
        peak = max(phases, key=phases.__getitem__)
        return DeviceResult(index=i, peak_allocated_bytes=phases[peak], peak_phase=peak,
                            phase_peak_allocated_bytes=phases, batch_rows=2)

    s = ScenarioResult(name="dp-loss-primary", devices=[
        dev(0, forward=500, loss=900, backward=700, optimizer=600),
        dev(1, forward=450, loss=300, backward=520, optimizer=510),
        dev(2, forward=460, loss=310, backward=530, optimizer=500),
    ])
    att = attribute(s)
    assert att is not None and att.excess_bytes == 900 - 525
    # cuda:0 holds 900 - 305 more in the loss phase; the reference peaks 220 higher in backward
    assert att.causes_bytes == {"phase_loss": 595, "reference_peak_elsewhere": -220}
    assert "inside forward" in att.answer


def test_no_attribution_without_two_used_devices_or_a_measurement() -> None:
    from dpprof.result import STATUS_ERROR

    two = [_dev(0, 1, loss=1), _dev(1, 1, loss=1)]
    assert attribute(ScenarioResult(name="x", status=STATUS_ERROR, devices=two)) is None
    unused = [_dev(0, 1, loss=1), DeviceResult(index=1, used=False)]
    assert attribute(ScenarioResult(name="x", devices=unused)) is None


def test_causes_of_the_saved_default_comparison_add_up_to_the_excess() -> None:
    from reports_data import saved

    run = saved("emulated-lm")
    prim = attribute(run.scenario("dp-loss-primary"))
    assert prim is not None
    assert sum(prim.causes_bytes.values()) == prim.excess_bytes == \
        run.comparison.scenarios["dp-loss-primary"].primary_excess_bytes
    biggest = max(prim.causes_bytes, key=lambda c: prim.causes_bytes[c])
    assert biggest == "loss" and prim.causes_bytes["loss"] > 40 * 2**30
    # The loop keeps the gathered logits (512 x 256 x 32000 floats) alive on cuda:0 through
    # backward; each other GPU holds its replica's quarter at its own peak.
    logits = 512 * 256 * 32000 * 4
    assert prim.causes_bytes["gathered_outputs"] == logits - logits // 4
