"""The loss inside forward where the step reads the outputs' shape before its loss, and where
the loss reads several tensors of the batch: a CTC loss as clovaai's
deep-text-recognition-benchmark writes it (``preds_size = torch.IntTensor([preds.size(1)] *
batch_size)``, then ``criterion(preds, text, preds_size, length)``), a segmentation loss
method that takes ``n, c, h, w = logit.size()`` first (pytorch-deeplab-xception's), a
language model's ``B, T, V = out.shape`` before ``out.view(-1, V)``, the targets moved to
``out.device``.

A shape read runs the replicas' forward and holds their outputs on their GPUs, answering
from their shapes (nothing gathered), and the loss is computed beside them, as inside the
fixed code's forward; every batch tensor the loss reads is scattered with the inputs. Before,
each was declined ("the outputs are used ... outside the arguments of a loss"; "reads text
and length, 2 tensors of the batch, and dpprof scatters one"). Each generated way is held to
the same script with the fix written by hand (its peaks) and, with real numbers, to the loss
the script prints as written. A loss sized by the whole batch's rows (``out.view(B * T,
V)``) cannot move as written: the report says why (it blamed line 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_run_loss_forms import assert_moved_as_by_hand

from dpprof.script.session import ScriptConfig, parse_command, run_command

HEAD = """
import torch
import torch.nn.functional as F
from torch import nn


class Recognizer(nn.Module):  # frames of features to per-frame class scores
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(32, 64, batch_first=True)
        self.fc = nn.Linear(64, 40)

    def forward(self, x):
        return self.fc(self.rnn(x)[0])


class Segmenter(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(32, 21, 3, padding=1))

    def forward(self, x):
        return self.body(x)


class SegmentationLosses:  # a loss method of a plain class, as deeplab-xception's
    def __init__(self, batch_average=True):
        self.batch_average = batch_average

    def ce(self, logit, target):
        n, c, h, w = logit.size()
        criterion = nn.CrossEntropyLoss(ignore_index=255)
        loss = criterion(logit, target.long())
        if self.batch_average:
            loss /= n
        return loss


torch.manual_seed(0)
B, T = {rows}, 12  # frames: few, as the LSTM runs op by op on virtual GPUs
ctc = nn.CTCLoss(zero_infinity=True)
seg = SegmentationLosses()


def batch():
    frames = torch.randn(B, T, 32).cuda()
    length = torch.randint(3, 9, (B,), dtype=torch.int32)
    text = torch.randint(1, 40, (B, 8)).cuda()
    image = torch.randn(B, 3, 24, 24).cuda()
    mask = torch.randint(0, 21, (B, 24, 24)).cuda()
    return frames, length, text, image, mask
"""

# (the model, the loop's lines from the outputs to the loss, the by-hand forward's lines
# from the model's outputs ``out`` to its return, the by-hand model's extra arguments)
FORMS = {
    "ctc_size_read": (
        "Recognizer()",
        "preds = model(frames)\n"
        "    preds_size = torch.IntTensor([preds.size(1)] * frames.size(0))\n"
        "    preds = preds.log_softmax(2).permute(1, 0, 2)\n"
        "    loss = ctc(preds, text, preds_size, length)",
        "preds = out.log_softmax(2).permute(1, 0, 2)\n"
        "        return ctc(preds, text, preds_size, length)",
        "frames, text, torch.IntTensor([T] * B), length"),
    "ctc_lengths_known": (
        "Recognizer()",
        "preds_size = torch.IntTensor([T] * frames.size(0))\n"
        "    preds = model(frames).log_softmax(2).permute(1, 0, 2)\n"
        "    loss = ctc(preds, text, preds_size, length)",
        "preds = out.log_softmax(2).permute(1, 0, 2)\n"
        "        return ctc(preds, text, preds_size, length)",
        "frames, text, torch.IntTensor([T] * B), length"),
    "method_size_read": (
        "Segmenter()",
        "output = model(image)\n    loss = seg.ce(output, mask)",
        "return nn.CrossEntropyLoss(ignore_index=255)(out, mask.long())",
        "image, mask"),
    # the targets moved to the outputs' device first (the model-parallel tutorial's way):
    # it was "could not read the loss's expression (RecursionError ...)"
    "device_read": (
        "Segmenter()",
        "output = model(image)\n    target = mask.to(output.device)\n"
        "    loss = F.cross_entropy(output, target)",
        "return F.cross_entropy(out, mask)",
        "image, mask"),
    "lm_shape_read": (
        "Recognizer()",
        "out = model(frames)\n    N, S, V = out.shape\n"
        "    loss = F.cross_entropy(out.view(-1, V), text.repeat(1, 4)[:, :S].reshape(-1))",
        "return F.cross_entropy(out.view(-1, out.shape[-1]), "
        "text.repeat(1, 4)[:, :out.shape[1]].reshape(-1))",
        "frames, text"),
}

AS_WRITTEN = HEAD + """
model = nn.DataParallel({model}.cuda())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    frames, length, text, image, mask = batch()
    {loop}
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

    def forward(self, x, *batch):
        out = self.model(x)
        {unpack} = batch
        {inside}


