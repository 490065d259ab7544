"""A DataParallel that splits the batch along another dimension than the first
(``nn.DataParallel(model, dim=1)``, a sequence-first model's ``(T, B)`` batches): both fixes
are offered, measured and written for it, each checked against the code a user would write.

- The loss inside forward: DataParallel gathers the replicas' losses along its ``dim``, so
  ``ModelWithLoss`` takes the same ``dim`` and returns them with a dimension to gather along
  (one number a replica has none: "Dimension out of range", as on a GPU).
- DDP: each rank makes its share of a hand-made batch along that dimension
  (``torch.randint(0, V, (T, B // 4))``), not along the first (the sequence)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from script_runs import run_printing
from test_run_ddp_share import LM_MODEL
from test_script_rewrite import apply_diff
from torch import nn

from dpprof import ModelWithLoss
from dpprof.script.session import ScriptConfig, parse_command, run_command

# T differs from B, so that a share cut along the wrong dimension shows
# sequence first: (T, B) in, (T, B, V) out
LM = """
import torch, torch.nn as nn
V, D, T, B = 500, 32, 24, 16""" + LM_MODEL + """{setup}
opt = torch.optim.SGD(model.parameters(), lr=0.1)
crit = nn.CrossEntropyLoss()
for step in range(4):
    x = torch.randint(0, V, (T, {rows}), device="cuda")
    y = torch.randint(0, V, (T, {rows}), device="cuda")
    out = model(x)
    loss = crit(out.view(-1, V), y.reshape(-1))
    opt.zero_grad(); loss.backward(); opt.step()
    print(f"loss {{loss.item():.6f}}")
"""
DATA_PARALLEL = "model = nn.DataParallel(LM().cuda(), dim=1)"
DDP = """import torch.distributed as dist, os
dist.init_process_group("nccl")
rank = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(rank)
model = nn.parallel.DistributedDataParallel(LM().cuda(rank), device_ids=[rank])"""


def _run(path: Path, command: list[str], compute: bool = False) -> object:
    result, main = run_command(ScriptConfig(launch=parse_command(command, 4), gpus=4,
                                            compute=compute))
    assert main.exit_status == 0, main.script_traceback
    return result


def _peaks(scenario: object) -> list[int]:
    return [d.peak_allocated_bytes for d in scenario.devices]  # type: ignore[attr-defined]


def test_both_fixes_of_a_data_parallel_split_along_dim_1(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(LM.format(setup=DATA_PARALLEL, rows="B"))
    result = _run(script, ["python", "train.py"])
    notes = result.notes  # type: ignore[attr-defined]
    primary = result.scenario("dp-loss-primary")  # type: ignore[attr-defined]
    forward = result.scenario("dp-loss-forward")  # type: ignore[attr-defined]
    ddp = result.scenario("ddp")  # type: ignore[attr-defined]
    assert forward is not None and forward.status == "ok", notes
    assert ddp is not None and ddp.status == "ok", notes
    # the logits and the loss's temporaries leave cuda:0
    assert forward.devices[0].peak_allocated_bytes < primary.devices[0].peak_allocated_bytes
    # each rank 4 of the batch's 16 columns: the sequence (24) stays whole
    assert ddp.batch == 16 and all(d.batch_rows == 4 for d in ddp.devices)
    fixes = {f.name: f for f in result.fixes}  # type: ignore[attr-defined]
    lif, as_ddp = fixes["loss-in-forward"].code, fixes["ddp"].code
    assert "crit(out.view(-1, V), y.reshape(-1)), dim=1), dim=1)" in lif, lif
    assert '+    x = torch.randint(0, V, (T, B // 4), device="cuda")' in as_ddp, as_ddp

    # the loss inside forward, applied: it runs, cuda:0 peaks as promised
    fixed = tmp_path / "fixed.py"
    fixed.write_text(apply_diff(script.read_text(), lif))
    again = _run(fixed, ["python", "fixed.py"])
    scenario = again.scenarios[0]  # type: ignore[attr-defined]
    assert scenario.name == "dp-loss-forward" and _peaks(scenario) == _peaks(forward)

    # DDP, as a user writes it (each rank B // 4 columns), under torchrun: the alternative's
    (tmp_path / "ddp.py").write_text(LM.format(setup=DDP, rows="B // 4"))
    by_hand = _run(tmp_path / "ddp.py", ["torchrun", "--nproc-per-node", "4", "ddp.py"])
    (rank,) = by_hand.scenarios  # type: ignore[attr-defined]
    assert rank.name == "ddp" and _peaks(rank) == _peaks(ddp)


def _losses(script: Path) -> list[float]:
    """The losses a script printed, run as ``dpprof run --compute --no-alternatives`` runs it
    (real numbers), in this process: a ``dpprof`` process would spend most of its time
    importing torch."""
    result, printed = run_printing(script, gpus=4, compute=True, alternatives=False)
    assert result.scenarios[0].status == "ok", result.scenarios[0].message
    return [float(v) for v in re.findall(r"^loss (\S+)$", printed, re.M)]


# ways a sequence-first loop writes its loss on the (T, B, V) outputs
FORMS = {
    "flat view": "loss = crit(out.view(-1, V), y.reshape(-1))",
    "ignored targets": "loss = crit_ignoring(out.reshape(-1, V), y.reshape(-1))",
    "classes second": "loss = crit(out.permute(1, 2, 0), y.t())",
    "shifted": "loss = crit(out[:-1].reshape(-1, V), y[1:].reshape(-1))",
    "elementwise": "loss = F.mse_loss(out, z)",
    "outputs read too": ("loss = crit(out.reshape(-1, V), y.reshape(-1)); "
                         "hits = (out.argmax(-1) == y).sum()"),
}
SMALL = """
import torch, torch.nn as nn, torch.nn.functional as F
V, D, T, B = 50, 16, 12, 8
class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.head = nn.Linear(D, V)
    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))
