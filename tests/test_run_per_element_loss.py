"""A loss kept per element (``reduction="none"``) and reduced by the loop afterwards, as
masked and weighted losses are written: ``per = F.cross_entropy(out.view(-1, V),
y.view(-1), reduction="none")``, then ``(per * mask.view(-1)).sum() / mask.sum()``.

Inside forward each replica computes its own elements' losses and DataParallel gathers them,
the whole batch's in the batch's order, for the loop to reduce as written: cuda:0 gathers
those instead of the outputs. Before, the alternative stopped at the first such loss
("shape '[1]' is invalid for input of size 80": a replica's loss taken for one number).
Over generated ways of writing it (a loss per row, per token through a view, in a helper
function, a mean over the other dimensions, a module of the script's own; the outputs read
afterwards or not; shards even and uneven), the alternative is held to what it does not
compute itself: its peaks equal the same script with the fix written by hand, and with real
numbers (``--compute``) the loss it prints equals the one printed as written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_run_diffs import SCRIPTS, check_the_change
from test_run_loss_forms import assert_moved_as_by_hand
from typer.testing import CliRunner

from dpprof.cli.app import app
from dpprof.script.session import ScriptConfig, parse_command, run_command

HEAD = """
import torch
import torch.nn.functional as F
from torch import nn


class PerSample(nn.Module):  # a loss of the script's own: one value per element
    def forward(self, logits, target):
        return F.cross_entropy(logits, target, reduction="none", label_smoothing=0.1)


def masked_ce(logits, target, mask):
    per = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")
    return (per * mask).sum() / mask.sum()


torch.manual_seed(0)
B, T, D, V = {rows}, 12, 32, 256
net = nn.Sequential(nn.Linear(D, 128), nn.ReLU(), nn.Linear(128, V)).cuda()
crit = nn.CrossEntropyLoss(reduction="none")
smooth = PerSample()


def batch():
    x = torch.randn(B, T, D).cuda()
    y = torch.randint(0, V, (B, T)).cuda()
    z = torch.randn(B, T, V).cuda()
    mask = (torch.rand(B, T) > 0.3).float().cuda()
    wt = torch.rand(B).cuda()
    return x, y, z, mask, wt
"""

# (the loss call on the outputs ``{o}``, how the loop reduces ``per``)
FORMS = {
    "rows": ("crit({o}.mean(1), y[:, 0])", "(per * wt).sum() / wt.sum()"),
    "tokens": ("F.cross_entropy({o}.view(-1, V), y.view(-1), reduction='none')",
               "(per * mask.view(-1)).sum() / mask.sum()"),
    "rowmean": ("F.mse_loss({o}, z, reduction='none')", "(per.mean((1, 2)) * wt).mean()"),
    "own": ("smooth({o}.reshape(-1, V), y.reshape(-1))", "(per * mask.reshape(-1)).mean()"),
    # in a helper that reduces it: by hand, the helper's loss call inside forward
    "helper": ("F.cross_entropy({o}.transpose(1, 2), y, reduction='none')",
               "(per * mask).sum() / mask.sum()"),
}

AS_WRITTEN = HEAD + """
model = nn.DataParallel(net)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    x, y, z, mask, wt = batch()
    out = model(x)
    {loss}
    {read}
    print("loss", repr(loss.item()))
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

