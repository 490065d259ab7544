"""A loss's own tensors on each replica (``dpprof.scenarios.loss_state``).

``ModelWithLoss`` given a function of the outputs holds the loss modules the function
computes with as submodules, so DataParallel copies their parameters and buffers to every
replica, and the function, run on a replica, computes with the copies. Found on a
DataParallel script whose ``nn.CrossEntropyLoss(weight=w)`` lost its loss-inside-forward
alternative: cuda:1's replica read cuda:0's weights. The end-to-end check (peaks equal to the
fix by hand, the printed losses equal to the script's) is in ``test_run_loss_forms.py``."""

from __future__ import annotations

import functools
import pickle

import torch
import torch.nn.functional as F
from torch import nn

import dpprof
from dpprof.scenarios.loss_state import modules_of, on_the_replica

MODEL = nn.Linear(4, 3)
WEIGHTED = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0]))
PLAIN = nn.MSELoss()


class Holder:
    """A training script's object holding its criterion (``self.criterion``)."""

    def __init__(self) -> None:
        self.criterion = WEIGHTED
        self.unused = PLAIN

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.criterion(out, y)


HOLDER = Holder()


def by_global(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return WEIGHTED(out, y) + 0.5 * PLAIN(out, out.detach())


def test_the_modules_a_function_computes_with_are_found_where_it_reaches_them() -> None:
    criterion = WEIGHTED

    def closure(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return criterion(out, y)

    assert modules_of(closure, MODEL) == [WEIGHTED]
    assert modules_of(by_global, MODEL) == [WEIGHTED, PLAIN]
    assert modules_of(lambda out, y: HOLDER.criterion(out, y), MODEL) == [WEIGHTED]
    assert modules_of(HOLDER.loss, MODEL) == [WEIGHTED]  # the method's object's, read
    assert modules_of(functools.partial(lambda c, out, y: c(out, y), WEIGHTED), MODEL) == [
        WEIGHTED]
    assert modules_of(lambda out, y, c=PLAIN: c(out, y), MODEL) == [PLAIN]  # a default


def test_the_model_s_own_modules_wrappers_and_torch_s_functions_are_left_out() -> None:
    dp = nn.DataParallel(MODEL)
    assert modules_of(lambda out, y: F.linear(out, dp.module.weight) + MODEL(out), MODEL) == []
    assert modules_of(F.cross_entropy, MODEL) == []
    outer = nn.Sequential(WEIGHTED)
    assert modules_of(lambda out, y: outer(out) + WEIGHTED(out, y), MODEL) == [outer]


def test_a_function_loss_s_modules_are_the_wrapper_s_and_a_module_loss_is_itself() -> None:
    wrapped = dpprof.ModelWithLoss(MODEL, by_global)
    assert list(wrapped.loss_modules) == [WEIGHTED, PLAIN]
    # its buffers, which replicate copies to every GPU (the state_dict is the model's alone)
    assert "loss_modules.0.weight" in dict(wrapped.named_buffers())
    assert "loss_modules.0.weight" not in wrapped.state_dict()
    assert len(dpprof.ModelWithLoss(MODEL, WEIGHTED).loss_modules) == 0
    again = pickle.loads(pickle.dumps(dpprof.ModelWithLoss(MODEL, WEIGHTED)))
    assert isinstance(again, dpprof.ModelWithLoss)


def test_on_a_replica_the_function_computes_with_the_replica_s_copies() -> None:
    source = dpprof.ModelWithLoss(MODEL, lambda out, y: WEIGHTED(out, y))
    # what torch.nn.parallel.replicate makes of each module: a shallow copy, its buffers
    # and parameters the broadcast's copies (here: other values, to tell them apart)
    replica = source._replicate_for_data_parallel()
    loss_copy = WEIGHTED._replicate_for_data_parallel()
    loss_copy._buffers = {"weight": torch.tensor([5.0, 1.0, 1.0])}
    replica._modules = {"model": MODEL, "loss_modules": nn.ModuleList([loss_copy])}
    out, y = torch.randn(6, 3), torch.tensor([0, 1, 2, 0, 1, 2])
    with on_the_replica(replica, source):
        on_replica = replica.loss_fn(out, y)
    expected = F.cross_entropy(out, y, weight=torch.tensor([5.0, 1.0, 1.0]))
    assert torch.equal(on_replica, expected)
    with on_the_replica(source, source):  # the original: its own weights
        assert torch.equal(source.loss_fn(out, y), WEIGHTED(out, y))
    assert not torch.equal(expected, WEIGHTED(out, y))
