"""Masks and lengths made from host data keep their real values on a virtual GPU, as
Hugging Face's wav2vec2 uses them: the audio's attention mask (8 clips of 16,000 samples, 1 MiB
in int64) reduced to the frames' lengths, a frame mask built by indexing with ``arange``,
and hidden states written through a mask (``h[mask] = v``), whose backward indexes by it.

Found on ``Wav2Vec2ForCTC`` (transformers 5) under ``dpprof run``: its backward stopped
with "indexing with a boolean mask makes a tensor whose shape depends on the values"."""

from __future__ import annotations

import textwrap
from pathlib import Path

from script_runs import printed_on_the_host, run_printing

SCRIPT = """
    import torch

    dev = "cuda"
    mask = torch.zeros(8, 16000, dtype=torch.long)
    for b in range(8):
        mask[b, :8000 + 1000 * b] = 1
    mask = mask.to(dev)
    samples = mask.cumsum(dim=-1)[:, -1]  # each clip's samples
    frames = torch.div(samples - 400, 320, rounding_mode="floor") + 1
    print("frames", frames.tolist())
    # the frames' mask as wav2vec2 builds it: a one at each clip's last frame, then a
    # reversed cumulative sum
    frame_mask = torch.zeros(8, 49, dtype=torch.long, device=dev)
    frame_mask[(torch.arange(8, device=dev), frames - 1)] = 1
    frame_mask = frame_mask.flip([-1]).cumsum(-1).flip([-1]).bool()
    print("frames kept", frame_mask.sum(-1).tolist())
    torch.manual_seed(0)
    # 8 x 49 x 64 float32, 100 KiB: values no emulation follows (an activation's)
    h = torch.randn(8, 49, 64, device=dev, requires_grad=True)
    spec = torch.randn(64, device=dev, requires_grad=True)
    hidden = h * 1
    hidden[~frame_mask.unsqueeze(-1).repeat(1, 1, 64)] = 0  # padding zeroed
    hidden[frame_mask & (torch.arange(49, device=dev) % 7 == 0)] = spec  # frames masked
    hidden.pow(2).sum().backward()
    print("masked frames", int((frame_mask & (torch.arange(49, device=dev) % 7 == 0)).sum()))
    print("grads", tuple(h.grad.shape), tuple(spec.grad.shape))
"""


def test_masks_from_host_data_are_followed_through_indexing_and_its_backward(
        tmp_path: Path) -> None:
    source = textwrap.dedent(SCRIPT)
    script = tmp_path / "masks.py"
    script.write_text(source)
    expected = printed_on_the_host(tmp_path, source)
    result, printed = run_printing(script, steps=1)
    s = result.scenarios[0]
    assert s.status == "ok", s.message
    assert printed == expected
    assert "frames [24, 27, 31, 34, 37, 40, 43, 46]" in printed
    assert not any("stand-in" in n for n in s.notes), s.notes
