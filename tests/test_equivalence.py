"""Does the fix change the math? Each scenario against single on the full batch."""

import torch
import torch.nn.functional as F
from torch import nn

from dpprof.measure.equivalence import StepState, check, compare_states, is_sum_reduction
from dpprof.scenarios.workloads import Workload, convnet


def _small_mlp(loss=F.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1)) -> Workload:
    return Workload(
        name="tiny", model=lambda: nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)),
        batch=lambda rows, device: (torch.randn(rows, 6), torch.randn(rows, 3)),
        loss=loss, optimizer=optimizer,
    )


def test_compare_states_reports_the_largest_difference() -> None:
    ref = StepState(loss=2.0, grads={"w": torch.tensor([1.0, -4.0])},
                    params={"w": torch.tensor([0.5, 0.5])})
    same = StepState(loss=2.0, grads={"w": torch.tensor([1.0, -4.0])},
                     params={"w": torch.tensor([0.5, 0.5])})
    off = StepState(loss=2.5, grads={"w": torch.tensor([1.0, -3.0])},
                    params={"w": torch.tensor([0.5, 0.25])})
    a, b = compare_states(ref, {"a": same, "b": off})
    assert a.equivalent and a.loss_diff == 0 and a.grad_max_diff == 0
    assert not b.equivalent and b.loss_diff == 0.5
    assert b.grad_max_diff == 0.25  # |(-3) - (-4)| relative to the largest |grad|, 4
    assert b.param_max_diff == 0.25


def test_even_shards_compute_the_same_step() -> None:
    eq = check(_small_mlp(), batch=8, gpus=4)
    assert {e.scenario for e in eq.entries} == {"dp-loss-primary", "dp-loss-forward", "ddp"}
    assert all(e.equivalent for e in eq.entries), eq.entries
    assert eq.largest_diff < 1e-5 and not eq.findings


def test_uneven_shards_plain_mean_is_biased_and_combine_is_not() -> None:
    eq = check(_small_mlp(), batch=10, gpus=4)  # shards 3, 3, 3, 1
    by = {e.scenario: e for e in eq.entries}
    assert by["dp-loss-forward"].equivalent  # ModelWithLoss.combine weights by rows
    assert by["dp-loss-primary"].equivalent
    assert not by["ddp"].equivalent  # equal weight per rank: the plain-mean bias
    (f,) = [f for f in eq.findings if f.kind == "uneven-mean"]
    assert f.effect > 1e-4 and "[3, 3, 3, 1]" in f.message and "combine" in f.message
    assert eq.largest_diff == max(e.grad_max_diff for e in eq.entries)


def test_batchnorm_and_dropout_are_found_and_sized() -> None:
    eq = check(convnet(), batch=8, gpus=2)
    kinds = {f.kind: f for f in eq.findings}
    assert {"batchnorm", "dropout"} <= set(kinds)
    assert kinds["batchnorm"].effect > 1e-3 and "SyncBatchNorm" in kinds["batchnorm"].message
    assert not any(e.equivalent for e in eq.entries)


def test_sum_reduction_is_detected_and_ddp_step_is_scaled() -> None:
    wl = _small_mlp(loss=lambda o, t: F.mse_loss(o, t, reduction="sum"))
    assert is_sum_reduction(wl, 8, 4, 0)
    assert not is_sum_reduction(_small_mlp(), 8, 4, 0)
    eq = check(wl, batch=8, gpus=4)
    (f,) = [f for f in eq.findings if f.kind == "sum-reduction"]
    # DDP averages over 4 ranks: its gradient is a quarter of single's, 0.75 off relative
    assert abs(f.effect - 0.75) < 1e-4
    assert "1/4" in f.message

