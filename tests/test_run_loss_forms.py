"""The loss inside forward over generated ways of writing a loss on DataParallel's outputs:
one loss call or several on the same outputs (a sum in one statement, each on half the
outputs' columns, on the outputs through Python's operators (``out / T``), a helper function
as mixup writes it, separate statements), cross-entropy with and without ``ignore_index``
and with class weights (a loss module holding a tensor on cuda:0), MSE, as loss
modules, as torch.nn.functional's functions and as a module of the script's own,
with and without a later read of the outputs (an accuracy). For each, the
``loss-in-forward`` alternative is held to two things it does not compute itself:

* its peaks, per GPU, equal those of the same script with the fix written by hand (a module
  that computes the same losses in its forward, wrapped in DataParallel), run as written;
* with real numbers (``--compute``), the loss it prints equals the loss the script as written
  prints (the whole batch's, on cuda:0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_run_diffs import SCRIPTS, check_the_change
from typer.testing import CliRunner

from dpprof.cli.app import app
from dpprof.result import RunResult
from dpprof.script.loss_in_forward_run import STRATEGY
from dpprof.script.runner import run_script
from dpprof.script.session import ScriptConfig, parse_command, run_command

CRITERIA = {
    "ce": ("nn.CrossEntropyLoss()", "y"),
    "ce_ignore": ("nn.CrossEntropyLoss(ignore_index=0)", "y"),
    "mse": ("nn.MSELoss()", "z"),
    # torch.nn.functional's losses, and a module of the script's without parameters
    "f_ce": ("F.cross_entropy", "y"),
    "f_mse": ("F.mse_loss", "z"),
    "smoothed": ("Smoothed()", "y"),
    # a loss module holding a tensor: its class weights, on cuda:0 (each replica's copy)
    "ce_weighted": ("nn.CrossEntropyLoss(weight=torch.rand(W).cuda())", "y"),
}

# how the loop computes its loss from the outputs ``out`` and two targets ``t1``, ``t2``
FORMS = {
    "one": ("loss = crit_a(out, {t1})", "loss = self.crit_a(out, {t1})"),
    "sum": ("loss = crit_a(out, {t1}) + 0.5 * crit_b(out, {t2})",
            "loss = self.crit_a(out, {t1}) + 0.5 * self.crit_b(out, {t2})"),
    "helper": ("loss = mixed(crit_a, out, {t1}, {t2}, 0.7)",
               "loss = mixed(self.crit_a, out, {t1}, {t2}, 0.7)"),
    "halves": ("loss = crit_a(out[:, :256], {t1}) + 0.5 * crit_b(out[:, 256:], {t2})",
               "loss = self.crit_a(out[:, :256], {t1}) + 0.5 * self.crit_b(out[:, 256:], {t2})"),
    "operators": ("loss = crit_a(out / 2.0, {t1}) + crit_b(-out, {t2})",
                  "loss = self.crit_a(out / 2.0, {t1}) + self.crit_b(-out, {t2})"),
    "statements": ("first = crit_a(out, {t1})\n    second = crit_b(out, {t2})\n"
                   "    loss = first + second",
                   "first = self.crit_a(out, {t1})\n        second = self.crit_b(out, {t2})\n"
                   "        loss = first + second"),
}

HEAD = """
import torch
import torch.nn.functional as F
from torch import nn


class Smoothed(nn.Module):
    def forward(self, logits, target):
        return F.cross_entropy(logits, target, label_smoothing=0.1)


torch.manual_seed(0)
B, D, C = {rows}, 64, 512
W = {classes}  # the classes a loss is given (half of them where it takes half the columns)
net = nn.Sequential(nn.Linear(D, 256), nn.ReLU(), nn.Linear(256, C)).cuda()
crit_a = {crit_a}
crit_b = {crit_b}


def mixed(criterion, pred, y_a, y_b, lam):
    return lam * criterion(pred, y_a) + (1 - lam) * criterion(pred, y_b)


def batch():
    x = torch.randn(B, D).cuda()
    y = torch.randint(0, C, (B,)).cuda()
    y2 = torch.randint(0, C, (B,)).cuda()
    z = torch.randn(B, C).cuda()
    z2 = torch.randn(B, C).cuda()
    return x, y, y2, z, z2
"""

AS_WRITTEN = HEAD + """
model = nn.DataParallel(net)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    x, y, y2, z, z2 = batch()
    out = model(x)
    {form}
    {read}
    print("loss", repr(loss.item()))
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

