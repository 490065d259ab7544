"""Kernel choice on the target GPU: run the kernels CUDA would pick, not meta's or CPU's.

Some ATen ops pick an implementation by device, and the implementations save different
tensors for backward. Over meta tensors the emulator would otherwise get the *CPU/meta*
choice. :class:`GpuKernels` is a ``TorchFunctionMode`` that re-routes them, per target GPU
(compute capability) and dtype:

* ``F.scaled_dot_product_attention`` — ``sdp_utils.cpp`` (CUDA) tries, in order, flash
  attention (compute capability >= 8.0, float16/bfloat16, no ``attn_mask``, head dim a
  multiple of 8 and at most 256), memory-efficient attention (cc >= 5.0, float32/float16,
  bfloat16 only from cc 8.0, head dim a multiple of 8 (4 for float32)), then the math
  path. Flash and memory-efficient save the output and an O(seq) log-sum-exp per head
  (``_scaled_dot_product_{flash,efficient}_attention``, called directly so their autograd
  nodes save what CUDA saves); the math path saves the seq x seq attention matrix. cuDNN
  attention is not picked by default in torch 2.13 and is not modelled.
* ``F.dropout`` in training — CUDA uses the fused ``native_dropout`` (a 1-byte bool mask
  saved for backward, ``is_fused_kernel_acceptable``); CPU and meta build the mask with
  ``bernoulli_`` as a tensor of the input's dtype and multiply (4 bytes per element for
  float32).

* ``aten::embedding_dense_backward`` (what ``nn.Embedding``'s backward runs) — CUDA's
  ``embedding_dense_backward_cuda`` sorts the indices and sums partial segments through
  buffers of its own (:func:`embedding_backward_buffers`); meta allocates only the
  gradient. These buffers are played as allocations and frees around the gradient, in the
  kernel's order, on the op's device (:class:`dpprof.emulator.events.KernelPlan`).

Only meaningful over meta tensors: over CPU tensors (``--compute``) the CPU kernels run,
as the CPU would run them.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dpprof.emulator.autocast_lists import (
    BANNED_MESSAGE,
    ENTRY_POINT_MARK,
    FP32,
    FP32_APPEND_DTYPE,
    FP32_SET_OPT_DTYPE,
    LOWER_PRECISION_FP,
    PROMOTE,
    cuda_entry_points,
)
from dpprof.emulator.catalog import DEFAULT_GPU
from dpprof.emulator.cuda_devices import on_meta
from dpprof.emulator.cudnn_workspace import BACKWARD, FORWARD, conv_workspace_bytes
from dpprof.emulator.events import ALLOC, FREE, KernelPlan, KernelStep
from dpprof.emulator.patcher import Patcher
from dpprof.emulator.virtual_devices import VirtualDevices

FLASH = "flash"
EFFICIENT = "efficient"
MATH = "math"

DEFAULT_COMPUTE_CAPABILITY = DEFAULT_GPU.compute_capability


@dataclass(frozen=True)
class SdpaCall:
    head_dim: int
    dtype: torch.dtype
    has_mask: bool


def sdpa_backend(cc: tuple[int, int], call: SdpaCall) -> str:
    """The backend CUDA's ``select_sdp_backend`` picks for ``call`` on compute capability
    ``cc`` (default priority: flash, memory-efficient, math)."""
    major = cc[0]
    half = call.dtype in (torch.float16, torch.bfloat16)
    if (major >= 8 and half and not call.has_mask and call.head_dim % 8 == 0
            and call.head_dim <= 256):
        return FLASH
    dtype_ok = call.dtype in (torch.float32, torch.float16) or (
        call.dtype == torch.bfloat16 and major >= 8)
    align = 4 if call.dtype == torch.float32 else 8
    if major >= 5 and dtype_ok and call.head_dim % align == 0:
        return EFFICIENT
    return MATH


class GpuKernels:
    """Route device-dependent ops to the implementation the target GPU would use.

    A context manager that swaps ``torch.nn.functional.scaled_dot_product_attention`` and
    ``torch.nn.functional.dropout`` (what ``nn.Dropout`` calls) for the duration. (A
    ``TorchFunctionMode`` would catch more spellings, but makes every torch call go through
    Python and imports torch._dynamo: several times slower.) A model that imported the
    function by name before the emulation (``from torch.nn.functional import
    scaled_dot_product_attention``) keeps the original. ``chosen`` counts the choices made
    (e.g. ``{"sdpa:efficient": 4, "dropout:fused": 8}``) so a report can state them.
    """

    def __init__(self, compute_capability: tuple[int, int] = DEFAULT_COMPUTE_CAPABILITY,
                 rt: VirtualDevices | None = None):
        self.cc = compute_capability
        self.chosen: dict[str, int] = {}
        self._patcher = Patcher()
        self.rt = rt  # where the kernels' own buffers are played (aten-level routes)
        self._orig_sdpa: Callable[..., torch.Tensor] = F.scaled_dot_product_attention

    def __enter__(self) -> GpuKernels:
        if self.rt is not None:
            plans = self.rt.kernel_plans
            plans[torch.ops.aten.embedding_dense_backward.default] = (
                self._embedding_backward_plan)
            plans[torch.ops.aten.convolution.default] = self._convolution_plan
            plans[torch.ops.aten.convolution_backward.default] = (
                self._convolution_backward_plan)
        orig_dropout, orig_rms_norm = F.dropout, F.rms_norm
        self._orig_sdpa = F.scaled_dot_product_attention
        patch = self._patcher.patch
        patch(F, "scaled_dot_product_attention", self._sdpa)
        patch(F, "dropout", lambda *a, **k: self._dropout(orig_dropout, *a, **k))
        patch(F, "rms_norm", lambda *a, **k: self._rms_norm(orig_rms_norm, *a, **k))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._patcher.restore()
        if self.rt is not None:
            for op in (torch.ops.aten.embedding_dense_backward.default,
                       torch.ops.aten.convolution.default,
                       torch.ops.aten.convolution_backward.default):
                self.rt.kernel_plans.pop(op, None)

    def _embedding_backward_plan(self, args: Any, kwargs: dict[str, Any]) -> KernelPlan | None:
        grad, indices, num_weights, _padding_idx, scale_grad_by_freq = (
            list(args) + [kwargs.get(k) for k in ("grad_output", "indices", "num_weights",
                                                  "padding_idx", "scale_grad_by_freq")
                          ][len(args):])
        plan = embedding_backward_plan(
            num_indices=indices.numel(), index_bytes=indices.element_size(),
            num_weights=int(num_weights), width=int(grad.shape[-1]), grad_dtype=grad.dtype,
            scale_grad_by_freq=bool(scale_grad_by_freq),
            grad_copy_bytes=0 if grad.is_contiguous() else grad.numel() * grad.element_size(),
            indices_copy_bytes=(0 if indices.is_contiguous()
                                else indices.numel() * indices.element_size()))
        self._count("embedding_backward:" + ("sorted" if plan.before else "direct"), grad)
        return plan if plan.before or plan.after else None

    def _convolution_plan(self, args: Any, kwargs: dict[str, Any]) -> KernelPlan | None:
        """``aten::convolution`` through cuDNN: its workspace, taken after the output and
        given back (:mod:`dpprof.emulator.cudnn_workspace`)."""
        x, w = args[0], args[1]
        stride, transposed, groups = args[3], args[6], args[8]
        out_bytes = _conv_output_bytes(x, w, args[4], stride, args[5])
        return self._workspace_plan(FORWARD, x, w, stride, bool(transposed), int(groups),
                                    out_bytes)

    def _convolution_backward_plan(self, args: Any, kwargs: dict[str, Any]
                                   ) -> KernelPlan | None:
        """``aten::convolution_backward`` through cuDNN (the input's and the weight's
        gradients): its workspace, taken after the gradients and given back."""
        grad, x, w = args[0], args[1], args[2]
        stride, transposed, groups = args[4], args[7], args[9]
        mask = args[10] if len(args) > 10 else kwargs.get("output_mask", (True, True, True))
        if not (mask[0] or mask[1]):
            return None  # the bias's gradient only: a reduction, no cuDNN call
        return self._workspace_plan(BACKWARD, x, w, stride, bool(transposed), int(groups),
                                    grad.numel() * grad.element_size())

    def _workspace_plan(self, direction: str, x: torch.Tensor, w: torch.Tensor,
                        stride: Any, transposed: bool, groups: int,
                        out_bytes: int) -> KernelPlan | None:
        if transposed or groups != 1 or not on_meta(x) or w.dim() < 3:
            return None
        nbytes = conv_workspace_bytes(
            direction, x.dtype, int(w.shape[1]), tuple(w.shape[2:]), tuple(stride),
            x.numel() * x.element_size(), out_bytes, w.numel() * w.element_size())
        if nbytes <= 0:
            return None
        self._count(f"cudnn_workspace:{direction}", x)
        name = "cuDNN workspace"
        return KernelPlan((), (KernelStep(ALLOC, name, nbytes), KernelStep(FREE, name)))

    def _count(self, key: str, on: torch.Tensor) -> None:
        """One more choice of ``key``, for every device ``on``'s storage stands for (a
        DataParallel replica's device mirrored by its equals' counts for each of them)."""
        n = 1 if self.rt is None else self.rt.mirrors.multiplicity(self.rt.storages.device_of(on))
        self.chosen[key] = self.chosen.get(key, 0) + n

    def _dropout(self, func: Callable[..., Any], input: torch.Tensor, p: float = 0.5,
                 training: bool = True, inplace: bool = False, **kw: Any) -> torch.Tensor:
        train = kw.get("train", training)
        if (not train or p == 0 or p == 1 or inplace or not input.is_floating_point()
                or not on_meta(input)):  # a real host tensor (dpprof run): the CPU's kernel
            return func(input, p, train, inplace)
        self._count("dropout:fused", input)
        return torch.native_dropout(input, p, True)[0]

    def _rms_norm(self, func: Callable[..., Any], input: torch.Tensor,
                  normalized_shape: Any, weight: torch.Tensor | None = None,
                  eps: float | None = None) -> torch.Tensor:
        if not on_meta(input) or not fused_rms_norm_applies(input, weight):
            return func(input, normalized_shape, weight, eps)
        self._count("rms_norm:fused", input)
        dims = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
        return FusedRmsNorm.apply(input, weight, dims)  # type: ignore[no-any-return]

    def _sdpa(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
        if not on_meta(query):  # real host tensors (dpprof run): the CPU's kernels
            return self._orig_sdpa(query, key, value, attn_mask=attn_mask,
                                   dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                   enable_gqa=enable_gqa)
        call = SdpaCall(int(query.shape[-1]), query.dtype, attn_mask is not None)
        backend = sdpa_backend(self.cc, call) if not enable_gqa else MATH
        self._count(f"sdpa:{backend}", query)
        if backend == FLASH:
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        if backend == EFFICIENT:
            need_lse = torch.is_grad_enabled() and any(
                t.requires_grad for t in (query, key, value))
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, need_lse, dropout_p, is_causal,
                scale=scale)[0]
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale,
            enable_gqa=enable_gqa)[0]


def _conv_output_bytes(x: torch.Tensor, w: torch.Tensor, padding: Any, stride: Any,
                       dilation: Any) -> int:
    """The bytes of a (not transposed) convolution's output: batch x out channels x each
    spatial dim ``(size + 2 pad - dilation (k - 1) - 1) // stride + 1``."""
    n = int(x.shape[0]) * int(w.shape[0]) if x.dim() == w.dim() else int(w.shape[0])
    dims = w.dim() - 2
    pads, strides, dils = (list(v) * dims if len(v) == 1 else list(v)
                           for v in (padding, stride, dilation))
    for d in range(dims):
        size = int(x.shape[x.dim() - dims + d])
        k = int(w.shape[2 + d])
        n *= max((size + 2 * pads[d] - dils[d] * (k - 1) - 1) // strides[d] + 1, 0)
    return n * x.element_size()


class FusedRmsNorm(torch.autograd.Function):
    """``aten::_fused_rms_norm`` as a CUDA build runs it, over meta tensors.

    ``rms_norm_symint`` (aten/src/ATen/native/layer_norm.cpp) calls ``at::_fused_rms_norm``,
    which a CUDA build implements with its own kernel, while a CPU build (and meta) has only
    the composite decomposition (``rms_norm_composite``: a float32 copy of a low-precision
    input, its square, the normalised float32 product, each saved for backward by its own
    autograd node). The fused op returns the output in the input's dtype and ``rstd`` in
    the accumulation type (float32 for float16/bfloat16/float32 inputs) with the reduced
    dims kept as 1; derivatives.yaml saves ``input``, ``weight`` and ``rstd`` (result1) and
    backward is ``_fused_rms_norm_backward``: ``grad_input`` like the input and
    ``grad_weight`` like the weight. Workspaces inside the CUDA backward kernel are not
    modelled."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,  # type: ignore[override]
                dims: int) -> torch.Tensor:
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        rstd = x.new_empty(tuple(x.shape[:x.dim() - dims]) + (1,) * dims, dtype=acc)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        x, weight, _rstd = ctx.saved_tensors  # rstd: kept for backward, as CUDA keeps it
        grad_input = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_weight = (torch.empty_like(weight)
                       if weight is not None and ctx.needs_input_grad[1] else None)
        return grad_input, grad_weight, None


def fused_rms_norm_applies(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether ``rms_norm_symint`` takes the fused kernel on CUDA: not for channels-last
    or complex inputs, nor when the weight's dtype differs from the input's."""
    if x.is_complex():
        return False
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not \
            x.is_contiguous():
        return False
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d) and not \
            x.is_contiguous():
        return False
    return weight is None or weight.dtype == x.dtype


