"""The loss inside forward where the loop takes a part of DataParallel's outputs before its
loss, over generated programs: outputs a tuple, a named tuple or a dict; the part taken by
unpacking (``logits, aux = model(x)``), an attribute (``logits = out.logits``), an index, a
key, or a chain of them and method calls (``out[0][:, :C].float()``, on a name or on the
model's call itself); the model called with positional arguments, keywords (``model(input_ids=x)``, the
Hugging Face way) or an unpacked dict (``model(**batch)``); a loss module or
``F.cross_entropy(..., ignore_index=0)``; with and without a later read of the outputs.

Held to what dpprof does not compute itself, the same script with the fix written by hand
(``ModelWithLoss`` given the whole outputs' function): equal peaks per GPU, equal losses
under ``--compute``; and the diff dpprof offers, applied, is that fix: it runs and peaks
as promised, to the byte.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_run_loss_forms import assert_the_same_losses_printed
from test_script_rewrite import apply_diff
from typer.testing import CliRunner

from dpprof.cli.app import app
from dpprof.script.session import ScriptConfig, parse_command, run_command

HEAD = """
import collections
import torch
import torch.nn.functional as F
from torch import nn

B, D, C = {rows}, 32, 256
Out = collections.namedtuple("Out", ["logits", "aux"])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D, 128), nn.ReLU())
        self.head = nn.Linear(128, C)
        self.side = nn.Linear(128, C)

    def forward(self, features, scale=None):
        h = self.body(features)
        logits, aux = self.head(h), self.side(h)
        return {returned}


torch.manual_seed(0)
criterion = {criterion}
"""

RETURNED = {"tuple": "logits, aux", "named": "Out(logits, aux)",
            "dict": '{"logits": logits, "aux": aux}'}
# how the loop takes the logits from the model's call (the outputs' kind it needs)
TAKES = {
    "unpack": ("logits, aux = model({call})", ("tuple", "named")),
    "attr": ("out = model({call})\n    logits = out.logits", ("named",)),
    "index": ("out = model({call})\n    logits = out[0]", ("tuple", "named")),
    "key": ('out = model({call})\n    logits = out["logits"]', ("dict",)),
    # a chain of attributes, indexes and method calls, on a name or on the call itself
    "chain": ("out = model({call})\n    logits = out[0][:, :C].float().contiguous()",
              ("tuple", "named")),
    "on_the_call": ('logits = model({call})["logits"][..., :].view(-1, C)', ("dict",)),
}
CALLS = {"positional": "x", "keywords": "features=x", "unpacked": "**batch"}
CRITERIA = {"module": ("nn.CrossEntropyLoss()", "criterion(logits, y)"),
            "functional": ("F.cross_entropy", "criterion(logits, y, ignore_index=0)")}
PART = {"unpack": "[0]", "attr": ".logits", "index": "[0]", "key": '["logits"]',
        "chain": "[0][:, :C].float().contiguous()", "on_the_call": '["logits"][..., :].view(-1, C)'}

AS_WRITTEN = HEAD + """
model = nn.DataParallel(Net()).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    x = torch.randn(B, D).cuda()
    y = torch.randint(0, C, (B,)).cuda()
    batch = {{"features": x}}
    {take}
    loss = {loss}
    {read}
    print("loss", repr(loss.item()))
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

