"""CTC loss under ``dpprof run``: over meta tensors as torch runs it on a GPU, sized by the
lengths' real values, as over CPU tensors (``--compute``), where torch's own CPU kernels run.

Found on clovaai's deep-text-recognition-benchmark ``train.py --Prediction CTC``: it stopped
at its loss, ``aten::_ctc_loss.Tensor`` having no Meta kernel."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from dpprof.backends.memtrace import record
from dpprof.emulator.ctc_loss import ctc_loss
from dpprof.result import ScenarioResult
from dpprof.script.session import ScriptConfig, parse_command, run_command

# labels of 3-7 classes padded to 25 (the widest any label could be): the kernel sizes
# log_alpha by the longest label of the batch, 2 x 7 + 1, not by the padding
TRAIN = """
    import torch
    import torch.nn as nn

    T, C = 40, 30  # frames, classes (blank 0)
    model = nn.DataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(),
                                          nn.Linear(64, C)).cuda())
    criterion = nn.CTCLoss(reduction="{reduction}", zero_infinity={zero_infinity})
    opt = torch.optim.Adam(model.parameters())
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        B = {batch}
        x = torch.randn(B, T, 32, generator=gen).cuda()
        lengths = torch.randint(3, 8, (B,), generator=gen)
        labels = [torch.randint(1, C, (int(n),), generator=gen) for n in lengths]
        if {concatenated}:  # one row of every label, the lengths as lists
            targets, target_lengths = torch.cat(labels).cuda(), lengths.tolist()
            input_lengths = [T] * B
        else:  # a row per label, padded; the lengths as tensors, on the GPU and the host
            targets = torch.zeros(B, 25, dtype=torch.long)
            for b, label in enumerate(labels):
                targets[b, :len(label)] = label
            targets, target_lengths = targets.cuda(), lengths.cuda()
            input_lengths = torch.full((B,), T, dtype=torch.int32)
        out = model(x).log_softmax(2).permute(1, 0, 2)  # T x B x C
        loss = criterion(out, targets, input_lengths, target_lengths)
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
        print("loss", loss.sum().item())
"""


def _run(tmp_path: Path, compute: bool, **fields: object) -> ScenarioResult:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN.format(**fields)))
    result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(script)], 2),
                                         compute=compute), alternatives=False)
    s = result.scenarios[0]
    assert s.status == "ok", s.message
    return s


@pytest.mark.parametrize(("reduction", "zero_infinity", "concatenated"), [
    ("mean", False, False),
    ("sum", True, False),
    ("none", True, True),
])
def test_ctc_loss_over_meta_allocates_what_it_does_over_cpu_tensors(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], reduction: str,
        zero_infinity: bool, concatenated: bool) -> None:
    # the peak is the forward's end, log_alpha alive: its size is the lengths' values'
    fields = {"reduction": reduction, "zero_infinity": zero_infinity, "batch": 16,
              "concatenated": concatenated}
    meta = _run(tmp_path, False, **fields)
    capsys.readouterr()
    cpu = _run(tmp_path, True, **fields)
    losses = [float(line.split()[1]) for line in capsys.readouterr().out.splitlines()
              if line.startswith("loss ")]
    # real numbers under --compute (the third step stops the run before its print)
    assert len(losses) == 2 and all(v > 0 for v in losses)
    assert meta.devices[0].peak_phase == cpu.devices[0].peak_phase == "forward (step 2)"
    assert ([d.peak_allocated_bytes for d in meta.devices]
            == [d.peak_allocated_bytes for d in cpu.devices])
    # the lengths were read as they are: the only values made up are the printed losses
    stand_ins = [n for n in meta.notes if "answered with stand-ins" in n]
    assert stand_ins == [stand_ins[0]] and "stand-ins (item x2)" in stand_ins[0]


def test_the_cuda_kernels_own_buffers_are_counted_over_meta(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a "large" problem (2 T + 24 B / 10 > 450): CUDA's backward takes log_beta, the
    # blanks' logsumexp and zero_infinity's second gradient from the caching allocator
    # (LossCTC.cu), which CPU kernels (--compute) keep to themselves: over meta the peak
    # is the backward's, above the CPU run's
    fields = {"reduction": "sum", "zero_infinity": True, "batch": 160, "concatenated": False}
    meta = _run(tmp_path, False, **fields)
    cpu = _run(tmp_path, True, **fields)
    assert meta.devices[0].peak_phase == "backward (step 2)"
    assert meta.devices[0].peak_allocated_bytes > cpu.devices[0].peak_allocated_bytes
    capsys.readouterr()


def _allocations(fn: Any) -> list[int]:
    """The sizes of the host allocations ``fn`` makes (frees negative), in time order
    (torch.profiler's records)."""
    return [a.size for a in record(fn)[1]]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("zero_infinity", [False, True])
@pytest.mark.parametrize("lengths", ["tensors", "lists", "unbatched"])
def test_the_gpu_path_computes_and_allocates_what_plain_torch_does(
        reduction: str, zero_infinity: bool, lengths: str) -> None:
    # dpprof.emulator.ctc_loss.ctc_loss is the path plain torch takes outside a dispatch
    # mode, from the lengths read to the host on (torch's ctc_loss with lists): here both
    # run torch's CPU kernels, and give the same loss, the same gradient, the same
    # allocations in the same order
    gen = torch.Generator().manual_seed(1)
    T, B, C = 12, 1 if lengths == "unbatched" else 5, 7
    logits = torch.randn(T, B, C, generator=gen).requires_grad_()
    target_lengths = torch.randint(1, 5, (B,), generator=gen)
    targets = torch.randint(1, C, (B, 6), generator=gen)
    input_lengths = torch.full((B,), T, dtype=torch.int32)
    args: tuple[Any, ...] = (targets, input_lengths, target_lengths)
    if lengths == "lists":
        args = (targets, input_lengths.tolist(), target_lengths.tolist())
    if lengths == "unbatched":
        args = (targets[0, :int(target_lengths[0])], input_lengths, target_lengths)
    reduce = {"mean": 1, "sum": 2, "none": 0}[reduction]

    def run(ctc: Any) -> tuple[torch.Tensor, torch.Tensor]:
        lp = logits.log_softmax(2) if lengths != "unbatched" else logits[:, 0].log_softmax(1)
        loss = ctc(lp, *args, 0, reduce, zero_infinity)
        grad, = torch.autograd.grad(loss.sum(), logits)
        return loss, grad

    def plain_torch(lp: torch.Tensor, targets: torch.Tensor, il: Any, tl: Any,
                    *rest: Any) -> torch.Tensor:
        il, tl = (v.tolist() if isinstance(v, torch.Tensor) else v for v in (il, tl))
        return torch.ctc_loss(lp, targets, il, tl, *rest)

    torch.testing.assert_close(run(ctc_loss), run(plain_torch))
    assert _allocations(lambda: run(ctc_loss)) == _allocations(lambda: run(plain_torch))
