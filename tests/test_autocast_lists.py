"""CUDA autocast's policies as the emulator re-enacts them (aten/src/ATen/autocast_mode.h):
softmax and log_softmax are fp32_set_opt_dtype (a float32 result unless the caller names a
dtype), and cross_entropy_loss is on no CUDA list, so its composite's ops meet autocast
one by one. An H200 showed what follows: under bf16 autocast the loss kept the bfloat16
log-probabilities and a float32 copy of them (tests/test_measured_ladder.py)."""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dpprof.emulator.autocast_lists import CUDA_AUTOCAST_OPS, cuda_entry_points
from dpprof.emulator.emulated_autocast import (
    CudaAutocastNames,
    EmulatedAutocast,
    cross_entropy_composite,
)

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


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_bound_before_the_region_is_cast_as_inside_it(reduction: str) -> None:
    """``criterion = F.cross_entropy`` taken before ``with torch.autocast(...)``, as training
    scripts write it, meets the region as a call written inside it: the same saved tensors
    and a float32 loss (nll_loss's policy), not a bfloat16 loss over bfloat16 ops."""
    criterion = F.cross_entropy
    logits, target = _logits(), torch.randint(0, CLASSES, (ROWS,))
    with EmulatedAutocast(torch.bfloat16, "cuda"):
        bound = _saved(lambda: criterion(logits, target, reduction=reduction))
        loss = criterion(logits, target, reduction=reduction)
        written = _saved(lambda: F.cross_entropy(logits, target, reduction=reduction))
    assert loss.dtype == torch.float32
    assert [(t.dtype, t.shape) for t in bound] == [(t.dtype, t.shape) for t in written]
    assert sorted(str(t.dtype) for t in bound if t.shape == logits.shape) == [
        "torch.bfloat16", "torch.float32"]
    torch.testing.assert_close(
        loss, F.nll_loss(logits.log_softmax(1).float(), target, reduction=reduction))


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


# ---- every op on CUDA's lists ---------------------------------------------------------
# The spec below is torch 2.13's aten/src/ATen/autocast_mode.h (the lists the CUDA block of
# autocast_mode.cpp registers: AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32,
# AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE (fp32_append_dtype),
# AT_FORALL_PROMOTE, binary_cross_entropy banned); each case names its list. An op on no
# list runs in the dtypes it is given (type promotion).

BF16, F32 = torch.bfloat16, torch.float32
N, D = 6, 8


def test_the_table_is_what_torch_registers_for_cuda_autocast() -> None:
    registered = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))
    assert {f"aten::{op}" for op in CUDA_AUTOCAST_OPS} == registered


def test_every_listed_op_has_a_python_entry_point_but_those_only_cpp_reaches() -> None:
    reached = {owner_attr[1] for owner_attr in cuda_entry_points()}
    missing = {op.split(".")[0] for op in CUDA_AUTOCAST_OPS} - reached
    missing -= {"linalg_vecdot", "linalg_multi_dot", "linalg_vector_norm",
                "linalg_matrix_norm"} & {f"linalg_{a}" for a in reached}
    # called by lstm_cell/gru_cell's CUDA kernels, never from Python
    assert missing == {"_thnn_fused_lstm_cell", "_thnn_fused_gru_cell"}


def _x(*shape: int, dtype: torch.dtype = F32, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, device=device).to(dtype).requires_grad_()


def _case_inputs(device: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"x": _x(N, D, device=device), "h": _x(N, D, dtype=BF16, device=device),
            "a": _x(3, N, D, device=device), "b": _x(3, D, N, device=device),
            "img": _x(2, 4, 5, 5, device=device), "w": _x(3, 4, 3, 3, device=device),
            "t": torch.rand(N, D, device=device).to(BF16), "lin": _x(5, D, device=device)}


