"""RNNs on a virtual GPU: a GPU runs cuDNN's RNN, which the emulation does not play (cuDNN
alone knows its reserve space's size); the run says so, with the calls counted, and says
nothing of it where no RNN ran on a virtual GPU. nn.LSTMCell and nn.GRUCell run CUDA's fused
cells (``_thnn_fused_lstm_cell``, ``_thnn_fused_gru_cell``), as a CUDA build runs them: the
same as the script that calls those kernels itself, and, on the host, what torch's own cells
compute and allocate."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from dpprof.backends.memtrace import record
from dpprof.emulator.kernels import GpuKernels
from dpprof.script.session import ScriptConfig, parse_command, run_command

SCRIPT = """
    import torch, torch.nn as nn
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.{layer}(32, 64, batch_first=True)
            self.cell = nn.{cell}(64, 64)
            self.out = nn.Linear(64, 10)
        def forward(self, x):
            y = self.rnn(x)[0]
            h = torch.zeros(x.size(0), 64, device=x.device)
            state = (h, h) if isinstance(self.cell, nn.LSTMCell) else h
            for t in range(3):
                state = self.cell(y[:, t], state)
            return self.out(state[0] if isinstance(state, tuple) else state)
    model = M().to("{device}")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(16, 8, 32, device="{device}")
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
    torch.zeros(1, device="cuda")  # something on the GPU, whatever the model's device
"""


def _notes(tmp_path: Path, layer: str, device: str, cell: str = "LSTMCell"
           ) -> tuple[str, ...]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(layer=layer, device=device, cell=cell)))
    result, main = run_command(ScriptConfig(launch=parse_command(["python", str(script)], 1),
                                            gpus=1))
    assert main.exit_status == 0, main.script_traceback
    return result.scenarios[0].notes


@pytest.mark.parametrize(("layer", "cell", "calls"), [
    ("LSTM", "LSTMCell", "cudnn_rnn x3"), ("GRU", "GRUCell", "cudnn_rnn x3"),
    ("RNN", "LSTMCell", "cudnn_rnn x3")])
def test_an_rnn_on_a_virtual_gpu_is_said_not_to_be_played_as_cudnn(
        tmp_path: Path, layer: str, cell: str, calls: str) -> None:
    notes = _notes(tmp_path, layer, "cuda", cell)
    note = next(n for n in notes if n.startswith("nn.LSTM, nn.GRU"))
    # the sequence layer once a step, the cell three times a step, over the 2 measured steps
    # and the warm-up: counted as the calls were made
    assert f"(calls: {calls})" in note
    assert "cuDNN's RNN" in note and "not the GPU's figure" in note
    fused = "lstm_cell:fused x9" if cell == "LSTMCell" else "gru_cell:fused x9"
    assert fused in " ".join(notes)


def test_an_rnn_on_the_host_is_not_noted(tmp_path: Path) -> None:
    assert not any(n.startswith("nn.LSTM, nn.GRU") for n in _notes(tmp_path, "LSTM", "cpu"))


CELLS = """
    import torch, torch.nn as nn
    cell = nn.{cell}(64, 96).cuda()
    opt = torch.optim.SGD(cell.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(8, 5, 64, device="cuda")
        h = c = torch.zeros(8, 96, device="cuda")
        for t in range(5):
            {step}
        h.pow(2).mean().backward()
        opt.step(); opt.zero_grad()
"""
# RNN.cpp's LSTMCell and GRUCell on a CUDA input, spelled out: the gates' two matmuls, then
# the fused kernel
BY_CELL = {"LSTMCell": "h, c = cell(x[:, t], (h, c))", "GRUCell": "h = cell(x[:, t], h)"}
BY_KERNEL = {
    "LSTMCell": ("h, c = torch.ops.aten._thnn_fused_lstm_cell(torch.matmul(x[:, t], "
                 "cell.weight_ih.t()), torch.matmul(h, cell.weight_hh.t()), c, cell.bias_ih, "
                 "cell.bias_hh)[:2]"),
    "GRUCell": ("h = torch.ops.aten._thnn_fused_gru_cell(torch.matmul(x[:, t], "
                "cell.weight_ih.t()), torch.matmul(h, cell.weight_hh.t()), h, cell.bias_ih, "
                "cell.bias_hh)[0]"),
}


def _peak(tmp_path: Path, cell: str, step: str) -> tuple[int, dict[str, int]]:
    script = tmp_path / "cells.py"
    script.write_text(textwrap.dedent(CELLS.format(cell=cell, step=step)))
    result, main = run_command(ScriptConfig(launch=parse_command(["python", str(script)], 1),
                                            gpus=1))
    assert main.exit_status == 0, main.script_traceback
    d = result.scenarios[0].devices[0]
    return d.peak_allocated_bytes, dict(d.breakdown_bytes)


@pytest.mark.parametrize("cell", ["LSTMCell", "GRUCell"])
def test_a_cell_on_a_virtual_gpu_runs_cudas_fused_cell(tmp_path: Path, cell: str) -> None:
    assert _peak(tmp_path, cell, BY_CELL[cell]) == _peak(tmp_path, cell, BY_KERNEL[cell])


@pytest.mark.parametrize("cell", ["LSTMCell", "GRUCell"])
def test_a_cell_on_the_host_computes_and_allocates_as_torchs_own(cell: str) -> None:
    gen = torch.Generator().manual_seed(0)
    module = getattr(torch.nn, cell)(6, 5)
    x, h, c = (torch.randn(3, n, generator=gen) for n in (6, 5, 5))

    def run() -> list[torch.Tensor]:
        out = module(x, (h, c)) if cell == "LSTMCell" else (module(x, h),)
        total = out[0] * out[-1] if len(out) > 1 else out[0]
        return [*out, *torch.autograd.grad(total.sum(), list(module.parameters()))]

    plain, plain_allocations = run(), [a.size for a in record(run)[1]]
    with GpuKernels():
        ours, our_allocations = run(), [a.size for a in record(run)[1]]
    for a, b in zip(ours, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert our_allocations == plain_allocations
