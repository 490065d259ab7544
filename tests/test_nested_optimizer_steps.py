"""An optimizer whose step calls another's (torch's ZeroRedundancyOptimizer, a Lookahead
wrapper built on ``torch.optim.Optimizer``) makes one step of the script: ``--steps`` counts
the outermost, as it counts a plain optimizer's."""

from __future__ import annotations

from pathlib import Path

import pytest
from script_runs import run_script

# the same loop with a plain optimizer, or wrapped by one that steps it
LOOP = """
import torch, torch.nn as nn

class Wrapped(torch.optim.Optimizer):
    def __init__(self, inner):
        self.inner = inner
        super().__init__(inner.param_groups, {{}})

    def step(self, closure=None):
        return self.inner.step(closure)

model = nn.Linear(64, 64).cuda()
opt = torch.optim.Adam(model.parameters())
opt = {wrap}
for i in range(10):
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
    print("stepped", i)
"""


@pytest.mark.parametrize("wrap", ["opt", "Wrapped(opt)"])
def test_a_wrapped_optimizers_step_is_one_step(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch,
                                               wrap: str) -> None:
    monkeypatch.chdir(tmp_path)
    s = run_script(tmp_path, LOOP.format(wrap=wrap))
    assert s.status == "ok", s.message
    stepped = [line for line in capsys.readouterr().out.splitlines()
               if line.startswith("stepped")]
    # --steps 3 (the default): the script is stopped in its third step, after two
    assert stepped == ["stepped 0", "stepped 1"]
    assert any("stopped after 3 optimizer step(s)" in n for n in s.notes)
