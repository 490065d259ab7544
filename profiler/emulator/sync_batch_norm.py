"""SyncBatchNorm's CUDA-only kernels on virtual GPUs.

``nn.SyncBatchNorm`` (``torch/nn/modules/_functions.py``) computes each rank's statistics,
all-gathers them, and normalizes with ops only CUDA implements
(``aten/src/ATen/native/cuda/Normalization.cu``): ``batch_norm_stats``,
``batch_norm_gather_stats_with_counts`` (and ``batch_norm_gather_stats``),
``batch_norm_elemt``, ``batch_norm_backward_reduce`` and ``batch_norm_backward_elemt``.
Neither meta nor CPU tensors have kernels for them, so a DDP script that converts its
BatchNorms (``SyncBatchNorm.convert_sync_batchnorm``) stopped at its first forward. :data:`KERNELS`
gives them Meta and CPU kernels, written with torch's own ops, while an emulation runs
(:mod:`dpprof.emulator.aten_kernels`): each returns what the CUDA kernel returns, of the
same shapes and dtypes (per-channel statistics in the input's accumulate type, float32 for
16-bit inputs; the output and the input's gradient like the input), computed as the CUDA
kernel computes it. What a kernel computes on the way is not allocated from the caching
allocator on a GPU, and is not counted here either (the emulator counts an op's outputs).
"""

from __future__ import annotations

import torch

from dpprof.emulator.aten_kernels import Kernel

__all__ = ["KERNELS"]


def _dims(x: torch.Tensor) -> list[int]:
    """Every dimension but the channels' (dim 1)."""
    return [d for d in range(x.dim()) if d != 1]


def _per_channel(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``v`` (``[C]``) shaped to broadcast over ``like`` (``[N, C, ...]``)."""
    return v.reshape([1, -1] + [1] * (like.dim() - 2))


def _accumulate(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def batch_norm_stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    xa = x.to(_accumulate(x.dtype))
    mean = xa.mean(_dims(x))
    var = xa.var(_dims(x), unbiased=False)
    return mean, (var + eps).rsqrt()


def batch_norm_elemt(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                     mean: torch.Tensor, invstd: torch.Tensor, eps: float) -> torch.Tensor:
    y = (x.to(mean.dtype) - _per_channel(mean, x)) * _per_channel(invstd, x)
    if weight is not None:
        y = y * _per_channel(weight.to(mean.dtype), x)
    if bias is not None:
        y = y + _per_channel(bias.to(mean.dtype), x)
    return y.to(x.dtype)


def batch_norm_elemt_out(x: torch.Tensor, weight: torch.Tensor | None,
                         bias: torch.Tensor | None, mean: torch.Tensor, invstd: torch.Tensor,
                         eps: float, *, out: torch.Tensor) -> torch.Tensor:
    return out.copy_(batch_norm_elemt(x, weight, bias, mean, invstd, eps))


def batch_norm_gather_stats_with_counts(
        x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
        running_mean: torch.Tensor | None, running_var: torch.Tensor | None, momentum: float,
        eps: float, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's ``[W, C]`` statistics combined by their counts (the CUDA kernel's merge
    of means and variances); the running statistics updated in place, the variance
    unbiased."""
    n = counts.to(mean.dtype).reshape(-1, 1)
    total = n.sum(0)
    global_mean = (mean * n).sum(0) / total
    var = ((invstd.reciprocal().square() - eps) + (mean - global_mean).square()) * n
    global_var = var.sum(0) / total
    if running_mean is not None:
        running_mean.mul_(1 - momentum).add_(global_mean.to(running_mean.dtype), alpha=momentum)
    if running_var is not None:
        unbiased = global_var * total / (total - 1).clamp(min=1)
        running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return global_mean, (global_var + eps).rsqrt()


def batch_norm_gather_stats(
        x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
        running_mean: torch.Tensor | None, running_var: torch.Tensor | None, momentum: float,
        eps: float, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.full((mean.shape[0],), float(count), dtype=mean.dtype, device=mean.device)
    return batch_norm_gather_stats_with_counts(x, mean, invstd, running_mean, running_var,
                                               momentum, eps, counts)


def batch_norm_backward_reduce(
        grad_out: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
        weight: torch.Tensor | None, input_g: bool, weight_g: bool, bias_g: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-channel sums of the gradient and of the gradient times ``x - mean``; the
    weight's and the bias's gradients from them. What was not asked for is an empty tensor
    (the CUDA kernel's undefined one: SyncBatchNorm does not read it)."""
    dy = grad_out.to(mean.dtype)
    sum_dy = dy.sum(_dims(x))
    sum_dy_xmu = (dy * (x.to(mean.dtype) - _per_channel(mean, x))).sum(_dims(x))
    like = weight if weight is not None else mean
    empty = mean.new_empty(0)
    return (sum_dy if input_g else empty, sum_dy_xmu if input_g else empty,
            (sum_dy_xmu * invstd).to(like.dtype) if weight_g else like.new_empty(0),
            sum_dy.to(like.dtype) if bias_g else like.new_empty(0))


def batch_norm_backward_elemt(
        grad_out: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
        weight: torch.Tensor | None, sum_dy: torch.Tensor, sum_dy_xmu: torch.Tensor,
        count: torch.Tensor) -> torch.Tensor:
    acc = mean.dtype
    n = count.to(acc).sum()
    istd = _per_channel(invstd, x)
    xmu = x.to(acc) - _per_channel(mean, x)
    g = (grad_out.to(acc) - _per_channel(sum_dy / n, x)
         - xmu * istd.square() * _per_channel(sum_dy_xmu / n, x)) * istd
    if weight is not None:
        g = g * _per_channel(weight.to(acc), x)
    return g.to(x.dtype)


# the CUDA-only ops' kernels, as their Meta and CPU kernels (torch has none there; a kernel
# torch may add one day is ours while an emulation runs: dpprof.emulator.aten_kernels)
KERNELS: tuple[Kernel, ...] = tuple(
    (name, kernel, key) for name, kernel in (
        ("batch_norm_stats", batch_norm_stats),
        ("batch_norm_elemt", batch_norm_elemt),
        ("batch_norm_elemt.out", batch_norm_elemt_out),
        ("batch_norm_gather_stats", batch_norm_gather_stats),
        ("batch_norm_gather_stats_with_counts", batch_norm_gather_stats_with_counts),
        ("batch_norm_backward_reduce", batch_norm_backward_reduce),
        ("batch_norm_backward_elemt", batch_norm_backward_elemt),
    ) for key in ("Meta", "CPU"))