BY_HAND = HEAD + """
import dpprof

model = nn.DataParallel(dpprof.ModelWithLoss(
    Net(), lambda outputs, y: {whole_loss}{keep})).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    x = torch.randn(B, D).cuda()
    y = torch.randint(0, C, (B,)).cuda()
    batch = {{"features": x}}
    {call}
    {read}
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

READ = "correct = logits.argmax(1).eq(y).sum()"
SLACK_BYTES = 4 * 1024  # the script's own scalars (its loss's) against the fix's


def _config(script: Path, compute: bool = False) -> ScriptConfig:
    return ScriptConfig(launch=parse_command(["python", str(script)], 2), steps=3,
                        compute=compute)


def _programs(take: str, call: str, criterion: str, kind: str, reads: bool,
              rows: int) -> tuple[str, str]:
    head = {"rows": rows, "returned": RETURNED[kind], "criterion": CRITERIA[criterion][0]}
    loss = CRITERIA[criterion][1]
    as_written = AS_WRITTEN.format(**head, take=TAKES[take][0].format(call=CALLS[call]),
                                   loss=loss, read=READ if reads else "")
    inputs = {"positional": "x", "keywords": "dict(features=x)", "unpacked": "batch"}[call]
    whole = loss.replace("logits", f"outputs{PART[take]}")
    if reads:  # the outputs kept beside the loss, as the fix keeps them
        fixed_call = (f"outputs, loss = dpprof.ModelWithLoss.split(model({inputs}, y))\n"
                      f"    logits = outputs{PART[take]}")
    else:
        fixed_call = f"loss = dpprof.ModelWithLoss.combine(model({inputs}, y))"
    by_hand = BY_HAND.format(**head, whole_loss=whole, call=fixed_call,
                             keep=", keep_outputs=True" if reads else "",
                             read=READ if reads else "")
    return as_written, by_hand


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@example(take="attr", call="keywords", criterion="functional", kind="named", reads=False,
         rows=64)
@example(take="unpack", call="positional", criterion="module", kind="tuple", reads=True,
         rows=100)
@example(take="key", call="unpacked", criterion="module", kind="dict", reads=False, rows=96)
@example(take="chain", call="keywords", criterion="functional", kind="tuple", reads=True,
         rows=100)
@example(take="on_the_call", call="positional", criterion="module", kind="dict", reads=False,
         rows=64)
@given(take=st.sampled_from(sorted(TAKES)), call=st.sampled_from(sorted(CALLS)),
       criterion=st.sampled_from(sorted(CRITERIA)), kind=st.sampled_from(sorted(RETURNED)),
       reads=st.booleans(), rows=st.sampled_from([64, 96, 100]))
def test_a_part_of_the_outputs_moves_inside_forward_as_written_by_hand(
        tmp_path: Path, take: str, call: str, criterion: str, kind: str, reads: bool,
        rows: int) -> None:
    if kind not in TAKES[take][1]:
        kind = TAKES[take][1][0]
    as_written, by_hand = _programs(take, call, criterion, kind, reads, rows)
    script, fixed = tmp_path / "train.py", tmp_path / "fixed.py"
    script.write_text(as_written)
    fixed.write_text(by_hand)

    ran, _ = run_command(_config(script))
    alt = next(s for s in ran.scenarios if s.name == "dp-loss-forward")
    written, _ = run_command(_config(fixed), alternatives=False)
    hand = written.scenarios[0]
    assert alt.status == hand.status == "ok", (alt.message, hand.message)
    for moved, mine in zip(alt.devices, hand.devices, strict=True):
        assert abs(moved.peak_allocated_bytes - mine.peak_allocated_bytes) <= SLACK_BYTES, (
            moved.index, moved.peak_allocated_bytes, mine.peak_allocated_bytes)

    # the value: real numbers, the loss each prints
    assert_the_same_losses_printed(_config(script, compute=True))


@pytest.mark.parametrize(("take", "call", "criterion", "kind"), [
    ("attr", "keywords", "functional", "named"),  # the Hugging Face way
    ("unpack", "positional", "module", "tuple"),
    ("index", "unpacked", "module", "named"),
    ("key", "positional", "functional", "dict"),
    ("chain", "keywords", "module", "tuple"),
    ("on_the_call", "unpacked", "functional", "dict"),
])
def test_the_diff_for_a_part_is_the_fix_and_peaks_as_promised(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, take: str, call: str, criterion: str,
        kind: str) -> None:
    """The diff removes the statements that take the part, gives ModelWithLoss the inputs
    (keywords as a dict) and the loss as a function of the whole outputs (the part's
    expression in it); the patched script runs under ``dpprof run`` and peaks as the fix
    promised, to the byte."""
    as_written, _ = _programs(take, call, criterion, kind, False, 64)
    (tmp_path / "train.py").write_text(as_written)
    runner = CliRunner()
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["run", "--gpus", "2", "-o", "first.json", "--", "python",
                                 "train.py"])
    assert result.exit_code == 0, result.output
    fix = next(f for f in json.loads((tmp_path / "first.json").read_text())["fixes"]
               if f["name"] == "loss-in-forward")
    patched = apply_diff(as_written, fix["code"])
    inputs = {"positional": "x", "keywords": "dict(features=x)", "unpacked": "batch"}[call]
    assert f"dpprof.ModelWithLoss.combine(model({inputs}, y))" in patched, fix["code"]
    assert PART[take] + ", y" in patched, fix["code"]  # the part's expression in the loss
    assert "logits" not in patched.split("for step in range(4):")[1], patched
    (tmp_path / "train.py").write_text(patched)
    again = runner.invoke(app, ["run", "--gpus", "2", "-o", "again.json", "--", "python",
                                "train.py"])
    assert again.exit_code == 0, again.output
    ran = json.loads((tmp_path / "again.json").read_text())["scenarios"][0]
    assert ran["name"] == "dp-loss-forward"
    assert ran["devices"][0]["peak_allocated_bytes"] == fix["primary_peak_bytes"]


VAE = """
import torch
import torch.nn.functional as F
from torch import nn


