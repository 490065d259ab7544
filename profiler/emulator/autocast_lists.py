"""CUDA autocast's op lists, one table, and where the emulator meets each op in Python.

``torch.autocast("cuda", dtype)`` acts at the ``AutocastCUDA`` dispatch key:
``aten/src/ATen/autocast_mode.cpp`` registers, in its ``TORCH_LIBRARY_IMPL(aten, Autocast,
m)`` block, the ops of ``autocast_mode.h``'s ``AT_FORALL_LOWER_PRECISION_FP``,
``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``,
``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE`` (fp32_append_dtype) and ``AT_FORALL_PROMOTE``,
plus ``cudnn_convolution``/``cudnn_convolution_transpose`` (lower precision) and
``binary_cross_entropy`` (banned: it raises). :data:`CUDA_AUTOCAST_OPS` is that block as
torch 2.13 registers it, keyed as the dispatcher names the ops (``name.overload``, without
``aten::``); tests/test_autocast_lists.py holds it equal to what the installed torch has
registered at ``AutocastCUDA`` (a CPU build registers them too).

Over meta or CPU tensors that key never acts, so :class:`dpprof.emulator.kernels.
EmulatedAutocast` re-enacts the policies where a model's Python reaches the op: the C
bindings of the same name (``torch.X``, ``torch._VF.X``, ``torch._C._nn.X``,
``torch.linalg.X``, ``Tensor.X``, ``torch.nn.functional.X``; :func:`cuda_entry_points`).
Python wrappers above them (``F.layer_norm``, ``F.mse_loss``, ``torch.norm``) call those
bindings and need nothing of their own. What a C++ composite that is on no list calls
inside itself is out of reach (``linalg_norm``'s ``linalg_vector_norm``); the one such
composite models commonly meet, ``cross_entropy_loss``, is run op by op
(:func:`dpprof.emulator.emulated_autocast.cross_entropy_composite`).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch._VF
import torch.nn.functional as F

# CastPolicy (autocast_mode.h)
LOWER_PRECISION_FP = "lower_precision_fp"  # floating args cast to the autocast dtype
FP32 = "fp32"  # floating args cast to float32
FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"  # a float32 result asked for, unless dtype named
FP32_APPEND_DTYPE = "fp32_append_dtype"  # redispatched to the overload taking a dtype
PROMOTE = "promote"  # run in the widest floating dtype among the args
BANNED = "banned"  # raises under CUDA autocast
POLICIES = (LOWER_PRECISION_FP, FP32, FP32_SET_OPT_DTYPE, FP32_APPEND_DTYPE, PROMOTE, BANNED)

_LOWER_OPS = """
    _convolution _convolution.deprecated conv1d conv2d conv3d conv_tbc conv_transpose1d
    conv_transpose2d.input conv_transpose3d.input convolution prelu addmm addmv addr matmul
    einsum mm mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot
    _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell
    rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention
    cudnn_convolution cudnn_convolution_transpose
"""
_FP32_OPS = """
    acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan
    pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm
    rms_norm group_norm frobenius_norm.dim nuclear_norm nuclear_norm.dim cosine_similarity
    poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div
    l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss
    soft_margin_loss triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits
    dist pdist cdist renorm logsumexp upsample_nearest1d _upsample_nearest_exact1d
    upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d
    upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d
    upsample_bicubic2d _upsample_bicubic2d_aa
"""
_SET_OPT_DTYPE_OPS = """
    prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm
    linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList
"""
_APPEND_DTYPE_OPS = "norm.Scalar norm.ScalarOpt_dim"
_PROMOTE_OPS = """
    addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot
    scatter_add
"""
_BANNED_OPS = "binary_cross_entropy"

CUDA_AUTOCAST_OPS: dict[str, str] = {
    op: policy
    for ops, policy in ((_LOWER_OPS, LOWER_PRECISION_FP), (_FP32_OPS, FP32),
                        (_SET_OPT_DTYPE_OPS, FP32_SET_OPT_DTYPE),
                        (_APPEND_DTYPE_OPS, FP32_APPEND_DTYPE), (_PROMOTE_OPS, PROMOTE),
                        (_BANNED_OPS, BANNED))
    for op in ops.split()
}

# autocast_mode.cpp's binary_cross_entropy_banned, word for word
BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using "
    "torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast.")

# Python functions that reach a listed op without a binding of its name in between, or that
# another emulator context replaces by Python of its own before autocast wraps it:
# F.nll_loss calls nll_loss_nd (a composite, on no list, whose nll_loss/nll_loss2d Python
# never sees); GpuKernels replaces F.scaled_dot_product_attention and F.rms_norm; ``x ** y``
# and ``a @ b`` are Tensor.__pow__ and Tensor.__matmul__ (TensorBase's, under other names).
_EXTRA_ENTRY_POINTS: list[tuple[Any, str, str]] = [
    (F, "nll_loss", "nll_loss"), (F, "scaled_dot_product_attention",
                                  "scaled_dot_product_attention"),
    (F, "rms_norm", "rms_norm"), (torch.Tensor, "__pow__", "pow.Tensor_Tensor"),
    (torch.Tensor, "__matmul__", "matmul"),
]


def _policies_by_name() -> dict[str, str]:
    """The policy of every listed op name (each overload of a name shares its name's)."""
    out: dict[str, str] = {}
    for op, policy in CUDA_AUTOCAST_OPS.items():
        name = op.split(".")[0]
        assert out.setdefault(name, policy) == policy, (name, policy, out[name])
    return out


# op name -> policy, sorted by name: every region's entry walks it (cuda_entry_points)
POLICY_BY_NAME: dict[str, str] = dict(sorted(_policies_by_name().items()))


# The attribute an emulated region sets on the wrapper it puts in a binding's place: a
# region entered inside another wraps that wrapper again (an inner region's dtype wins).
ENTRY_POINT_MARK = "dpprof_autocast_entry_point"


def _is_binding(value: Any) -> bool:
    return (isinstance(value, (types.BuiltinFunctionType, types.MethodDescriptorType))
            or getattr(value, ENTRY_POINT_MARK, False))


def cuda_entry_points() -> list[tuple[Any, str, str]]:
    """(owner, attribute, policy) for each Python binding of a listed op: the attribute
    holds the C binding itself (not a Python wrapper, which calls a binding listed here),
    plus :data:`_EXTRA_ENTRY_POINTS`. Looked up at each call: other contexts (GpuKernels)
    may have replaced some attributes first."""
    owners: list[tuple[Any, str]] = [
        (torch, ""), (torch._VF, ""), (torch._C._nn, ""),
        (getattr(torch._C, "_linalg"), ""),  # noqa: B009 (not in torch's stubs)
        (torch.linalg, "linalg_"), (torch.Tensor, ""), (F, "")]
    points: list[tuple[Any, str, str]] = []
    seen: set[tuple[int, str]] = set()
    for name, policy in POLICY_BY_NAME.items():
        for owner, prefix in owners:
            if prefix and not name.startswith(prefix):
                continue
            attr = name[len(prefix):]
            if _is_binding(getattr(owner, attr, None)) and (id(owner), attr) not in seen:
                seen.add((id(owner), attr))
                points.append((owner, attr, policy))
    for owner, attr, op in _EXTRA_ENTRY_POINTS:
        if (id(owner), attr) not in seen and hasattr(owner, attr):
            seen.add((id(owner), attr))
            points.append((owner, attr, CUDA_AUTOCAST_OPS[op]))
    return points
