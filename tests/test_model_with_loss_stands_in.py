"""``ModelWithLoss`` stands in for the model where a script reaches it as ``model.module``.

The loss-inside-forward fix makes the wrapped module a ``ModelWithLoss``: before, every key of
``model.state_dict()`` gained ``model.`` (``module.model.conv1.weight``), so a checkpoint saved
before the fix no longer loaded after it (and the other way), and ``model.module.fc`` raised.
Found on pytorch/examples' ImageNet script, which saves ``model.state_dict()`` and resumes
from it (``--resume``). Here: generated models and losses, every key and value as without the
wrapper, loads both ways, and a script as people write it, fixed by dpprof's own diff, resuming
from the checkpoint its unfixed self wrote (and the other way)."""

from __future__ import annotations

import contextlib
import io
import itertools
import runpy
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpprof
from tests.test_script_rewrite import checked, lif, line_of


class Backbone(nn.Module):
    """A model whose own submodule is named ``model`` (as a Hugging Face ``...ForCausalLM``'s
    is), with BatchNorm's buffers and a head the script reaches by name."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.model(x))


def plain() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 3))


WEIGHTED = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0]))

MODELS = {"backbone": Backbone, "sequential": plain}
LOSSES = {
    "module": lambda: nn.CrossEntropyLoss(),
    "weighted module": lambda: WEIGHTED,  # a buffer of the loss's own
    "function of a weighted module": lambda: (lambda out, y: WEIGHTED(out, y) + out.pow(2).mean()),
    "functional": lambda: F.cross_entropy,
}
CASES = list(itertools.product(MODELS, LOSSES, [False, True]))


def _pair(model: str, loss: str, data_parallel: bool) -> tuple[nn.Module, nn.Module]:
    """(the model as written, the same model with the fix), equal weights."""
    torch.manual_seed(0)
    net = MODELS[model]()
    fixed = dpprof.ModelWithLoss(MODELS[model](), LOSSES[loss]())
    fixed.model.load_state_dict(net.state_dict())
    if data_parallel:
        return nn.DataParallel(net), nn.DataParallel(fixed)
    return net, fixed


def _saved(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state dict through a file, as a checkpoint is."""
    buf = io.BytesIO()
    torch.save(module.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf)  # type: ignore[no-any-return]


@pytest.mark.parametrize(("model", "loss", "data_parallel"), CASES)
def test_the_state_dict_is_the_model_s_and_loads_both_ways(model: str, loss: str,
                                                           data_parallel: bool) -> None:
    written, fixed = _pair(model, loss, data_parallel)
    before, after = written.state_dict(), fixed.state_dict()
    assert list(before) == list(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    for source, target in ((written, fixed), (fixed, written)):
        with torch.no_grad():
            for t in source.state_dict(keep_vars=True).values():
                t.add_(1)  # a trained checkpoint: every value other than the target's
        result = target.load_state_dict(_saved(source))  # strict: every key, no other
        assert not result.missing_keys and not result.unexpected_keys
        assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(),
                                                     target.state_dict().values(),
                                                     strict=True))


def test_the_loss_s_own_buffers_stay_as_they_are_through_a_load() -> None:
    fixed = nn.DataParallel(dpprof.ModelWithLoss(Backbone(), nn.CrossEntropyLoss(
        weight=torch.tensor([1.0, 2.0, 3.0]))))
    fixed.load_state_dict(nn.DataParallel(Backbone()).state_dict())
    assert torch.equal(fixed.module.loss_fn.weight, torch.tensor([1.0, 2.0, 3.0]))