BY_HAND = HEAD + """

class WithLoss(nn.Module):
    def __init__(self, model, crit_a, crit_b):
        super().__init__()
        self.model, self.crit_a, self.crit_b = model, crit_a, crit_b

    def forward(self, x, y, y2, z, z2):
        out = self.model(x)
        {form}
        return {returned}


model = nn.DataParallel(WithLoss(net, crit_a, crit_b))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    x, y, y2, z, z2 = batch()
    {call}
    {read}
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

READ = "correct = out.argmax(1).eq(y).sum()"
SLACK_BYTES = 64 * 1024  # the per-replica scalars each way returns and gathers


def _config(script: Path, compute: bool = False) -> ScriptConfig:
    return ScriptConfig(launch=parse_command(["python", str(script)], 2), steps=3,
                        compute=compute)


@settings(max_examples=19, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@example(form="halves", crit_a="ce_ignore", crit_b="mse", reads=False, rows=100)
@example(form="helper", crit_a="ce", crit_b="ce", reads=True, rows=64)
@example(form="one", crit_a="f_ce", crit_b="ce", reads=False, rows=64)
@example(form="sum", crit_a="smoothed", crit_b="f_mse", reads=True, rows=100)
@example(form="statements", crit_a="ce", crit_b="f_ce", reads=True, rows=64)
@example(form="operators", crit_a="f_ce", crit_b="mse", reads=True, rows=96)
@example(form="sum", crit_a="ce_weighted", crit_b="ce", reads=False, rows=100)
@example(form="helper", crit_a="ce_weighted", crit_b="ce_weighted", reads=True, rows=64)
@example(form="one", crit_a="ce_weighted", crit_b="ce", reads=False, rows=96)
@example(form="halves", crit_a="ce", crit_b="ce_weighted", reads=False, rows=64)
@example(form="statements", crit_a="ce", crit_b="ce_weighted", reads=False, rows=64)
@given(form=st.sampled_from(sorted(FORMS)), crit_a=st.sampled_from(sorted(CRITERIA)),
       crit_b=st.sampled_from(sorted(CRITERIA)), reads=st.booleans(),
       rows=st.sampled_from([64, 96, 100]))
def test_each_way_of_writing_the_loss_moves_inside_forward_as_written_by_hand(
        tmp_path: Path, form: str, crit_a: str, crit_b: str, reads: bool, rows: int) -> None:
    loop, inside = FORMS[form]
    if form == "helper":  # mixup's helper calls one criterion twice
        crit_b = crit_a
    t1, t2 = CRITERIA[crit_a][1], CRITERIA[crit_b][1] + "2"
    if form == "halves":  # each loss on half the outputs' columns, its targets to match
        t1 = f"{t1} % 256" if t1 == "y" else f"{t1}[:, :256]"
        t2 = f"{t2} % 256" if t2 == "y2" else f"{t2}[:, 256:]"
    head = {"rows": rows, "crit_a": CRITERIA[crit_a][0], "crit_b": CRITERIA[crit_b][0],
            "classes": 256 if form == "halves" else "C"}
    read = READ if reads else ""
    script = tmp_path / "train.py"
    script.write_text(AS_WRITTEN.format(**head, form=loop.format(t1=t1, t2=t2), read=read))
    fixed = tmp_path / "fixed.py"
    call = ("loss, out = model(x, y, y2, z, z2)\n    loss = loss.mean()" if reads
            else "loss = model(x, y, y2, z, z2).mean()")
    fixed.write_text(BY_HAND.format(**head, form=inside.format(t1=t1, t2=t2), read=read,
                                    call=call, returned="loss, out" if reads else "loss"))

    assert_moved_as_by_hand(_config(script), _config(fixed))


def assert_moved_as_by_hand(written: ScriptConfig, fixed: ScriptConfig,
                            keep_outputs: bool = False,
                            slack_bytes: int = SLACK_BYTES) -> RunResult:
    """``written``'s loss-inside-forward alternative peaks on every GPU as ``fixed``, the
    same script with the fix written by hand, run as it is (within ``slack_bytes``), and,
    with real numbers, prints the losses the script prints as written
    (:func:`assert_the_same_losses_printed`); the run's result."""
    ran, _ = run_command(written)
    assert ran.scenarios[0].status == "ok", ran.scenarios[0].message  # as written it runs
    alt = next((s for s in ran.scenarios if s.name == "dp-loss-forward"), None)
    assert alt is not None, ran.notes
    by_hand, _ = run_command(fixed, alternatives=False)
    hand = by_hand.scenarios[0]
    assert alt.status == hand.status == "ok", (alt.message, hand.message)
    for moved, device in zip(alt.devices, hand.devices, strict=True):
        assert abs(moved.peak_allocated_bytes - device.peak_allocated_bytes) <= slack_bytes, (
            moved.index, moved.peak_allocated_bytes, device.peak_allocated_bytes)
    assert_the_same_losses_printed(dataclasses.replace(written, compute=True), keep_outputs)
    return ran