# (list, the op, what the list makes of float32 (and bfloat16, "h") inputs)
OPS: dict[str, tuple[str, Any, torch.dtype]] = {
    "linear": ("lower_precision_fp", lambda i: F.linear(i["x"], i["lin"]), BF16),
    "matmul (@)": ("lower_precision_fp", lambda i: i["x"] @ i["lin"].T, BF16),
    "bmm": ("lower_precision_fp", lambda i: torch.bmm(i["a"], i["b"]), BF16),
    "baddbmm": ("lower_precision_fp",
                lambda i: torch.baddbmm(i["a"] @ i["b"], i["a"], i["b"]), BF16),
    "conv2d": ("lower_precision_fp", lambda i: F.conv2d(i["img"], i["w"]), BF16),
    "pow": ("fp32", lambda i: i["h"].pow(2), F32),
    "x ** 2": ("fp32", lambda i: i["h"] ** 2, F32),
    "exp": ("fp32", lambda i: torch.exp(i["h"]), F32),
    "rsqrt": ("fp32", lambda i: i["h"].rsqrt(), F32),
    "layer_norm": ("fp32", lambda i: F.layer_norm(i["h"], (D,)), F32),
    "group_norm": ("fp32", lambda i: F.group_norm(i["img"].to(BF16), 2), F32),
    "rms_norm": ("fp32", lambda i: F.rms_norm(i["h"], (D,)), F32),
    "mse_loss": ("fp32", lambda i: F.mse_loss(i["h"], i["t"]), F32),
    "l1_loss": ("fp32", lambda i: F.l1_loss(i["h"], i["t"]), F32),
    "kl_div": ("fp32", lambda i: F.kl_div(i["h"], i["t"], reduction="batchmean"), F32),
    "binary_cross_entropy_with_logits": (
        "fp32", lambda i: F.binary_cross_entropy_with_logits(i["h"], i["t"]), F32),
    "smooth_l1_loss": ("fp32", lambda i: F.smooth_l1_loss(i["h"], i["t"]), F32),
    "interpolate": ("fp32", lambda i: F.interpolate(i["img"].to(BF16), scale_factor=2),
                    F32),
    "sum": ("fp32_set_opt_dtype", lambda i: i["h"].sum(), F32),
    "sum(dim)": ("fp32_set_opt_dtype", lambda i: torch.sum(i["h"], -1), F32),
    "sum(input=...)": ("fp32_set_opt_dtype", lambda i: torch.sum(input=i["h"], dim=-1), F32),
    "sum(dtype=bfloat16)": ("fp32_set_opt_dtype", lambda i: i["h"].sum(-1, dtype=BF16),
                            BF16),
    "cumsum": ("fp32_set_opt_dtype", lambda i: i["h"].cumsum(0), F32),
    "prod": ("fp32_set_opt_dtype", lambda i: i["h"].prod(-1), F32),
    "linalg.vector_norm": ("fp32_set_opt_dtype",
                           lambda i: torch.linalg.vector_norm(i["h"], dim=-1), F32),
    "norm (torch.norm: linalg_vector_norm)": ("fp32_set_opt_dtype",
                                              lambda i: i["h"].norm(dim=-1), F32),
    "norm.ScalarOpt_dim": ("fp32_append_dtype",
                           lambda i: torch._VF.norm(i["h"], 2, [1], False), F32),
    "addcmul, bfloat16 and float32": ("promote",
                                      lambda i: torch.addcmul(i["h"], i["h"], i["x"]), F32),
    "addcmul, bfloat16 only": ("promote", lambda i: torch.addcmul(i["h"], i["h"], i["h"]),
                               BF16),
    "gelu (on no list)": ("none", lambda i: F.gelu(i["h"]), BF16),
    "mean (on no list)": ("none", lambda i: i["h"].mean(-1), BF16),
}


@pytest.mark.parametrize("case", list(OPS))
def test_each_list_gives_its_dtype_under_cuda_lists(case: str) -> None:
    _policy, fn, want = OPS[case]
    for device in ("cpu", "meta"):
        with EmulatedAutocast(torch.bfloat16, "cuda"):
            assert fn(_case_inputs(device)).dtype == want, device


def test_the_fp32_ops_save_a_float32_copy_and_set_opt_dtype_ops_none() -> None:
    """fp32: the op's floating arguments are cast before it runs (a float32 copy, which
    ``pow`` saves for backward); fp32_set_opt_dtype: the input is not cast (``prod`` saves
    its bfloat16 input and its float32 result)."""
    h = _x(N, D, dtype=BF16)
    with EmulatedAutocast(torch.bfloat16, "cuda"):
        pow_saved = _saved(lambda: h.pow(2))
        prod_saved = _saved(lambda: h.prod(-1))
    assert [(t.dtype, tuple(t.shape)) for t in pow_saved] == [(F32, (N, D))]
    assert sorted((str(t.dtype), tuple(t.shape)) for t in prod_saved) == [
        ("torch.bfloat16", (N, D)), ("torch.float32", (N,))]


