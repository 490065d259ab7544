"""What a script asks of its loss's finiteness, answered over virtual GPUs as a GPU with
finite values answers it, each check by its own result.

zylo117's EfficientDet skips a step with ``if loss == 0 or not torch.isfinite(loss):
continue``. The emulation answered every boolean read on a line that names ``isfinite``
True, ``loss == 0`` too: every step was skipped, and the run measured no optimizer step
("it never called optimizer.step()"). ``torch.isfinite`` and its kin now give results whose
values are known (True for ``isfinite``, False for ``isnan`` and ``isinf``), through
``.all()``, ``~`` and ``not``, while a comparison of the loss keeps its own stand-in."""

from __future__ import annotations

from pathlib import Path

from script_runs import printed_on_the_host, run_printing

SCRIPT = """
import torch
from torch import nn

dev = "cuda"
torch.manual_seed(0)
model = nn.Linear(64, 8).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    x = torch.randn(16, 64, device=dev)
    loss = model(x).pow(2).mean()
    if step == 0:
        print("isfinite", bool(torch.isfinite(loss)), bool(torch.isfinite(loss).all()),
              bool(loss.isfinite()))
        print("isnan", bool(torch.isnan(loss)), bool(torch.isnan(model(x)).any()),
              bool(torch.isinf(loss)), bool((~torch.isfinite(model(x))).any()))
        print("beside a comparison", bool(loss == 0 or not torch.isfinite(loss)))
    if loss == 0 or not torch.isfinite(loss):
        continue
    opt.zero_grad()
    loss.backward()
    opt.step()
    print("stepped", step)
"""


def test_each_check_answers_as_for_finite_values_and_a_comparison_beside_it_its_own(
        tmp_path: Path) -> None:
    source = SCRIPT
    script = tmp_path / "train.py"
    script.write_text(source)
    result, printed = run_printing(script)
    (s,) = result.scenarios
    assert s.status == "ok", s.message
    checks = [line for line in printed.splitlines() if not line.startswith("stepped")]
    host = printed_on_the_host(tmp_path, source).splitlines()
    assert checks == [line for line in host if not line.startswith("stepped")]
    assert checks == ["isfinite True True True", "isnan False False False False",
                      "beside a comparison False"]
    # the steps run: --steps 3 stops the script in its third
    assert [line for line in printed.splitlines() if line.startswith("stepped")] == [
        "stepped 0", "stepped 1"]
    assert any("stopped after 3 optimizer step(s)" in n for n in s.notes), s.notes


def test_a_check_under_a_default_device_answers_true_as_before(tmp_path: Path) -> None:
    """Under ``torch.set_default_device("cuda")`` a tensor of a virtual GPU does not say it is
    meta (a DeviceContext answers), so its check's result is not followed: its line's
    booleans answer as the check would (a comparison beside it too), and the step is
    taken."""
    source = SCRIPT.replace('dev = "cuda"\n', 'dev = "cuda"\ntorch.set_default_device(dev)\n'
                            ).replace("torch.randn(16, 64, device=dev)", "torch.randn(16, 64)"
                                      ).replace("if loss == 0 or not torch.isfinite(loss):",
                                                "if not torch.isfinite(loss):")
    script = tmp_path / "train.py"
    script.write_text(source)
    result, printed = run_printing(script)
    assert result.scenarios[0].status == "ok", result.scenarios[0].message
    assert "isfinite True True True" in printed
    assert [line for line in printed.splitlines() if line.startswith("stepped")] == [
        "stepped 0", "stepped 1"]