model = nn.DataParallel(WithLoss({model}.cuda()))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    frames, length, text, image, mask = batch()
    loss = model({args}).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _config(script: Path, compute: bool = False) -> ScriptConfig:
    return ScriptConfig(launch=parse_command(["python", str(script)], 2), steps=3,
                        compute=compute)


@pytest.mark.parametrize("rows", [16, 13])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_loss_after_a_shape_read_or_on_several_batch_tensors_moves_inside_forward(
        tmp_path: Path, form: str, rows: int) -> None:
    model, loop, inside, args = FORMS[form]
    script = tmp_path / "train.py"
    script.write_text(AS_WRITTEN.format(rows=rows, model=model, loop=loop))
    fixed = tmp_path / "fixed.py"
    names = [a.strip() for a in args.split(",")[1:]]
    if "torch.IntTensor([T] * B)" in args:
        names = ["text", "preds_size", "length"]
    fixed.write_text(BY_HAND.format(rows=rows, model=model, inside=inside, args=args,
                                    unpack=", ".join(names) + ("," if len(names) == 1 else "")))

    assert_moved_as_by_hand(_config(script), _config(fixed))


def test_a_loss_sized_by_the_whole_batch_is_declined_with_its_reason(tmp_path: Path) -> None:
    """``out.view(B * T, V)`` with B the batch's rows (from the outputs' shape or the
    inputs'): on a replica's shard the view is wrong, and the report says why, naming the
    loss's line and the name (it blamed line 1 of the script). A size that only equals the
    rows (V == B) is no reason to decline: the loss moves (tests/test_loss_expression.py)."""
    loop = ("out = model(frames)\n    N, S, V = out.shape\n"
            "    loss = F.cross_entropy(out.view(N * S, V), text.repeat(1, 4)[:, :S].reshape(-1))")
    script = tmp_path / "train.py"
    script.write_text(AS_WRITTEN.format(rows=16, model="Recognizer()", loop=loop))
    ran, _ = run_command(_config(script))
    assert ran.scenarios[0].status == "ok"
    assert "dp-loss-forward" not in [s.name for s in ran.scenarios]
    line = next(i for i, text in enumerate(script.read_text().splitlines(), 1)
                if "view(N * S, V)" in text)
    (said,) = [n for n in ran.notes if n.startswith("no loss-inside-forward alternative")]
    assert said.startswith("no loss-inside-forward alternative: with the loss inside forward "
                           "the script raised "), said
    assert said.endswith(f"(the loss at train.py:{line} reads N (16, the whole batch's rows), "
                         "which inside forward is each replica's share: size the loss's views "
                         "from the outputs (-1, or the outputs' own size))"), said


# generated: what the step reads of the outputs before its loss, by the loss written on them
READS = {
    "nothing": "",
    "size": "n = out.size(0)",
    "shape": "N, S, V = out.shape",
    "len": "rows = len(out)",
    "dim": "assert out.dim() == 3",
    "dtype": "assert out.dtype == torch.float32",
    "device": "tgt = tgt.to(out.device)",
}
# (as written, the loss on ``out``; by hand, inside forward; by hand, the loop's line)
LOSSES = {
    "view": ("loss = F.cross_entropy(out.view(-1, 40), tgt.view(-1))",
             "return F.cross_entropy(out.view(-1, 40), tgt.view(-1))",
             "loss = model(frames, tgt, fmask).mean()"),
    "per_element": ("per = F.cross_entropy(out.transpose(1, 2), tgt, reduction='none')\n"
                    "    loss = (per * fmask).sum() / fmask.sum()",
                    "return F.cross_entropy(out.transpose(1, 2), tgt, reduction='none')",
                    "per = model(frames, tgt, fmask)\n    loss = (per * fmask).sum() / fmask.sum()"),
    "two_targets": ("loss = F.cross_entropy(out[fmask > 0], tgt[fmask > 0])",
                    "return F.cross_entropy(out[fmask > 0], tgt[fmask > 0])",
                    "loss = model(frames, tgt, fmask).mean()"),
}

