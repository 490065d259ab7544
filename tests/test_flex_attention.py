"""FlexAttention on virtual devices: the dense eager path as torch runs it, and in a region
Inductor compiles, its fused kernel's memory; under --compute both give the attention's
values, checked here against attention written out by hand (softmax of masked scores).

Sizes: B=2, H=4, T=2048, D=64 in float32: q, k, v, out and each gradient 4 MiB; a
float32 row per query (the log-sum-exp, the row maxima, delta) 64 KiB; the scores
[B, H, T, T] 128 MiB.
"""

from __future__ import annotations

import contextlib
import textwrap
from pathlib import Path

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from dpprof.emulator.flex_attention import compiled_region
from dpprof.emulator.virtual_cuda import VirtualCuda
from dpprof.script.session import ScriptConfig, parse_command, run_command

MiB = 2**20
B, H, D = 2, 4, 64


@pytest.fixture(autouse=True)
def _no_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return q >= kv


def relative_bias(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
                  kv: torch.Tensor) -> torch.Tensor:
    return score + (q - kv) * 0.01


def _step_peak(fused: bool, t: int = 2048) -> int:
    """The peak above q, k and v of one attention's forward and backward."""
    with VirtualCuda(1):
        q, k, v = (torch.empty(B, H, t, D, device="cuda", requires_grad=True) for _ in range(3))
        mask = create_block_mask(causal, B=None, H=None, Q_LEN=t, KV_LEN=t, device="cuda")
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        if fused:
            with compiled_region():
                out = flex_attention(q, k, v, block_mask=mask)
        else:
            out = flex_attention(q, k, v, block_mask=mask)
        out.sum().backward()
        return torch.cuda.max_memory_allocated() - before


def test_the_fused_kernel_holds_no_scores() -> None:
    fused = _step_peak(fused=True)
    # out, then the backward's delta and three gradients; a row per query for the
    # log-sum-exp and the maxima; the loss and its gradient, a 512 B block each: no
    # [B, H, T, T] buffer
    rows = B * H * 2048 * 4
    assert fused == 4 * MiB + 2 * rows + rows + 3 * 4 * MiB + 2 * 512


def test_the_eager_path_materializes_the_scores() -> None:
    eager = _step_peak(fused=False)
    scores = B * H * 2048 * 2048 * 4
    assert eager > 4 * scores  # scores, their softmax, the gradients of both, at once


def _by_hand() -> tuple[torch.Tensor, ...]:
    q, k, v = _inputs("cpu")
    t = q.shape[2]
    s = (q @ k.transpose(-1, -2)) / D ** 0.5
    i = torch.arange(t)
    s = (s + (i[:, None] - i[None, :]) * 0.01).masked_fill(i[:, None] < i[None, :],
                                                          float("-inf"))
    out = s.softmax(-1) @ v
    (out * out).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad  # type: ignore[return-value]


def _inputs(device: str, t: int = 256) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    host = [torch.randn(B, H, t, D, generator=g) for _ in range(3)]
    return [x.to(device).requires_grad_() for x in host]


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_compute_gives_the_attentions_values(fused: bool) -> None:
    expected = _by_hand()
    with VirtualCuda(1, base="cpu"):
        q, k, v = _inputs("cuda")
        mask = create_block_mask(causal, B=None, H=None, Q_LEN=256, KV_LEN=256, device="cuda")
        if fused:
            with compiled_region():
                out = flex_attention(q, k, v, score_mod=relative_bias, block_mask=mask)
        else:
            out = flex_attention(q, k, v, score_mod=relative_bias, block_mask=mask)
        (out * out).sum().backward()
        got = (out.detach().cpu(), q.grad.cpu(), k.grad.cpu(), v.grad.cpu())  # type: ignore[union-attr]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


# a script that compiles flex_attention, as torchtitan and gpt-fast do, or calls it as is
FLEX_SCRIPT = """
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    attend = torch.compile(flex_attention) if {compiled} else flex_attention
    q, k, v = (torch.randn(2, 4, 2048, 64, device="cuda", requires_grad=True) for _ in range(3))
    mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, 2048, 2048, device="cuda")
    opt = torch.optim.SGD([q, k, v], lr=0.1)
    for _ in range(3):
        attend(q, k, v, block_mask=mask).sum().backward()
        opt.step()
        opt.zero_grad()
"""