model = nn.DataParallel(LM().cuda(), dim=1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
crit, crit_ignoring = nn.CrossEntropyLoss(), nn.CrossEntropyLoss(ignore_index=0)
for step in range(4):
    x = torch.randint(0, V, (T, B), device="cuda")
    y = torch.randint(0, V, (T, B), device="cuda")
    z = torch.randn(T, B, V, device="cuda")
    out = model(x)
    {loss}
    opt.zero_grad(); loss.backward(); opt.step()
    print(f"loss {{loss.item():.6f}}")
"""


@pytest.mark.parametrize("form", sorted(FORMS))
def test_the_fixed_loss_is_the_written_one_s(form: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Computed for real (``--compute``), the loss the fixed script combines from the
    replicas along dim 1 is the loss over the gathered outputs, step by step."""
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(SMALL.format(loss=FORMS[form]))
    result = _run(script, ["python", "train.py"])
    forward = result.scenario("dp-loss-forward")  # type: ignore[attr-defined]
    assert forward is not None and forward.status == "ok", result.notes  # type: ignore[attr-defined]
    lif = next(f for f in result.fixes if f.name == "loss-in-forward")  # type: ignore[attr-defined]
    assert ", dim=1), dim=1)" in lif.code, lif.code
    (tmp_path / "fixed.py").write_text(apply_diff(script.read_text(), lif.code))
    written, fixed = _losses(script), _losses(tmp_path / "fixed.py")
    assert written and len(fixed) == len(written)
    assert fixed == pytest.approx(written, abs=2e-6)


def test_model_with_loss_returns_a_dimension_to_gather_along() -> None:
    model = nn.Linear(8, 5)
    x, y = torch.randn(6, 3, 8), torch.randint(0, 5, (6, 3))

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, 5), y.reshape(-1))

    for dim in (0, 1, 2):
        weighted, count = ModelWithLoss(model, loss_fn, dim=dim)(x, y)
        assert weighted.shape == count.shape == (1,) * (dim + 1)
        assert ModelWithLoss.combine((weighted, count)).item() == pytest.approx(
            loss_fn(model(x), y).item())
    # a loss kept per element must keep the dimension the replicas are gathered along
    per_token = ModelWithLoss(model, lambda out, y: nn.functional.cross_entropy(
        out.transpose(1, 2), y, reduction="none"), dim=1)
    loss, none = per_token(x, y)
    assert loss.shape == (6, 3) and none.numel() == 0 and none.dim() == 2
    flat = ModelWithLoss(model, lambda out, y: nn.functional.cross_entropy(
        out.reshape(-1, 5), y.reshape(-1), reduction="none"), dim=1)
    with pytest.raises(ValueError, match="does not keep the batch's rows in dimension 1"):
        flat(x, y)
    with pytest.raises(ValueError, match="give DataParallel's dim"):
        ModelWithLoss(model, loss_fn, dim=-1)