def assert_the_same_losses_printed(cfg: ScriptConfig, keep_outputs: bool = False) -> None:
    """The script (``cfg``, with ``--compute``) prints ``loss <value>`` lines: the
    loss-inside-forward alternative (``keep_outputs``: keeping them, as the alternative is
    reported where the script reads the outputs besides the loss) prints the same values as
    the script as written, the whole batch's loss on cuda:0."""
    printed_main = io.StringIO()
    with contextlib.redirect_stdout(printed_main):
        main = run_script(cfg)
    inside_run = run_script(dataclasses.replace(cfg, alternative=STRATEGY,
                                                scattered_rows=main.batch_rows,
                                                keep_outputs=keep_outputs))
    printed = [re.findall(r"^loss (\S+)$", text, re.M)
               for text in (printed_main.getvalue(), inside_run.output_tail)]
    assert printed[0] and len(printed[0]) == len(printed[1])
    for whole, combined in zip(*printed, strict=True):
        assert abs(float(whole) - float(combined)) <= 1e-5 * max(1.0, abs(float(whole))), (
            printed)


EVALUATED = HEAD + """
model = nn.DataParallel(net)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    for k in range({evaluations}):  # an evaluation left under grad: losses, no backward
        x, y, y2, z, z2 = batch()
        out = model(x)
        seen = crit_a(out, y) + crit_b(out, y2)
    x, y, y2, z, z2 = batch()
    loss = crit_a(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_outputs_held_for_a_second_loss_go_with_the_next_forward(tmp_path: Path) -> None:
    """A loop that computes losses without a backward (an evaluation under grad) lets each
    iteration's outputs go, as the fixed code does: the peak is the same after one such
    iteration as after four (the held outputs piled up until the next backward)."""
    peaks = []
    criterion = CRITERIA["ce"][0]
    for evaluations in (1, 4):
        script = tmp_path / f"eval{evaluations}.py"
        script.write_text(EVALUATED.format(rows=256, crit_a=criterion, crit_b=criterion,
                                           classes="C", evaluations=evaluations))
        ran, _ = run_command(_config(script))
        alt = next(s for s in ran.scenarios if s.name == "dp-loss-forward")
        peaks.append([d.peak_allocated_bytes for d in alt.devices])
    assert peaks[0] == peaks[1]


KEYWORDS = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 512)

    def forward(self, features, scale=1.0):
        return self.fc(features) * scale


model = nn.DataParallel(Net().cuda())
criterion = nn.CrossEntropyLoss()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    x = torch.randn(64, 64).cuda()
    y = torch.randint(0, 512, (64,)).cuda()
    out = model(x, scale=2.0)
    loss = criterion(out, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_model_called_with_positional_and_keyword_arguments_is_told_why(
        tmp_path: Path) -> None:
    """``model(x, scale=2.0)``: ModelWithLoss passes the model a tuple or a dict of inputs,
    not both, so the alternative does not defer such a call, and says so (it said "the
    script's loss is not an nn.Module loss called on DataParallel's outputs", which it is).
    Keywords alone, Hugging Face's way, move inside forward (tests/test_run_loss_parts.py)."""
    script = tmp_path / "train.py"
    script.write_text(KEYWORDS)
    ran, _ = run_command(_config(script))
    line = next(i for i, text in enumerate(KEYWORDS.splitlines(), 1) if "scale=2.0" in text)
    (said,) = [n for n in ran.notes if n.startswith("no loss-inside-forward alternative")]
    assert said.startswith("no loss-inside-forward alternative: the model is called with "
                           "positional and keyword arguments (scale) at "), said
    assert f"train.py:{line}, and ModelWithLoss passes the model one kind" in said, said


def test_the_fix_of_weighted_losses_runs_with_each_replica_s_weights_as_promised(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loss-inside-forward change for a loss whose module holds its weights on cuda:0,
    on an expression of the outputs (``ModelWithLoss(model, lambda outputs, labels:
    criterion(outputs / temperature, labels))``), applied as a user applies it
    and run: each replica computes with its own copy of the weights (the wrapper holds the
    function's loss modules), and the patched script peaks as the fix promised, to the byte.
    Before, the alternative stopped at cuda:1's replica reading cuda:0's weights, and no
    change was offered."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    out = work / "r.json"
    r = CliRunner().invoke(app, ["run", "--gpus", "4", "-q", "--ranks", "none", "-o", str(out),
                                 "--", "python", str(SCRIPTS / "dp_weighted_losses.py")])
    assert r.exit_code == 0, r.output
    fixes = {f["name"]: f for f in json.loads(out.read_text())["fixes"]}
    fix = fixes["loss-in-forward"]
    assert "dpprof.ModelWithLoss(" in fix["code"] and "lambda" in fix["code"], fix["code"]
    # the loss module, defined after the wrap, moves before it (and the weights it is made
    # of, defined after the wrap too): ModelWithLoss finds it there
    assert "`weights` (line 13) and `criterion` (line 14) move before the wrap" in fix[
        "code"], fix["code"]
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    check_the_change("dp_weighted_losses.py", [], fix, fixed, tmp_path / "again.json",
                     monkeypatch)