def test_a_script_that_compiles_flex_attention_gets_the_fused_kernels_peak(
        tmp_path: Path) -> None:
    peaks = {}
    for compiled in (False, True):
        script = tmp_path / f"flex_{compiled}.py"
        script.write_text(textwrap.dedent(FLEX_SCRIPT.format(compiled=compiled)))
        result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(script)], 1)),
                                alternatives=False)
        s = result.scenarios[0]
        assert s.status == "ok", s.message
        peaks[compiled] = s.devices[0].peak_allocated_bytes
        if compiled:
            assert any("FlexAttention's" in n for n in s.notes)
    assert peaks[False] - peaks[True] > 4 * B * H * 2048 * 2048 * 4 - 64 * MiB


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_a_score_mod_reading_a_tensor_of_the_gpu_gives_its_values(fused: bool) -> None:
    # a score_mod reading a tensor on the GPU (a per-head bias), with no block mask given
    # (flex makes its own, vmapping over the GPU's tensors)
    t = 128
    q, k, v = _inputs("cpu", t)
    bias = torch.linspace(-1, 1, H)
    s = (q @ k.transpose(-1, -2)) / D ** 0.5 + bias[None, :, None, None]
    expected = s.softmax(-1) @ v
    with VirtualCuda(1, base="cpu"):
        q, k, v = _inputs("cuda", t)
        on_gpu = bias.to("cuda")

        def head_bias(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor,
                      j: torch.Tensor) -> torch.Tensor:
            return score + on_gpu[h]

        with compiled_region() if fused else contextlib.nullcontext():
            out = flex_attention(q, k, v, score_mod=head_bias)
        got = out.detach().cpu()
    torch.testing.assert_close(got, expected.detach(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_a_learned_bias_the_score_mod_closes_over_gets_its_gradient(fused: bool) -> None:
    # a score_mod reading a tensor that requires grad (a learned per-head bias): its
    # gradient, as the attention written out by hand gives it
    t = 128

    def by_hand() -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = _inputs("cpu", t)
        bias = torch.linspace(-1, 1, H).requires_grad_()
        s = (q @ k.transpose(-1, -2)) / D ** 0.5 + bias[None, :, None, None]
        out = s.softmax(-1) @ v
        (out * out).sum().backward()
        return out.detach(), bias.grad  # type: ignore[return-value]

    expected = by_hand()
    with VirtualCuda(1, base="cpu"):
        q, k, v = _inputs("cuda", t)
        bias = torch.linspace(-1, 1, H, device="cuda").requires_grad_()

        def head_bias(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor,
                      j: torch.Tensor) -> torch.Tensor:
            return score + bias[h]

        with compiled_region() if fused else contextlib.nullcontext():
            out = flex_attention(q, k, v, score_mod=head_bias)
        (out * out).sum().backward()
        assert bias.grad is not None
        got = (out.detach().cpu(), bias.grad.cpu())
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


GLOBAL_BIAS: torch.Tensor | None = None


def global_head_bias(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor,
                     j: torch.Tensor) -> torch.Tensor:
    return score + GLOBAL_BIAS[h]  # type: ignore[index]


def test_a_learned_bias_read_from_the_modules_globals_gets_its_gradient() -> None:
    global GLOBAL_BIAS
    with VirtualCuda(1):
        q, k, v = (torch.empty(B, H, 256, D, device="cuda", requires_grad=True)
                   for _ in range(3))
        GLOBAL_BIAS = torch.zeros(H, device="cuda", requires_grad=True)
        try:
            flex_attention(q, k, v, score_mod=global_head_bias).sum().backward()
            assert GLOBAL_BIAS.grad is not None and GLOBAL_BIAS.grad.shape == (H,)
            assert GLOBAL_BIAS.grad.is_cuda
        finally:
            GLOBAL_BIAS = None
