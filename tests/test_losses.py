"""Which calls are a script's loss (:mod:`dpprof.scenarios.losses`)."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from dpprof.scenarios.losses import functional_loss_names, is_functional_loss, is_loss


def test_each_loss_module_of_torch_computes_with_a_function_the_rule_counts() -> None:
    # the rule is read from torch's own loss modules: each one's forward calls one of them
    import torch.nn.modules.loss as losses

    modules = [cls for _, cls in inspect.getmembers(losses, inspect.isclass)
               if issubclass(cls, losses._Loss) and not cls.__name__.startswith("_")]
    assert len(modules) >= 20
    names = set(functional_loss_names())
    for cls in modules:
        called = {n for n in names if f"F.{n}(" in inspect.getsource(cls.forward)}
        assert called, cls.__name__
    assert {"cross_entropy", "nll_loss", "mse_loss", "binary_cross_entropy_with_logits",
            "kl_div", "ctc_loss"} <= names
    # activations and other functions of torch.nn.functional are not losses
    assert not {"log_softmax", "softmax", "relu", "dropout", "linear"} & names


def test_the_three_forms_of_a_loss() -> None:
    class Focal(nn.Module):  # a loss of the script's own: no parameters, two arguments
        def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits, target)

    assert is_loss(nn.CrossEntropyLoss(), 2)
    assert is_loss(F.cross_entropy, 2) and is_loss(torch.nn.functional.nll_loss, 2)
    assert is_loss(Focal(), 2)
    assert not is_loss(Focal(), 1)  # one argument: an activation's call (nn.Sigmoid()(x))
    assert not is_loss(nn.Linear(4, 4), 2)  # parameters: a model
    assert not is_loss(F.log_softmax, 2) and not is_loss(torch.add, 2)
    assert not is_loss(lambda a, b: a, 2)
    assert not is_functional_loss({})  # not even callable


def test_a_patched_functional_loss_is_still_the_loss() -> None:
    import functools

    @functools.wraps(F.cross_entropy)
    def patched(*args: object, **kwargs: object) -> object:
        return F.cross_entropy(*args, **kwargs)

    assert is_functional_loss(patched)


def test_a_partial_of_a_functional_loss_is_the_loss() -> None:
    import functools

    assert is_loss(functools.partial(F.cross_entropy, ignore_index=-1), 2)


def test_a_functional_call_is_the_module_that_computes_the_same() -> None:
    from dpprof.scenarios.losses import as_module_call

    x, y = torch.randn(6, 5), torch.tensor([0, 1, 2, 3, 4, 0])
    w = torch.linspace(0.5, 2.0, 5)
    module, args = as_module_call(F.cross_entropy, (x, y), {"weight": w, "ignore_index": 0,
                                                           "label_smoothing": 0.1}) or (None, ())
    assert isinstance(module, nn.CrossEntropyLoss)
    assert module.ignore_index == 0 and module.label_smoothing == 0.1
    assert args[0] is x and args[1] is y
    torch.testing.assert_close(module(*args), F.cross_entropy(x, y, weight=w, ignore_index=0,
                                                              label_smoothing=0.1))
    module, _ = as_module_call(F.kl_div, (x.log_softmax(1), x.softmax(1)),
                               {"reduction": "batchmean"}) or (None, ())
    assert isinstance(module, nn.KLDivLoss) and module.reduction == "batchmean"
    assert as_module_call(F.cross_entropy, (x,), {}) is None  # no targets: does not bind
