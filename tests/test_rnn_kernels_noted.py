"""RNNs on a virtual GPU: a GPU runs cuDNN's RNN and fused LSTM/GRU cells, which the
emulation does not play (cuDNN alone knows its reserve space's size); the run says so, with
the calls counted, and says nothing of it where no RNN ran on a virtual GPU."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from dpprof.script.session import ScriptConfig, parse_command, run_command

SCRIPT = """
    import torch, torch.nn as nn
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.{layer}(32, 64, batch_first=True)
            self.cell = nn.LSTMCell(64, 64)
            self.out = nn.Linear(64, 10)
        def forward(self, x):
            y = self.rnn(x)[0]
            h = c = torch.zeros(x.size(0), 64, device=x.device)
            for t in range(3):
                h, c = self.cell(y[:, t], (h, c))
            return self.out(h)
    model = M().to("{device}")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(16, 8, 32, device="{device}")
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
    torch.zeros(1, device="cuda")  # something on the GPU, whatever the model's device
"""


def _notes(tmp_path: Path, layer: str, device: str) -> tuple[str, ...]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(layer=layer, device=device)))
    result, main = run_command(ScriptConfig(launch=parse_command(["python", str(script)], 1),
                                            gpus=1))
    assert main.exit_status == 0, main.script_traceback
    return result.scenarios[0].notes


@pytest.mark.parametrize("layer", ["LSTM", "GRU", "RNN"])
def test_an_rnn_on_a_virtual_gpu_is_said_not_to_be_played_as_cudnn(
        tmp_path: Path, layer: str) -> None:
    note = next(n for n in _notes(tmp_path, layer, "cuda") if n.startswith("nn.LSTM, nn.GRU"))
    # the sequence layer once a step, the cell three times a step, over the 2 measured steps
    # and the warm-up: counted as the calls were made
    assert "(calls: cudnn_rnn x3, fused_rnn_cell x9)" in note
    assert "cuDNN's RNN" in note and "not the GPU's figure" in note


def test_an_rnn_on_the_host_is_not_noted(tmp_path: Path) -> None:
    assert not any(n.startswith("nn.LSTM, nn.GRU") for n in _notes(tmp_path, "LSTM", "cpu"))
