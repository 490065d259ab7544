"""The legacy tensor types older scripts use (``Tensor = torch.cuda.FloatTensor if cuda else
torch.FloatTensor``, ``x.type(Tensor)``, ``x.type()`` compared with a name) work on a
virtual GPU as on a GPU; a CPU build refused them all ("Cannot initialize CUDA without
ATen_cuda library", "type torch.cuda.FloatTensor not available"), and ``x.type()`` named
the meta tensor underneath ("torch.meta.FloatTensor")."""

from __future__ import annotations

import textwrap
from pathlib import Path

from script_runs import run_printing

SCRIPT = """
    import torch
    from torch import nn

    cuda = torch.cuda.is_available()
    Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor
    x = Tensor(4, 3).fill_(1.0)
    y = torch.ones(4, 3).type(Tensor)
    z = x.type(torch.cuda.HalfTensor)
    print(x.type(), y.type(), z.type(), y.type(x.type()).type())
    print(isinstance(x, Tensor), isinstance(z, torch.cuda.FloatTensor), isinstance(z, torch.Tensor))
    print(tuple(Tensor().shape), Tensor([1, 2]).tolist(), x.type(torch.FloatTensor).device)
    model = nn.Linear(3, 2).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(Tensor(8, 3).normal_()).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
"""


def test_legacy_tensor_types_work_on_a_virtual_gpu_as_on_a_gpu(tmp_path: Path) -> None:
    script = tmp_path / "legacy.py"
    script.write_text(textwrap.dedent(SCRIPT))
    result, printed = run_printing(script)
    (single,) = result.scenarios
    assert single.status == "ok", single.message
    assert printed.splitlines() == [
        "torch.cuda.FloatTensor torch.cuda.FloatTensor torch.cuda.HalfTensor "
        "torch.cuda.FloatTensor",
        "True False True",
        "(0,) [1.0, 2.0] cpu"]
