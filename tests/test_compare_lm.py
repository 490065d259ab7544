"""The default comparison (lm, batch 512, 4 emulated GPUs) tells the classic story."""

import pytest

from dpprof.emulator.allocator_config import block_bytes
from dpprof.pipeline import CompareConfig, run_compare
from dpprof.result import RunResult
from dpprof.scenarios.step import StepConfig
from dpprof.scenarios.workloads import LMConfig


@pytest.fixture(scope="module")
def run() -> RunResult:
    return run_compare(CompareConfig(step=StepConfig(batch=512)))


def test_cuda0_carries_the_gathered_logits_and_their_loss(run: RunResult) -> None:
    c = LMConfig()
    logits = 512 * c.seq * c.vocab * 4  # gathered on cuda:0: batch x seq x vocab floats
    prim = run.scenario("dp-loss-primary")
    assert prim is not None and prim.status == "ok"
    dev0, dev1 = prim.devices[0], prim.devices[1]
    # At cuda:0's peak (log_softmax backward): the saved log_softmax output, the gradient
    # nll_loss hands back and the gradient of the logits: three whole-batch logits; and the
    # gathered logits themselves, which the loop's ``outputs`` keeps alive through backward.
    assert dev0.breakdown_bytes["loss"] == 3 * block_bytes(logits) + 512  # + the loss itself
    assert dev0.breakdown_bytes["outputs"] == block_bytes(logits)
    assert dev0.peak_phase == "backward"
    # The other GPUs hold their quarter of the logits' gradient, scattered back.
    assert dev1.breakdown_bytes["outputs"] == block_bytes(logits // 4)
    excess = run.comparison.scenarios["dp-loss-primary"].primary_excess_bytes
    # The excess is those four logits less the quarter the others hold, give or take the
    # master copy's optimizer state and parameters (< 1 GiB here).
    assert abs(excess - (4 * logits - logits // 4)) < 2**30
    assert run.comparison.scenarios["dp-loss-primary"].imbalance > 2


def test_loss_in_forward_removes_most_of_it(run: RunResult) -> None:
    fwd = run.comparison.scenarios["dp-loss-forward"]
    prim = run.comparison.scenarios["dp-loss-primary"]
    assert fwd.primary_excess_bytes < prim.primary_excess_bytes / 20
    assert fwd.primary_excess_bytes > 0  # master parameters and optimizer state remain
    assert run.comparison.savings_bytes["dp-loss-forward"] > 30 * 2**30


def test_ddp_is_balanced(run: RunResult) -> None:
    ddp = run.scenario("ddp")
    assert ddp is not None
    peaks = {d.peak_allocated_bytes for d in ddp.devices}
    assert len(peaks) == 1 and len(ddp.devices) == 4
    assert run.comparison.scenarios["ddp"].imbalance == 1.0
    single = run.scenario("single")
    assert single is not None
    # DDP = one GPU on its shard plus the reducer's buckets (the size of the gradients);
    # over NCCL (the default) the first iteration's buckets, replaced at the rebuild, are
    # still kept by their all-reduce's work in the measured step: the peak a GPU reaches
    # holds both sets, the steady state the rebuilt one.
    import torch

    from dpprof.scenarios.workloads import TinyLM

    with torch.device("meta"):
        grad_bytes = sum(p.numel() * 4 for p in TinyLM(LMConfig()).parameters())
    rank = ddp.devices[0]
    first_buckets = rank.transient_bytes["ddp_unreaped_buckets"]
    buckets = rank.breakdown_bytes["communication"] - first_buckets
    for held in (buckets, first_buckets):
        assert 0 <= held - grad_bytes < 512 * 20  # a few buckets, each rounded to 512 B
    peak_over_single = rank.peak_allocated_bytes - single.devices[0].peak_allocated_bytes
    assert peak_over_single == buckets + first_buckets
    assert rank.steady_peak_allocated_bytes is not None
    assert rank.steady_peak_allocated_bytes - single.devices[0].peak_allocated_bytes == buckets


def test_breakdowns_add_up_and_json_round_trips(run: RunResult) -> None:
    for s in run.scenarios:
        for d in s.devices:
            assert sum(d.breakdown_bytes.values()) == d.peak_allocated_bytes
            assert d.peak_requested_bytes <= d.peak_allocated_bytes
    again = RunResult.from_dict(__import__("json").loads(run.to_json()))
    assert again == run
    assert "cuda:0 needs" in run.comparison.verdict


def test_cost_does_not_grow_with_batch() -> None:
    """Meta tensors: a 64x larger batch changes the bytes, not the work (same op count)."""
    from dpprof.backends.emulated import EmulationConfig, run_scenario
    from dpprof.scenarios.workloads import lm

    small = run_scenario("single", lm(), EmulationConfig(
        gpus=4, gpu_memory_bytes=2**40,
        step=StepConfig(batch=8),
    ))
    big = run_scenario("single", lm(), EmulationConfig(
        gpus=4, gpu_memory_bytes=2**40,
        step=StepConfig(batch=512),
    ))
    assert big.devices[0].peak_allocated_bytes > 20 * small.devices[0].peak_allocated_bytes
    assert len(big.devices[0].timeline) == len(small.devices[0].timeline)


def test_oom_is_a_result_naming_the_device() -> None:
    run = run_compare(CompareConfig(gpu_memory_bytes=30 * 2**30, step=StepConfig(batch=512)))
    prim = run.scenario("dp-loss-primary")
    assert prim is not None and prim.status == "oom" and prim.oom_device == 0
    assert "cuda:0" in prim.message and "needs" in prim.message
    assert run.scenario("single").status == "ok"  # the others still ran
    assert "out of memory" in run.comparison.verdict
