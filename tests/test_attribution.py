"""Attribution of cuda:0's excess: byte-exact, and the answers it gives."""

import pytest

from dpprof.analysis.attribution import attribute, attribute_run
from dpprof.analysis.comparison import compare_scenario
from dpprof.pipeline import CompareConfig, run_compare
from dpprof.result import DeviceResult, ScenarioResult


def _dev(i: int, rows: int, **cats: int) -> DeviceResult:
    return DeviceResult(index=i, peak_allocated_bytes=sum(cats.values()), breakdown_bytes=cats,
                        batch_rows=rows)


@pytest.mark.parametrize("workload,batch,gpus", [
    ("mlp", 10, 4), ("mlp", 8, 3), ("classifier", 7, 2), ("convnet", 9, 4),
])
def test_causes_add_up_to_the_excess(workload: str, batch: int, gpus: int) -> None:
    run = run_compare(CompareConfig(workload=workload, batch=batch, gpus=gpus, fixes=False,
                                    scenarios=("dp-loss-primary", "dp-loss-forward", "ddp")))
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
    run = run_compare(CompareConfig(batch=8, fixes=False, scenarios=("dp-loss-forward",)),
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
    run = run_compare(CompareConfig(batch=7, gpus=2, fixes=False,
                                    scenarios=("dp-loss-forward",)), workload=wl)  # 4, 3 rows
    att = run.attribution["dp-loss-forward"]
    assert att.causes_bytes.get("larger_shard", 0) > 0
    assert sum(att.causes_bytes.values()) == att.excess_bytes