BY_HAND = HEAD + """

class WithLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y, z, mask, wt):
        out = self.model(x)
        per = {call}
        return {returned}


model = nn.DataParallel(WithLoss(net))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    x, y, z, mask, wt = batch()
    {got} = model(x, y, z, mask, wt)
    loss = {reduce}
    {read}
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

READ = "correct = out.argmax(-1).eq(y).sum()"


def _config(script: Path, compute: bool = False) -> ScriptConfig:
    return ScriptConfig(launch=parse_command(["python", str(script)], 2), steps=3,
                        compute=compute)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@example(form="tokens", reads=False, rows=64)
@example(form="helper", reads=False, rows=33)
@example(form="rows", reads=True, rows=33)
@example(form="own", reads=True, rows=64)
@example(form="rowmean", reads=False, rows=33)
@given(form=st.sampled_from(sorted(FORMS)), reads=st.booleans(),
       rows=st.sampled_from([33, 64]))
def test_a_loss_kept_per_element_moves_inside_forward_as_written_by_hand(
        tmp_path: Path, form: str, reads: bool, rows: int) -> None:
    call, reduce = FORMS[form]
    loss = ("loss = masked_ce(out, y, mask)" if form == "helper"
            else f"per = {call.format(o='out')}\n    loss = {reduce}")
    read = READ if reads else ""
    script = tmp_path / "train.py"
    script.write_text(AS_WRITTEN.format(rows=rows, loss=loss, read=read))
    fixed = tmp_path / "fixed.py"
    fixed.write_text(BY_HAND.format(rows=rows, call=call.format(o="out"), reduce=reduce,
                                    read=read, returned="per, out" if reads else "per",
                                    got="per, out" if reads else "per"))

    ran = assert_moved_as_by_hand(_config(script), _config(fixed), keep_outputs=reads)
    alt = next(s for s in ran.scenarios if s.name == "dp-loss-forward")
    if not reads:
        assert any("kept per element" in note for note in alt.notes), alt.notes
        # what it saves: the gathered logits (B x T x V) on cuda:0 (kept, they are gathered
        # as before, and the per-element losses beside them)
        primary = next(s for s in ran.scenarios if s.name == "dp-loss-primary")
        assert alt.devices[0].peak_allocated_bytes < primary.devices[0].peak_allocated_bytes


PER_CLASS = HEAD + """
model = nn.DataParallel(net)
opt = torch.optim.SGD(model.parameters(), lr=0.1)


class PerClass(nn.Module):  # one loss per class: no order of the batch's rows
    def forward(self, logits, target):
        return F.mse_loss(logits, target, reduction="none").mean((0, 1))


per_class = PerClass()
for step in range(4):
    x, y, z, mask, wt = batch()
    out = model(x)
    loss = per_class(out, z).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_loss_per_class_is_refused_with_its_reason(tmp_path: Path) -> None:
    """A loss returning one value per class has no batch order to gather the replicas' by
    (their concatenation would be a wrong loss of the right size): the alternative says why
    it stopped, and the script as written is measured as before."""
    script = tmp_path / "train.py"
    script.write_text(PER_CLASS.format(rows=64))
    ran, _ = run_command(_config(script))
    assert ran.scenarios[0].name == "dp-loss-primary"
    assert ran.scenarios[0].status == "ok"
    assert "dp-loss-forward" not in [s.name for s in ran.scenarios]
    (said,) = [n for n in ran.notes if n.startswith("no loss-inside-forward alternative")]
    assert "the loss returns a tensor of shape (256,), which is not one value per row" in said, (
        said)


def test_the_per_token_change_runs_as_the_user_applies_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The diff for a per-token loss reduced with a mask afterwards: applied with ``patch``
    and run, the patched script (the loss read from ``ModelWithLoss.combine``, the gathered
    per-token losses) peaks as the fix promised, to the byte."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    out = work / "r.json"
    r = CliRunner().invoke(app, ["run", "--gpus", "4", "-q", "--ranks", "none", "-o", str(out),
                                 "--", "python", str(SCRIPTS / "dp_per_token_loss.py")])
    assert r.exit_code == 0, r.output
    fix = {f["name"]: f for f in json.loads(out.read_text())["fixes"]}["loss-in-forward"]
    assert "dpprof.ModelWithLoss.combine(" in fix["code"], fix["code"]
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    check_the_change("dp_per_token_loss.py", [], fix, fixed, tmp_path / "again.json",
                     monkeypatch)
