"""A DataParallel script whose replicas compute their loss already (its model returns the loss
itself, or beside its logits under "loss" as a Hugging Face model does: the Trainer wraps it
in DataParallel on a machine of several GPUs) is ``dp-loss-forward``: the fix it asks for is
DDP, which is measured, and cuda:0's gathered outputs are said to come from what forward
returns beside the loss, not from a loss to move inside forward."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from dpprof.result import RunResult
from dpprof.script.session import ScriptConfig, parse_command, run_command

SCRIPT = """
    import torch
    import torch.nn as nn

    V, D = 4000, 64
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, D)
            self.head = nn.Linear(D, V)
        def forward(self, ids, labels):
            logits = self.head(self.emb(ids))
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            return {returned}
    model = nn.DataParallel(LM().cuda())
    opt = torch.optim.AdamW(model.parameters())
    for step in range(4):
        ids = torch.randint(0, V, (32, 64), device="cuda")
        out = model(ids, ids)
        loss = {loss}.mean()
        opt.zero_grad(); loss.backward(); opt.step()
"""


def _run(tmp_path: Path, returned: str, loss: str) -> RunResult:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(returned=returned, loss=loss)))
    result, main = run_command(ScriptConfig(launch=parse_command(["python", str(script)], 4)))
    assert main.exit_status == 0, main.script_traceback
    return result


@pytest.mark.parametrize(("returned", "loss"), [
    ('{"loss": loss, "logits": logits}', 'out["loss"]'),  # Hugging Face's ModelOutput
    ("loss", "out"),  # the loss alone
])
def test_the_loss_computed_by_the_replicas_gets_the_ddp_alternative(
        tmp_path: Path, returned: str, loss: str) -> None:
    result = _run(tmp_path, returned, loss)
    names = [s.name for s in result.scenarios]
    assert names == ["dp-loss-forward", "ddp"], names
    assert [f.name for f in result.fixes][:1] == ["ddp"]
    assert not any(n.startswith("no loss-inside-forward alternative") for n in result.notes)


def test_logits_gathered_beside_the_loss_are_said_to_be_what_forward_returns(
        tmp_path: Path) -> None:
    result = _run(tmp_path, '{"loss": loss, "logits": logits}', 'out["loss"]')
    att = result.attribution["dp-loss-forward"]
    assert att.causes_bytes["gathered_outputs"] > 0  # the logits, 32 x 64 x 4,000 floats
    assert ("the replicas compute their loss already, and DataParallel gathers on cuda:0 "
            "what forward returns beside it") in att.answer
    assert "ModelWithLoss" not in att.answer