class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(784, 400)
        self.mu, self.logvar = nn.Linear(400, 20), nn.Linear(400, 20)
        self.dec = nn.Sequential(nn.Linear(20, 400), nn.ReLU(), nn.Linear(400, 784))

    def forward(self, x):
        h = F.relu(self.enc(x.view(-1, 784)))
        mu, logvar = self.mu(h), self.logvar(h)
        return torch.sigmoid(self.dec(mu + torch.exp(0.5 * logvar))), mu, logvar


def loss_function(recon_x, x, mu, logvar):
    bce = F.binary_cross_entropy(recon_x, x.view(-1, 784), reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce + kld


torch.manual_seed(0)
model = nn.DataParallel(VAE()).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(4):
    data = torch.rand(128, 1, 28, 28).cuda()
    recon_batch, mu, logvar = model(data)
    loss = loss_function(recon_batch, data, mu, logvar)
    print("loss", repr(loss.item()))
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_the_outputs_through_python_operators_after_the_loss(tmp_path: Path) -> None:
    """PyTorch's VAE example's loss: a loss on one part of the outputs (``recon_x``), then
    arithmetic on the others (``1 + logvar - mu.pow(2)``). The alternative ran into
    ``TypeError: unsupported operand type(s) for +: 'int' and 'DeferredOutputs'``; it runs,
    keeps the outputs for the arithmetic as the fix would, and prints the script's loss."""
    script = tmp_path / "vae.py"
    script.write_text(VAE)
    ran, _ = run_command(_config(script))
    alt = next(s for s in ran.scenarios if s.name == "dp-loss-forward")
    assert alt.status == "ok", alt.message
    assert any(re.search(r"uses the outputs besides the loss \([^)]*vae\.py:\d+", n)
               for n in alt.notes), alt.notes
    assert_the_same_losses_printed(_config(script, compute=True), keep_outputs=True)


TWO_PARTS = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 10)

    def forward(self, x, sizes):
        return self.fc(x).log_softmax(-1), sizes


model = nn.DataParallel(Net()).cuda()
ctc = nn.CTCLoss()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    x = torch.randn(8, 50, 16).cuda()
    sizes = torch.full((8,), 50, dtype=torch.long).cuda()
    targets = torch.randint(1, 10, (8 * 5,)).cuda()
    target_sizes = torch.full((8,), 5, dtype=torch.long).cuda()
    out, output_sizes = model(x, sizes)
    out = out.transpose(0, 1)
    loss = ctc(out, targets, output_sizes, target_sizes)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_loss_on_two_parts_of_the_outputs_is_declined_in_one_line(tmp_path: Path) -> None:
    """deepspeech.pytorch's way: ``out, output_sizes = model(x, sizes)``, then a CTC loss on
    both. The loss function dpprof makes takes one part; it said nothing of the other, which
    reached the replicas' loss as outputs not computed. It declines, and says why."""
    script = tmp_path / "train.py"
    script.write_text(TWO_PARTS)
    ran, _ = run_command(_config(script))
    (said,) = [n for n in ran.notes if n.startswith("no loss-inside-forward alternative")]
    assert said.endswith("reads output_sizes, another part of the outputs, besides its "
                         "first; dpprof moves a loss on one part of them"), said
    assert ran.scenarios[0].status == "ok"