def test_a_load_names_the_keys_as_the_state_dict_had_them() -> None:
    fixed = nn.DataParallel(dpprof.ModelWithLoss(Backbone(), nn.CrossEntropyLoss()))
    given = nn.DataParallel(Backbone()).state_dict()
    given.pop("module.fc.bias")
    given["module.head.weight"] = torch.zeros(1)
    with pytest.raises(RuntimeError) as e:
        fixed.load_state_dict(given)
    assert 'Missing key(s) in state_dict: "module.fc.bias"' in str(e.value)
    assert 'Unexpected key(s) in state_dict: "module.head.weight"' in str(e.value)
    assert "module.model.fc" not in str(e.value)
    result = fixed.module.load_state_dict({k[7:]: v for k, v in given.items()}, strict=False)
    assert (result.missing_keys, result.unexpected_keys) == (["fc.bias"], ["head.weight"])


def test_the_model_s_attributes_read_and_set_through_the_wrapper() -> None:
    net = Backbone()
    model = nn.DataParallel(dpprof.ModelWithLoss(net, nn.CrossEntropyLoss()))
    assert model.module.fc is net.fc  # an optimizer's group: model.module.fc.parameters()
    assert model.module.model is net  # the wrapper's own names stay its own
    head = nn.Linear(8, 3)
    model.module.fc = head  # a new head, as fine-tuning sets one
    assert net.fc is head and "fc" not in model.module._modules
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    loss = dpprof.ModelWithLoss.combine(model(x, y))
    assert torch.allclose(loss, F.cross_entropy(head(net.model(x)), y))
    with pytest.raises(AttributeError):
        _ = model.module.no_such_attribute


RESUMING = '''\
import sys
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(self.features(x))


torch.manual_seed(0)
model = nn.DataParallel(Net())
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD([
    {"params": model.module.features.parameters()},
    {"params": model.module.fc.parameters(), "lr": 0.5},
], lr=0.1, momentum=0.9)
if len(sys.argv) > 2:
    checkpoint = torch.load(sys.argv[2])
    model.load_state_dict(checkpoint["state_dict"])
    model.module.load_state_dict(checkpoint["module"])
    optimizer.load_state_dict(checkpoint["optimizer"])
for step in range(3):
    x, y = torch.randn(12, 8), torch.randint(0, 4, (12,))
    out = model(x)
    loss = criterion(out, y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"{loss.item():.6f}")
torch.save({"state_dict": model.state_dict(), "module": model.module.state_dict(),
            "optimizer": optimizer.state_dict()}, sys.argv[1])
'''


def test_the_fixed_script_resumes_from_the_written_one_s_checkpoint_and_back(
        tmp_path: Path) -> None:
    """dpprof's own diff applied; on a machine without GPUs DataParallel calls its module
    directly, so both scripts run for real: each resumes from the other's checkpoint, with
    the same keys and the same losses as resuming from its own."""
    fixed = checked(lif(RESUMING, "nn.DataParallel(", "out = model", "loss = criterion"),
                    RESUMING)
    assert line_of(fixed, "dpprof.ModelWithLoss(Net(), criterion)")
    scripts = {"written": tmp_path / "written.py", "fixed": tmp_path / "fixed.py"}
    scripts["written"].write_text(RESUMING)
    scripts["fixed"].write_text(fixed)

    def run(name: str, save: str, resume: str = "") -> list[str]:
        # in this process (a new one would spend its time importing torch): the scripts
        # seed torch themselves, and this machine's torch has no GPU to hide
        argv = [str(scripts[name]), str(tmp_path / save), *([str(tmp_path / resume)] if resume
                                                             else [])]
        printed = io.StringIO()
        with mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(printed):
            runpy.run_path(argv[0], run_name="__main__")
        return printed.getvalue().split()

    first = {name: run(name, f"{name}.pt") for name in scripts}
    assert first["written"] == first["fixed"]  # the same training, the same losses
    saved = {name: torch.load(tmp_path / f"{name}.pt") for name in scripts}
    for part in ("state_dict", "module"):
        assert list(saved["written"][part]) == list(saved["fixed"][part])
    resumed = {(name, other): run(name, f"{name}-from-{other}.pt", f"{other}.pt")
               for name in scripts for other in scripts}
    assert len({tuple(v) for v in resumed.values()}) == 1