# ---- embedding backward ---------------------------------------------------------------

# aten/src/ATen/native/cuda/Embedding.cu, embedding_dense_backward_cuda: up to this many
# indices (and without scale_grad_by_freq) one feature-parallel kernel writes the gradient
# directly; above it, the sort-and-segment path.
EMBEDDING_DIRECT_MAX_INDICES = 3072
NROWS_PER_THREAD = 10  # EmbeddingBackwardKernel.cu: rows one partial sum covers
CUB_ALIGN_BYTES = 256  # cub's AliasTemporaries aligns each sub-allocation to 256 B
# cub::DeviceRadixSort's onesweep pass on sm80+ (Policy800): 8 radix bits per pass, tiles of
# 384 threads x 10 items for 8-byte keys (21 items for 4-byte keys, scaled by size).
ONESWEEP_RADIX_BITS = 8
ONESWEEP_BLOCK_THREADS = 384
SCAN_TILE_MIN_ITEMS = 128  # every cub scan / select tile covers at least 128 items
SCAN_TILE_STATUS_MAX_BYTES = 32  # per tile: status + partial + inclusive values, padded
SCAN_TILE_STATUS_PADDING = 32  # cub's TILE_STATUS_PADDING (one warp)


def _align(nbytes: int, to: int = CUB_ALIGN_BYTES) -> int:
    return -(-nbytes // to) * to


def cub_temp_bytes(sizes: list[int]) -> int:
    """cub's ``AliasTemporaries``: each piece rounded up to 256 B, plus 255 B so the start
    can be aligned."""
    return sum(_align(n) for n in sizes) + CUB_ALIGN_BYTES - 1


def radix_sort_pairs_temp_bytes(num_items: int, key_bytes: int, value_bytes: int) -> int:
    """Temporary storage of ``cub::DeviceRadixSort::SortPairs`` (not the DoubleBuffer form:
    it allocates alternate key and value buffers of ``num_items`` each, exact) through the
    onesweep pass (``DispatchRadixSort::InvokeOnesweep``): bins (passes x 256 digits x an
    8-byte offset, an upper bound where cub picks 4-byte offsets), lookback (tiles x 256 x
    4 B with sm80's tile size), counters (passes x 4 B)."""
    passes = -(-key_bytes * 8 // ONESWEEP_RADIX_BITS)
    digits = 1 << ONESWEEP_RADIX_BITS
    items_per_thread = max(1, 21 * 4 // max(key_bytes, value_bytes, 4))
    tile = ONESWEEP_BLOCK_THREADS * items_per_thread
    blocks = -(-num_items // tile)
    return cub_temp_bytes([passes * digits * 8, blocks * digits * 4,
                           num_items * key_bytes, num_items * value_bytes, passes * 4])


def scan_temp_bytes_bound(num_items: int) -> int:
    """An upper bound on a cub scan's or select's temporary storage (``DeviceScan``,
    ``DeviceSelect::UniqueByKey``): its tile-status array, one entry per tile plus a
    warp's padding, at most 32 B each, tiles of at least 128 items."""
    tiles = -(-num_items // SCAN_TILE_MIN_ITEMS)
    return cub_temp_bytes([(tiles + SCAN_TILE_STATUS_PADDING) * SCAN_TILE_STATUS_MAX_BYTES])


def embedding_backward_plan(num_indices: int, index_bytes: int, num_weights: int, width: int,
                            grad_dtype: torch.dtype, scale_grad_by_freq: bool = False,
                            grad_copy_bytes: int = 0, indices_copy_bytes: int = 0
                            ) -> KernelPlan:
    """The buffers ``embedding_dense_backward_cuda`` (``Embedding.cu``) and
    ``embedding_backward_cuda_kernel`` (``EmbeddingBackwardKernel.cu``) allocate and free
    around the gradient they return, in their order. Sizes follow from the shapes alone
    (the kernel sizes its segment buffers by the worst case, ``min(numel, num_weights)``
    segments, so no value is read); the cub scratch of the sort is exact but for a few KiB
    of bins and lookback, that of the scans and the unique-by-key is an upper bound."""
    before: list[KernelStep] = []
    after: list[KernelStep] = []

    def alloc(steps: list[KernelStep], name: str, nbytes: int) -> None:
        if nbytes > 0:
            steps.append(KernelStep(ALLOC, name, nbytes))

    def free(steps: list[KernelStep], *names: str) -> None:
        held = {s.name for s in before + after if s.kind == ALLOC}
        steps.extend(KernelStep(FREE, n) for n in names if n in held)

    n, ib = num_indices, index_bytes
    # indices_.contiguous(), grad_.contiguous(): copies only when not contiguous
    alloc(before, "indices (contiguous copy)", indices_copy_bytes)
    alloc(before, "grad (contiguous copy)", grad_copy_bytes)
    if n <= EMBEDDING_DIRECT_MAX_INDICES and not scale_grad_by_freq:
        # at::zeros for the gradient, one kernel: nothing else
        free(after, "grad (contiguous copy)", "indices (contiguous copy)")
        return KernelPlan(tuple(before), tuple(after))
    alloc(before, "sorted_indices", n * ib)
    alloc(before, "orig_indices", n * ib)
    alloc(before, "range (arange)", n * ib)
    alloc(before, "radix sort scratch (cub)", radix_sort_pairs_temp_bytes(n, ib, ib))
    free(before, "radix sort scratch (cub)", "range (arange)")
    if scale_grad_by_freq:
        alloc(before, "count", n * ib)
        for scan in ("inclusive_sum_by_key", "inclusive_scan_by_key"):
            alloc(before, f"{scan} scratch (cub)", scan_temp_bytes_bound(n))
            free(before, f"{scan} scratch (cub)")
    # embedding_backward_cuda_kernel: the gradient (the op's output), then the segments
    max_segments = min(n, num_weights)
    max_partial_segments = n // NROWS_PER_THREAD + max_segments
    # grad_weight_per_segment holds acc_type: float32 for half/bfloat16 gradients
    acc_bytes = 4 if grad_dtype in (torch.float16, torch.bfloat16) else grad_dtype.itemsize
    alloc(after, "segment_offsets", n * ib)
    alloc(after, "num_of_segments", 8)
    alloc(after, "unique_by_key keys_out", n * ib)
    alloc(after, "unique_by_key scratch (cub)", scan_temp_bytes_bound(n))
    free(after, "unique_by_key scratch (cub)", "unique_by_key keys_out")
    alloc(after, "partials_per_segment", max_segments * ib)
    alloc(after, "partials_per_segment_offset", max_segments * ib)
    alloc(after, "exclusive_sum scratch (cub)", scan_temp_bytes_bound(max_segments))
    free(after, "exclusive_sum scratch (cub)")
    alloc(after, "num_of_partial_segments", 8)
    alloc(after, "partial_segment_offset", max_partial_segments * ib)
    alloc(after, "grad_weight_per_segment", max_partial_segments * width * acc_bytes)
    # destructors: the innermost scope first, each in reverse order of construction
    free(after, "grad_weight_per_segment", "partial_segment_offset", "num_of_partial_segments",
         "partials_per_segment_offset", "partials_per_segment", "num_of_segments",
         "segment_offsets", "count", "orig_indices", "sorted_indices",
         "grad (contiguous copy)", "indices (contiguous copy)")
    return KernelPlan(tuple(before), tuple(after))


# ---- autocast --------------------------------------------------------------------------

# CUDA's lists: dpprof.emulator.autocast_lists (all of them, table-driven). What follows is
# the part of the CPU lists (autocast_mode.cpp, KERNEL_CPU) that the re-enactment under
# ``ops="cpu"`` covers, to check it against torch's own CPU autocast on real tensors, to
# the byte (tests/test_ladder.py): the low-precision ops models reach through
# torch.nn.functional / torch / Tensor.__matmul__ (what nn.Linear and nn.Conv* call), and
# of the float32 ops the losses (softmax and the norms run in the input's dtype on CPU),
# cross_entropy_loss among them.
_LOWER = [(F, "linear"), (F, "conv1d"), (F, "conv2d"), (F, "conv3d"),
          (torch, "matmul"), (torch, "mm"), (torch, "bmm"), (torch, "addmm"),
          (torch, "baddbmm"), (torch.Tensor, "__matmul__"), (torch.Tensor, "matmul"),
          (F, "scaled_dot_product_attention")]
_FP32_CPU = [(F, "cross_entropy"), (F, "nll_loss"), (F, "mse_loss"), (F, "l1_loss"),
             (F, "binary_cross_entropy_with_logits")]
AUTOCAST_OP_LISTS = ("cuda", "cpu")
_HALF_TO_FLOAT = {"softmax": torch._softmax, "log_softmax": torch._log_softmax}


def _names_dtype(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)


def _eligible(x: Any) -> bool:
    """autocast_mode.h's ``is_eligible``: a floating tensor, not float64 (and on the
    autocast's device, which every tensor of the emulator stands for)."""
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


def _names_dims(dim: Any) -> bool:
    """Whether ``dim`` names dimensions (a Dimname overload, on no list)."""
    return isinstance(dim, str) or (isinstance(dim, (list, tuple))
                                    and any(isinstance(d, str) for d in dim))


def _tensors(values: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(_tensors(v))
    return found


def _input_first(args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """A call's input, its other positional arguments and its keywords (``torch.sum(input=x,
    dim=1)`` as ``torch.sum(x, dim=1)``)."""
    if args:
        return args[0], args[1:], kwargs
    rest = dict(kwargs)
    return rest.pop("input", None), (), rest


def _wrap_append_dtype(fn: Any) -> Any:
    """CUDA's fp32_append_dtype (``norm.Scalar``, ``norm.ScalarOpt_dim``): an eligible
    input is not cast; the op is redispatched to its overload taking a dtype, float32."""
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        x, args, kwargs = _input_first(args, kwargs)
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if (not _eligible(x) or _names_dtype(args, kwargs) or _names_dims(dim)
                or kwargs.get("out") is not None):
            return fn(x, *args, **kwargs)
        if not args and "p" not in kwargs:
            args = (2,)  # norm.Scalar's default p; the dtype overloads have none
        return fn(x, *args, **{**kwargs, "dtype": torch.float32})
    return wrapped


def _banned(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(BANNED_MESSAGE)


def _sum(t: torch.Tensor, *dims: int) -> torch.Tensor:
    """``sum`` under CUDA autocast (fp32_set_opt_dtype): float32 for an eligible input
    (floating, not float64)."""
    if t.is_floating_point() and t.dtype != torch.float64:
        return t.sum(*dims, dtype=torch.float32)
    return t.sum(*dims)


def cross_entropy_composite(input: torch.Tensor, target: torch.Tensor,
                            weight: torch.Tensor | None = None,
                            size_average: bool | None = None, ignore_index: int = -100,
                            reduce: bool | None = None, reduction: str = "mean",
                            label_smoothing: float = 0.0) -> torch.Tensor:
    """``F.cross_entropy`` as ATen's composite ``cross_entropy_loss`` (LossNLL.cpp) runs it,
    op by op, so that autocast acts on each op as on a GPU: CUDA's lists do not name
    ``cross_entropy_loss``, so it is not cast; it calls ``log_softmax`` with the input's
    own dtype (which the fp32_set_opt_dtype policy keeps: a bfloat16 result, saved for
    backward), then ``nll_loss`` (float32 policy: a float32 copy of the log-probabilities,
    which ``nll_loss`` saves). Without autocast it computes what ``F.cross_entropy``
    computes."""
    if size_average is not None or reduce is not None:
        reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
    class_dim = 0 if input.dim() == 1 else 1
    classes = input.shape[class_dim]
    log_probs = input.log_softmax(class_dim, input.dtype)
    shape = [1] * input.dim()
    shape[class_dim] = classes
    if input.shape == target.shape:  # class probabilities: cross_entropy_loss_prob_target
        if label_smoothing > 0:
            target = target * (1 - label_smoothing) + label_smoothing / classes
        terms = log_probs * target
        if weight is not None:
            terms = terms * weight.view(shape)
        if reduction == "none":
            return -_sum(terms, class_dim)
        total = -_sum(terms)
        return total / (input.numel() / classes) if reduction == "mean" else total
    nll = F.nll_loss(log_probs, target, weight, ignore_index=ignore_index,
                     reduction=reduction)
    if label_smoothing <= 0:
        return nll
    # cross_entropy_loss_label_smoothing
    ignored = target == ignore_index
    spread = log_probs if weight is None else log_probs * weight.view(shape)
    smooth = -_sum(spread, class_dim)
    smooth.masked_fill_(ignored, 0.0)
    if reduction == "mean":
        kept = ~ignored
        smooth = smooth.sum() / (kept.sum() if weight is None
                                 else weight.gather(0, target.masked_select(kept)).sum())
    elif reduction == "sum":
        smooth = smooth.sum()
    return (1 - label_smoothing) * nll + smooth * (label_smoothing / classes)


class EmulatedAutocast:
    """``torch.autocast("cuda", dtype)`` for tensors on any device (meta included).

    Autocast's dispatch keys only act on CUDA tensors, so over meta tensors the casts are
    re-enacted at the Python bindings of the listed ops (every op on CUDA's lists:
    :mod:`dpprof.emulator.autocast_lists`), by policy: floating arguments of the
    low-precision ops are cast to ``dtype`` (``.to``, recorded by autograd as on a GPU),
    those of the float32 ops to float32; the fp32_set_opt_dtype ops (softmax, sum, cumsum,
    prod, the linalg norms) are asked for a float32 result unless given a dtype, norm's
    fp32_append_dtype overloads get a float32 dtype appended, the promote ops run in the
    widest floating dtype among their arguments, and ``binary_cross_entropy`` raises as
    CUDA's autocast makes it raise; ``F.cross_entropy`` runs op by op
    (:func:`cross_entropy_composite`). Casts of leaf tensors that require grad (the
    weights) are cached until :meth:`clear_cache` (autocast clears its cache when the
    outermost region exits: once per forward), so each weight is copied once per forward
    and the copy lives as long as autograd saves it. Parameters, gradients and optimizer
    state stay float32.

    ``ops``: whose op lists, ``"cuda"`` (the target GPU's) or ``"cpu"`` (torch's CPU
    autocast, to check the re-enactment against ``torch.autocast("cpu")`` on real tensors).
    """

    def __init__(self, dtype: torch.dtype = torch.bfloat16, ops: str = "cuda") -> None:
        if ops not in AUTOCAST_OP_LISTS:
            raise ValueError(f"autocast op lists {ops!r}: choose from {AUTOCAST_OP_LISTS}")
        self.dtype = dtype
        self.ops = ops
        self._cache: dict[int, torch.Tensor] = {}
        self._patcher = Patcher()
        self._outer_suspended = 0
        self.casts = 0
        # Off between the region's end and the next forward (a scenario's region spans the
        # step): nothing cast in backward is kept for the next forward. A checkpointed
        # block's recompute enters a region of its own, as torch's does (checkpoint
        # recorded torch.is_autocast_enabled("cuda") and the dtype in forward), whose
        # cache dies with it: its casts live as long as the recomputed graph saves them.
        self.caching = True

    def clear_cache(self) -> None:
        self._cache.clear()

    def _cast(self, x: Any, dtype: torch.dtype) -> Any:
        if isinstance(x, torch.Tensor):
            if not x.is_floating_point() or x.dtype == dtype or x.dtype == torch.float64:
                return x
            if x.is_leaf and x.requires_grad and torch.is_grad_enabled() and self.caching:
                hit = self._cache.get(id(x))
                if hit is None:
                    hit = self._cache[id(x)] = x.to(dtype)
                    self.casts += 1
                return hit
            self.casts += 1
            return x.to(dtype)
        if isinstance(x, (list, tuple)):
            return type(x)(self._cast(v, dtype) for v in x)
        return x

    def _wrap(self, fn: Any, dtype: torch.dtype | None) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            target = self.dtype if dtype is None else dtype
            # Last argument first: autocast's C++ wrapper casts its arguments in a pack
            # expansion, which GCC (torch's Linux builds) evaluates right to left. The
            # order decides the casts' autograd sequence numbers, so which weight's
            # gradient is cast back to float32 first in backward.
            cast_kwargs = {k: self._cast(kwargs[k], target) for k in reversed(kwargs)}
            cast_args = [self._cast(a, target) for a in reversed(args)][::-1]
            return fn(*cast_args, **{k: cast_kwargs[k] for k in kwargs})
        return wrapped

    @staticmethod
    def _wrap_set_opt_dtype(fn: Any, name: str) -> Any:
        half_to_float = _HALF_TO_FLOAT.get(name)
        names_dims = not name.startswith("linalg_")  # their Dimname overloads are unlisted

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            x, args, kwargs = _input_first(args, kwargs)
            dim = args[0] if args else kwargs.get("dim")
            if (not _eligible(x) or _names_dtype(args, kwargs)
                    or (names_dims and _names_dims(dim))):
                return fn(x, *args, **kwargs)
            if (half_to_float is not None and x.dtype == torch.float16
                    and isinstance(dim, int) and x.device.type != "cpu"):
                # SoftMax.cpp: a CUDA float16 input asked for float32 takes the fused
                # half_to_float kernel, no float32 copy of the input (bfloat16 gets one)
                return half_to_float(x, dim, True)
            return fn(x, *args, **{**kwargs, "dtype": torch.float32})
        return wrapped

    def _wrap_promote(self, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            target = self.dtype
            for t in _tensors([*args, *kwargs.values()]):
                if not _eligible(t):
                    continue
                if torch.float32 in (target, t.dtype):
                    target = torch.float32
                elif t.dtype != self.dtype:
                    raise RuntimeError("Unexpected floating ScalarType in "
                                       "at::autocast::prioritize")
            return self._wrap(fn, target)(*args, **kwargs)
        return wrapped

    def __call__(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """As a decorator (``torch.autocast(...)(forward)``, as accelerate wraps a prepared
        model's forward): each call in a region of its own, as torch's
        ``autocast_decorator`` enters the instance around each call."""
        dtype, ops = self.dtype, self.ops

        @functools.wraps(func)
        def in_region(*args: Any, **kwargs: Any) -> Any:
            with EmulatedAutocast(dtype, ops):
                return func(*args, **kwargs)

        return in_region

    def __enter__(self) -> EmulatedAutocast:
        # an enabled region inside a disabled one casts again, as torch's does
        self._outer_suspended = getattr(_REGION, "suspended", 0)
        _REGION.suspended = 0
        if self.ops == "cpu":
            for owner, name in _LOWER + _FP32_CPU:
                self._patcher.patch(owner, name, self._wrap(
                    getattr(owner, name), None if (owner, name) in _LOWER else torch.float32))
            return self
        for owner, name, policy in cuda_entry_points():
            self._patcher.patch(owner, name, self._policy_wrapper(
                policy, getattr(owner, name), name))
        self._patcher.patch(F, "cross_entropy", cross_entropy_composite)
        _patch_autocast_state(self._patcher)
        _REGION.regions = [*getattr(_REGION, "regions", []), self]
        return self

    def _policy_wrapper(self, policy: str, fn: Any, name: str) -> Any:
        # The op itself runs outside autocast, as autocast's kernels run it (their
        # ExcludeDispatchKeyGuard): what it calls is not cast again, by this region or by
        # one outside it whose wrappers this one's call reaches.
        op = SuspendedAutocast()(fn)
        if policy == LOWER_PRECISION_FP:
            cast = self._wrap(op, None)
        elif policy == FP32:
            cast = self._wrap(op, torch.float32)
        elif policy == FP32_SET_OPT_DTYPE:
            cast = self._wrap_set_opt_dtype(op, name)
        elif policy == FP32_APPEND_DTYPE:
            cast = _wrap_append_dtype(op)
        elif policy == PROMOTE:
            cast = self._wrap_promote(op)
        else:
            cast = _banned

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if autocast_suspended():  # a torch.autocast("cuda", enabled=False) region
                return fn(*args, **kwargs)
            return cast(*args, **kwargs)
        setattr(wrapped, ENTRY_POINT_MARK, True)
        return wrapped

    def __exit__(self, *exc: Any) -> None:
        self._patcher.restore()
        self.clear_cache()
        _REGION.suspended = self._outer_suspended
        if self.ops == "cuda":
            _REGION.regions = [r for r in _REGION.regions if r is not self]


# The current thread's emulated CUDA regions, innermost last, and how deep it is in
# ``torch.autocast("cuda", enabled=False)`` regions inside the innermost (autocast's state
# is per thread, as torch keeps it: DataParallel's replicas each have their own).
_REGION = threading.local()


def autocast_suspended() -> bool:
    return bool(getattr(_REGION, "suspended", 0))


def emulated_autocast_dtype() -> torch.dtype | None:
    """The dtype of the current thread's innermost emulated CUDA region, None outside one."""
    regions = getattr(_REGION, "regions", [])
    return regions[-1].dtype if regions else None


def _patch_autocast_state(patcher: Patcher) -> None:
    """What torch answers about CUDA autocast, as a GPU answers it inside an emulated
    region: ``torch.is_autocast_enabled("cuda")`` (and without an argument: CUDA's, as
    torch/csrc/autograd/init.cpp reads it) True but inside a suspended region, and
    ``torch.get_autocast_dtype("cuda")`` the region's dtype (float16 outside any: CUDA's
    default in aten/src/ATen/autocast_mode.cpp). Code that asks first (Hugging Face's
    ``maybe_autocast``) then branches as on a GPU, and torch's internals that record the
    state and enter it again (checkpoint's recompute, ``_get_autocast_kwargs``;
    ``parallel_apply``'s replica threads; ``custom_bwd``) re-enter the emulated region."""
    is_enabled = torch.is_autocast_enabled
    get_dtype = torch.get_autocast_dtype

    def is_autocast_enabled(*args: Any, **kwargs: Any) -> bool:
        device = kwargs.get("device_type", args[0] if args else "cuda")
        if device != "cuda":
            return bool(is_enabled(*args, **kwargs))
        return emulated_autocast_dtype() is not None and not autocast_suspended()

    def get_autocast_dtype(device_type: str) -> torch.dtype:
        if device_type != "cuda":
            return get_dtype(device_type)
        return emulated_autocast_dtype() or torch.float16

    def get_autocast_gpu_dtype() -> torch.dtype:
        return emulated_autocast_dtype() or torch.float16

    patcher.patch(torch, "is_autocast_enabled", is_autocast_enabled)
    patcher.patch(torch, "get_autocast_dtype", get_autocast_dtype)
    patcher.patch(torch, "get_autocast_gpu_dtype", get_autocast_gpu_dtype)


class SuspendedAutocast(contextlib.ContextDecorator):
    """``torch.autocast("cuda", enabled=False)`` inside an emulated region: the listed ops
    run in the dtypes they are given until it exits (``binary_cross_entropy`` included,
    the usual way around its ban)."""

    def __enter__(self) -> SuspendedAutocast:
        _REGION.suspended = getattr(_REGION, "suspended", 0) + 1
        return self

    def __exit__(self, *exc: Any) -> None:
        _REGION.suspended -= 1


class StepAutocast:
    """``--amp`` in a real training step, as a user writes it: forward and loss under
    autocast, backward and the optimizer outside (:meth:`phase` wraps a ``StepHooks.phase``).

    On CUDA tensors it is ``torch.autocast("cuda", dtype)``; on any other device (the cpu
    backend's gloo ranks, the cuda backend's test mode) :class:`EmulatedAutocast`, CUDA's op
    lists re-enacted, so the ranks cast exactly as the emulated scenarios beside them.
    Use it as a context manager around the steps: an exception mid-step ends the region.
    """

    def __init__(self, amp: str | None, device_type: str, native: bool = False) -> None:
        self.dtype: torch.dtype | None = getattr(torch, amp) if amp else None
        self.device_type = device_type
        self.native = native  # torch.autocast(device_type) on any device (the checks)
        self._region = contextlib.ExitStack()

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        assert self.dtype is not None
        if self.device_type == "cuda" or self.native:
            return torch.autocast(self.device_type, dtype=self.dtype)
        return EmulatedAutocast(self.dtype)

    def phase(
        self, inner: Callable[[str], contextlib.AbstractContextManager[None]]
    ) -> Callable[[str], contextlib.AbstractContextManager[None]]:
        def phase(name: str) -> contextlib.AbstractContextManager[None]:
            if self.dtype is not None:
                if name == "forward":
                    self._region.enter_context(self._autocast())
                elif name == "backward":
                    self._region.close()  # the region (forward + loss) ends: cache cleared
            return inner(name)
        return phase

    def __enter__(self) -> StepAutocast:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._region.close()


def _called_from_torch() -> bool:
    """Whether the code that opened an autocast region (the caller of the caller) is
    torch's own: its internals re-enter a state they recorded (checkpoint's recompute, a
    replica thread of ``parallel_apply``), a region the workload's code did not write."""
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return caller == "torch" or caller.startswith("torch.")


class CudaAutocastNames:
    """``torch.autocast("cuda", ...)`` in the user's code (their step, their forward), as a
    GPU would run it: a CPU build of torch disables a CUDA autocast ("CUDA is not
    available"), and over meta tensors autocast's dispatch keys never act, so while this
    context is active ``torch.autocast``, ``torch.amp.autocast`` (and the name in
    ``torch.amp.autocast_mode`` that ``custom_fwd``/``custom_bwd`` enter) and
    ``torch.cuda.amp.autocast`` with ``device_type="cuda"`` (enabled) return an
    :class:`EmulatedAutocast` of the requested dtype (float16 by default, as autocast's),
    disabled (by the user's code) a :class:`SuspendedAutocast`; other device types get
    torch's own. ``regions`` counts the enabled CUDA regions the workload's code entered
    (not torch's re-entries of them, as checkpoint's recompute)."""

    def __init__(self) -> None:
        self.regions = 0
        self._patcher = Patcher()

    def _factory(self, original: Any) -> Any:
        def autocast(device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                     cache_enabled: bool | None = None) -> Any:
            if device_type == "cuda" and enabled:
                if not _called_from_torch():
                    self.regions += 1
                # torch.autocast's default: the thread's current CUDA autocast dtype
                return EmulatedAutocast(dtype or torch.get_autocast_dtype("cuda"))
            if device_type == "cuda":
                return SuspendedAutocast()
            return original(device_type, dtype=dtype, enabled=enabled,
                            cache_enabled=cache_enabled)
        return autocast

    def _cuda_factory(self, original: Any) -> Any:
        def autocast(enabled: bool = True, dtype: torch.dtype = torch.float16,
                     cache_enabled: bool = True) -> Any:
            if enabled:
                if not _called_from_torch():
                    self.regions += 1
                return EmulatedAutocast(dtype)
            return SuspendedAutocast()
        return autocast

    def __enter__(self) -> CudaAutocastNames:
        import torch.amp
        import torch.amp.autocast_mode
        import torch.cuda.amp

        # autocast_mode's own name: the one custom_fwd and custom_bwd enter
        for owner in (torch, torch.amp, torch.amp.autocast_mode):
            fn = getattr(owner, "autocast")  # noqa: B009 (torch.amp's is not in its stubs)
            self._patcher.patch(owner, "autocast", self._factory(fn))
        self._patcher.patch(torch.cuda.amp, "autocast",
                            self._cuda_factory(torch.cuda.amp.autocast))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._patcher.restore()
