"""CUDA autocast's policies as the emulator re-enacts them (aten/src/ATen/autocast_mode.h):
softmax and log_softmax are fp32_set_opt_dtype (a float32 result unless the caller names a
dtype), and cross_entropy_loss is on no CUDA list, so its composite's ops meet autocast
one by one. An H200 showed what follows: under bf16 autocast the loss kept the bfloat16
log-probabilities and a float32 copy of them (tests/test_measured_ladder.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dpprof.emulator.kernels import EmulatedAutocast, cross_entropy_composite

ROWS, CLASSES = 6, 10


def _saved(fn: Any) -> list[torch.Tensor]:
    """Every tensor autograd saves while ``fn`` runs."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


def _logits(dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> torch.Tensor:
    x = torch.randn(ROWS, CLASSES, device=device).to(dtype)
    return x.requires_grad_()


def test_cross_entropy_keeps_bfloat16_log_probs_and_saves_a_float32_copy() -> None:
    logits, target = _logits(), torch.randint(0, CLASSES, (ROWS,))
    with EmulatedAutocast(torch.bfloat16, "cuda"):
        saved = _saved(lambda: F.cross_entropy(logits, target))
    full = sorted(str(t.dtype) for t in saved if t.shape == logits.shape)
    # log_softmax's result in the input's dtype, nll_loss's float32 copy of it
    assert full == ["torch.bfloat16", "torch.float32"]


def test_cpu_lists_still_cast_cross_entropy_to_float32() -> None:
    logits, target = _logits(), torch.randint(0, CLASSES, (ROWS,))
    with torch.autocast("cpu", torch.bfloat16):
        real = _saved(lambda: F.cross_entropy(logits, target))
    with EmulatedAutocast(torch.bfloat16, "cpu"):
        emulated = _saved(lambda: F.cross_entropy(logits, target))
    assert ([(t.dtype, t.shape) for t in emulated] == [(t.dtype, t.shape) for t in real])


def test_softmax_asks_for_float32_unless_given_a_dtype() -> None:
    x = _logits()
    with EmulatedAutocast(torch.bfloat16, "cuda"):
        assert x.softmax(-1).dtype == torch.float32
        assert torch.log_softmax(x, -1).dtype == torch.float32
        assert F.softmax(x, dim=-1).dtype == torch.float32
        assert torch.softmax(x, -1, dtype=None).dtype == torch.float32
        named = F.log_softmax(x, dim=-1, dtype=torch.bfloat16)
    assert named.dtype == torch.bfloat16
    # run on the input itself: no float32 copy in between
    assert named.grad_fn is not None
    assert named.grad_fn.next_functions[0][0].variable is x  # type: ignore[attr-defined]


def test_float16_softmax_takes_the_fused_half_to_float_kernel() -> None:
    """SoftMax.cpp: a CUDA float16 input asked for float32 runs ``_softmax(x, dim, true)``,
    no float32 copy of the input; meta tensors stand for CUDA ones (CPU has no such
    kernel, so CPU tensors take the copy)."""
    meta, cpu = _logits(torch.float16, "meta"), _logits(torch.float16)
    with EmulatedAutocast(torch.float16, "cuda"):
        fused, copied = meta.softmax(-1), cpu.softmax(-1)
    assert fused.dtype == copied.dtype == torch.float32
    assert fused.grad_fn is not None and copied.grad_fn is not None
    assert fused.grad_fn.next_functions[0][0].variable is meta  # type: ignore[attr-defined]
    assert type(copied.grad_fn.next_functions[0][0]).__name__ == "ToCopyBackward0"


CASES = {
    "indices": {},
    "indices, weight, ignore_index": {"weight": True, "ignore": True},
    "indices, sum": {"reduction": "sum"},
    "indices, none": {"reduction": "none"},
    "smoothing": {"label_smoothing": 0.1},
    "smoothing, weight, ignore_index": {"label_smoothing": 0.2, "weight": True,
                                        "ignore": True},
    "smoothing, sum": {"label_smoothing": 0.1, "reduction": "sum"},
    "smoothing, none": {"label_smoothing": 0.1, "reduction": "none"},
    "probabilities": {"probabilities": True},
    "probabilities, smoothing, weight": {"probabilities": True, "label_smoothing": 0.1,
                                         "weight": True},
    "probabilities, none": {"probabilities": True, "reduction": "none"},
    "spatial": {"spatial": True},
    "one row": {"one_row": True},
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_composite_computes_what_cross_entropy_computes(case: str) -> None:
    opts = CASES[case]
    torch.manual_seed(0)
    shape = (ROWS, CLASSES, 3, 2) if opts.get("spatial") else (
        (CLASSES,) if opts.get("one_row") else (ROWS, CLASSES))
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    class_dim = 0 if x.dim() == 1 else 1
    if opts.get("probabilities"):
        target = torch.randn(shape, dtype=torch.float64).softmax(class_dim)
    else:
        target = torch.randint(0, CLASSES, shape[:class_dim] + shape[class_dim + 1:])
        if opts.get("ignore"):
            target.view(-1)[0] = 3
    kwargs: dict[str, Any] = {"reduction": opts.get("reduction", "mean"),
                              "label_smoothing": opts.get("label_smoothing", 0.0)}
    if opts.get("weight"):
        kwargs["weight"] = torch.rand(CLASSES, dtype=torch.float64) + 0.5
    if opts.get("ignore"):
        kwargs["ignore_index"] = 3
    want = F.cross_entropy(x, target, **kwargs)
    got = cross_entropy_composite(x, target, **kwargs)
    torch.testing.assert_close(got, want)
    (want_grad,) = torch.autograd.grad(want.sum(), x)
    (got_grad,) = torch.autograd.grad(got.sum(), x)
    torch.testing.assert_close(got_grad, want_grad)