class LlamaStyleRMSNorm(torch.nn.Module):
    """RMSNorm as Llama-style models write it, without an upcast of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + 1e-6))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_an_rmsnorm_block_saves_what_cuda_autocast_saves(device: str) -> None:
    lin = torch.nn.Linear(D, D).to(device)
    norm = LlamaStyleRMSNorm().to(device)
    x = torch.randn(N, D, device=device, requires_grad=True)  # an earlier layer's output
    with EmulatedAutocast(torch.bfloat16, "cuda"):
        out: list[torch.Tensor] = []
        saved = _saved(lambda: out.append(norm(lin(x))))
    assert out[0].dtype == F32
    got = sorted((str(t.dtype), tuple(t.shape)) for t in saved)
    want = sorted([
        # linear (lower_precision_fp): the input and the weight's bfloat16 copies
        ("torch.bfloat16", (N, D)), ("torch.bfloat16", (D, D)),
        # pow (fp32): a float32 copy of the bfloat16 activation
        ("torch.float32", (N, D)),
        # rsqrt (fp32): its float32 result (mean of float32 is float32: on no list)
        ("torch.float32", (N, 1)),
        # x * r (mul, on no list): the bfloat16 activation and the float32 scale
        ("torch.bfloat16", (N, D)), ("torch.float32", (N, 1)),
        # weight * (...): the float32 weight and the float32 product
        ("torch.float32", (D,)), ("torch.float32", (N, D)),
    ])
    assert got == want
    saved_bytes = sum(t.numel() * t.element_size() for t in saved)
    assert saved_bytes == sum(
        math.prod(shape) * (2 if dtype == "torch.bfloat16" else 4) for dtype, shape in want)


def test_binary_cross_entropy_is_banned_as_cuda_autocast_bans_it() -> None:
    p, t = torch.rand(N), torch.rand(N)
    with EmulatedAutocast(torch.bfloat16, "cuda"), pytest.raises(
            RuntimeError, match=r"binary_cross_entropy and torch\.nn\.BCELoss are unsafe"):
        F.binary_cross_entropy(p, t)
    assert F.binary_cross_entropy(p, t).dtype == F32  # outside the region: as ever


# Ops whose CPU list (autocast_mode.cpp's KERNEL_CPU) has the policy CUDA's has: the
# emulator under CUDA's lists, on CPU tensors, must save what torch's own CPU autocast saves.
SAME_ON_CPU = ["linear", "bmm", "baddbmm", "conv2d", "mse_loss", "l1_loss", "kl_div",
               "binary_cross_entropy_with_logits", "smooth_l1_loss"]


@pytest.mark.parametrize("case", SAME_ON_CPU)
def test_where_the_cpu_list_agrees_the_emulator_saves_what_cpu_autocast_saves(
        case: str) -> None:
    _policy, fn, want = OPS[case]
    with torch.autocast("cpu", torch.bfloat16):
        real_out: list[torch.Tensor] = []
        real = _saved(lambda: real_out.append(fn(_case_inputs("cpu"))))
    with EmulatedAutocast(torch.bfloat16, "cuda"):
        emu_out: list[torch.Tensor] = []
        emulated = _saved(lambda: emu_out.append(fn(_case_inputs("cpu"))))
    assert real_out[0].dtype == emu_out[0].dtype == want
    assert ([(t.dtype, t.shape) for t in emulated] == [(t.dtype, t.shape) for t in real])


def test_a_disabled_cuda_region_runs_the_ops_as_given_then_casting_resumes() -> None:
    """``torch.autocast("cuda", enabled=False)`` inside a region: no list applies (the
    usual way around binary_cross_entropy's ban), an enabled region inside casts again."""
    x, w, p = _x(N, D), _x(D, D), torch.rand(N)
    with EmulatedAutocast(torch.bfloat16, "cuda"), CudaAutocastNames():
        with torch.autocast("cuda", enabled=False):
            inside = x @ w
            bce = F.binary_cross_entropy(p, p)
            with torch.amp.autocast("cuda", dtype=torch.float16):
                nested = x @ w
            again = x.pow(2)
        after = x @ w
    assert (inside.dtype, bce.dtype, again.dtype) == (F32, F32, F32)
    assert nested.dtype == torch.float16
    assert after.dtype == BF16


def test_torch_answers_as_on_a_gpu_inside_an_emulated_region() -> None:
    """torch/csrc/autograd/init.cpp: ``is_autocast_enabled()`` without a device is CUDA's;
    aten/src/ATen/autocast_mode.cpp: the thread's CUDA autocast dtype is float16 until a
    region sets it, and ``torch.autocast`` without a dtype takes the current one."""
    with EmulatedAutocast(torch.bfloat16, "cuda"), CudaAutocastNames():
        inside = (torch.is_autocast_enabled(device_type="cuda"), torch.is_autocast_enabled(),
                  torch.get_autocast_dtype("cuda"), torch.is_autocast_enabled("cpu"))
        with torch.autocast("cuda", enabled=False):
            suspended = torch.is_autocast_enabled("cuda")
            with torch.autocast("cuda"):
                nested = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
                          (_x(N, D) @ _x(D, D)).dtype)
    assert inside == (True, True, BF16, False)
    assert not suspended
    assert nested == (True, BF16, BF16)
    assert torch.is_autocast_enabled is torch._C.is_autocast_enabled  # restored
    assert not torch.is_autocast_enabled("cuda")
    assert torch.get_autocast_dtype("cuda") == torch.float16


