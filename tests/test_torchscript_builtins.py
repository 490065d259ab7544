"""TorchScript under virtual GPUs: code scripted while dpprof's patches stand (torch.distributed
.optim scripts its functional optimizers at import; their bodies call ``torch.tensor``, which
dpprof replaces) compiles the replacement as the builtin it stands for, and after the run
TorchScript finds torch's own functions again."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from script_runs import run_script

from dpprof.emulator.patcher import builtin_op
from dpprof.emulator.virtual_cuda import VirtualCuda

SCRIPT = """
import torch, torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer  # scripts its optimizers here

@torch.jit.script
def scaled(x: torch.Tensor) -> torch.Tensor:
    return x * torch.tensor(2.0, device=x.device)

model = nn.Linear(64, 64).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    scaled(model(torch.randn(8, 64, device="cuda"))).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_script_that_scripts_torch_functions_runs(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for name in [m for m in sys.modules if m.startswith("torch.distributed.optim")]:
        monkeypatch.delitem(sys.modules, name)  # imported (and scripted) in the run
    s = run_script(tmp_path, SCRIPT)
    assert s.status == "ok", s.message


def test_replacements_stand_for_their_builtins_only_while_patched() -> None:
    original = torch.tensor
    assert builtin_op(original) == "aten::tensor"
    with VirtualCuda(1):
        assert torch.tensor is not original
        assert builtin_op(torch.tensor) == "aten::tensor"
        replacement = torch.tensor
    assert torch.tensor is original and builtin_op(original) == "aten::tensor"
    assert builtin_op(replacement) is None

    @torch.jit.script
    def doubled(x: torch.Tensor) -> torch.Tensor:
        return x * torch.tensor(2.0)

    assert doubled(torch.ones(2)).tolist() == [2.0, 2.0]
