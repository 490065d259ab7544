"""cuda:0's excess by cause: sums to the excess, the median other device, edge cases."""

from reports_data import saved

from dpprof.analysis.comparison import compare_scenario
from dpprof.analysis.excess import excess_by_cause
from dpprof.result import STATUS_ERROR, DeviceResult, ScenarioResult


def _dev(i: int, **cats: int) -> DeviceResult:
    return DeviceResult(index=i, peak_allocated_bytes=sum(cats.values()), breakdown_bytes=cats)


def test_causes_of_the_default_comparison_add_up_to_the_excess() -> None:
    run = saved("emulated-lm")
    for s in run.scenarios:
        ex = excess_by_cause(s)
        if s.name == "single":
            assert ex is None
            continue
        assert ex is not None
        assert sum(ex.by_category.values()) == ex.excess_bytes
        assert ex.excess_bytes == compare_scenario(s).primary_excess_bytes
    prim = excess_by_cause(run.scenario("dp-loss-primary"))
    assert prim is not None
    biggest = max(prim.by_category, key=lambda c: prim.by_category[c])
    assert biggest == "loss" and prim.by_category["loss"] > 40 * 2**30
    # The loop keeps the gathered logits (512 x 256 x 32000 floats) alive on cuda:0 through
    # backward; each other GPU holds its replica's quarter at its own peak.
    logits = 512 * 256 * 32000 * 4
    assert prim.by_category["outputs"] == logits - logits // 4


def test_median_other_device_and_categories() -> None:
    s = ScenarioResult(name="dp-loss-primary", devices=[
        _dev(0, parameters=100, outputs=500, activations=50),
        _dev(1, parameters=100, activations=70),
        _dev(2, parameters=100, activations=40),
        _dev(3, parameters=100, activations=60),
    ])
    ex = excess_by_cause(s)
    assert ex is not None
    assert ex.reference_bytes == 160  # device 3 (the median of 170, 140, 160)
    assert ex.by_category == {"parameters": 0, "activations": -10, "outputs": 500}
    assert ex.excess_bytes == 490


def test_even_number_of_others_uses_the_mean_of_the_middle_two() -> None:
    s = ScenarioResult(name="x", devices=[
        _dev(0, loss=1000), _dev(1, activations=100), _dev(2, activations=300),
    ])
    ex = excess_by_cause(s)
    assert ex is not None and ex.reference_bytes == 200
    assert ex.by_category == {"activations": -200, "loss": 1000}


def test_breakdown_that_does_not_sum_to_the_peak_goes_to_other() -> None:
    a = DeviceResult(index=0, peak_allocated_bytes=1000, breakdown_bytes={"loss": 600})
    b = DeviceResult(index=1, peak_allocated_bytes=300, breakdown_bytes={})
    ex = excess_by_cause(ScenarioResult(name="x", devices=[a, b]))
    assert ex is not None and ex.by_category == {"loss": 600, "other": 100}


def test_no_attribution_without_two_used_devices_or_a_measurement() -> None:
    assert excess_by_cause(ScenarioResult(name="single", devices=[_dev(0, loss=1)])) is None
    two = [_dev(0, loss=1), _dev(1, loss=1)]
    assert excess_by_cause(ScenarioResult(name="x", status=STATUS_ERROR, devices=two)) is None
    unused = [_dev(0, loss=1), DeviceResult(index=1, used=False)]
    assert excess_by_cause(ScenarioResult(name="x", devices=unused)) is None