READ_THEN_LOSS = HEAD + """
model = nn.DataParallel(Recognizer().cuda())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    frames, length, text, image, mask = batch()
    tgt = text.repeat(1, 4)[:, :T].contiguous()
    fmask = (tgt % 3 > 0).float()
    out = model(frames)
    {read}
    {loss}
    print("loss", repr(loss.item()))
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

READ_THEN_LOSS_BY_HAND = HEAD + """

class WithLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, tgt, fmask):
        out = self.model(x)
        {inside}


model = nn.DataParallel(WithLoss(Recognizer().cuda()))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    frames, length, text, image, mask = batch()
    tgt = text.repeat(1, 4)[:, :T].contiguous()
    fmask = (tgt % 3 > 0).float()
    {loop}
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@example(read="shape", loss="per_element", rows=13)
@example(read="device", loss="two_targets", rows=16)
@example(read="len", loss="view", rows=13)
@given(read=st.sampled_from(sorted(READS)), loss=st.sampled_from(sorted(LOSSES)),
       rows=st.sampled_from([13, 16]))
def test_any_read_of_the_outputs_before_any_loss_moves_it_inside_forward(
        tmp_path: Path, read: str, loss: str, rows: int) -> None:
    written, inside, loop = LOSSES[loss]
    script = tmp_path / "train.py"
    script.write_text(READ_THEN_LOSS.format(rows=rows, read=READS[read], loss=written))
    fixed = tmp_path / "fixed.py"
    fixed.write_text(READ_THEN_LOSS_BY_HAND.format(rows=rows, inside=inside, loop=loop))
    assert_moved_as_by_hand(_config(script), _config(fixed))


TWO = """
import torch
from torch import nn

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 512)).cuda()
crit = nn.CrossEntropyLoss()


class WithLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        out = self.model(x)
        return crit(out, y), out


model = nn.DataParallel({wrapped})
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    x1, x2 = torch.randn(64, 32).cuda(), torch.randn(64, 32).cuda()
    y1, y2 = torch.randint(0, 512, (64,)).cuda(), torch.randint(0, 512, (64,)).cuda()
    {loop}
    print("loss", repr(loss.item()))
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
# as written: the first outputs' shape read before the second forward (a siamese step),
# then an accuracy on the first before the losses; by hand: each forward with its loss
TWO_AS_WRITTEN = ("o1 = model(x1)\n    n = o1.size(0)\n    o2 = model(x2)\n"
                  "    correct = (o1.argmax(1) == y1).sum()\n"
                  "    loss = crit(o1, y1) + crit(o2, y2)")
TWO_BY_HAND = ("l1, o1 = model(x1, y1)\n    l2, o2 = model(x2, y2)\n"
               "    correct = (o1.argmax(1) == y1).sum()\n    loss = l1.mean() + l2.mean()")


def test_outputs_read_for_their_shape_wait_on_their_replicas_through_another_forward(
        tmp_path: Path) -> None:
    """``o1.size(0)`` runs the first forward; the second forward (a siamese step's) leaves
    the first outputs on their replicas for their loss (it let them go, and the loss called
    the model with no inputs: "forward() missing 1 required positional argument"); an
    accuracy read of them gathers them, as the fix's keep_outputs does."""
    script = tmp_path / "train.py"
    script.write_text(TWO.format(wrapped="net", loop=TWO_AS_WRITTEN))
    fixed = tmp_path / "fixed.py"
    fixed.write_text(TWO.format(wrapped="WithLoss(net)", loop=TWO_BY_HAND))
    assert_moved_as_by_hand(_config(script), _config(fixed), keep_outputs=True)