def _maybe_autocast(device_type: str, dtype: torch.dtype | None = None,
                    enabled: bool = True) -> contextlib.AbstractContextManager[Any]:
    # transformers.utils.generic.maybe_autocast: a region only where autocast is on already
    # or asked for
    if torch.is_autocast_enabled(device_type) or enabled:
        return torch.autocast(device_type, dtype=dtype, enabled=enabled)
    return contextlib.nullcontext()


class RotaryEmbedding(torch.nn.Module):
    """A rotary embedding in the style of Hugging Face's ``LlamaRotaryEmbedding.forward``
    around ``maybe_autocast``, its tables recorded. ``"cuda"``: what ``x.device.type``
    reads under emulation."""

    def __init__(self) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float) / D))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.tables: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        inv_freq = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        positions = position_ids[:, None, :].float()
        with _maybe_autocast("cuda", enabled=False):  # force float32
            freqs = (inv_freq.float() @ positions.float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = emb.cos()
        self.tables += [freqs, emb, cos]
        return cos.to(dtype=x.dtype)


def test_a_rotary_embedding_that_asks_first_builds_its_tables_in_float32() -> None:
    """On a GPU, inside bf16 autocast, ``maybe_autocast(enabled=False)`` opens a disabled
    region (``is_autocast_enabled("cuda")`` is True), so the matmul (lower_precision_fp)
    runs in float32: every table float32, 4 bytes an element. Reading False, it opened
    none and the tables were bfloat16, half the bytes."""
    rotary, x = RotaryEmbedding(), _x(2, 16, D)
    positions = torch.arange(16)[None].expand(2, -1)
    with EmulatedAutocast(torch.bfloat16, "cuda"), CudaAutocastNames():
        out = rotary(x, positions)
    assert [(t.dtype, tuple(t.shape)) for t in rotary.tables] == [
        (F32, (2, 16, D // 2)), (F32, (2, 16, D)), (F32, (2, 16, D))]
    table_bytes = sum(t.numel() * t.element_size() for t in rotary.tables)
    assert table_bytes == 4 * 2 * 16 * (D // 2 + 2 * D)
    assert out.dtype == F32


class _MatmulWithCustomBackward(torch.autograd.Function):
    """An autograd Function as ``torch.amp.custom_fwd``/``custom_bwd`` mean it: its
    backward runs in the autocast state its forward ran in."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        ctx.dtypes = (grad @ w.t()).dtype, (x.t() @ grad).dtype
        return grad @ w.t(), x.t() @ grad


def test_custom_bwd_enters_the_region_custom_fwd_recorded() -> None:
    """torch/amp/autocast_mode.py: ``custom_fwd`` records ``is_autocast_enabled("cuda")``
    and ``get_autocast_dtype("cuda")``; ``custom_bwd`` enters ``autocast`` with them, so
    on a GPU the backward's matmuls run in bfloat16 after the region has ended (reading
    False, they ran uncast, and bfloat16 met float32)."""
    x, w = _x(N, D), _x(D, D)
    with CudaAutocastNames():
        with EmulatedAutocast(torch.bfloat16, "cuda"):
            y = _MatmulWithCustomBackward.apply(x, w)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "CUDA is not available" from torch's own
            y.float().sum().backward()
    assert y.grad_fn is not None
    assert y.dtype == BF16 and y.grad_fn.dtypes == (BF16, BF16)
    assert x.grad is not None and x.grad.dtype == F32  # cast back by .to's backward


def test_an_enabled_region_inside_another_casts_to_its_own_dtype() -> None:
    """``torch.autocast("cuda", dtype=torch.float16)`` directly inside a bfloat16 region:
    the inner region's dtype applies to every listed op until it exits (autocast's state is
    a stack; the innermost region sets the dtype), then the outer's again."""
    x, w = _x(N, D), _x(D, D)
    with EmulatedAutocast(torch.bfloat16, "cuda"), CudaAutocastNames():
        outer = x @ w
        with torch.autocast("cuda", dtype=torch.float16):
            inner = (x @ w, F.linear(x, w), torch.mm(x, w))
        after = x @ w
    assert outer.dtype == after.dtype == BF16
    assert {t.dtype for t in inner} == {torch.float16}
