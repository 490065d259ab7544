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
  buffers of its own (:mod:`dpprof.emulator.embedding_backward`); meta allocates only the
  gradient. These buffers are played as allocations and frees around the gradient, in the
  kernel's order, on the op's device (:class:`dpprof.emulator.events.KernelPlan`). So are
  CTC loss's (:mod:`dpprof.emulator.ctc_loss`) and cuDNN's convolution workspace.
* ``aten::lstm_cell`` / ``gru_cell`` (``nn.LSTMCell``, ``nn.GRUCell``) — on a CUDA input
  ATen's cells run two matmuls and a fused kernel that saves one workspace; meta takes the
  host's unfused cell (its gates saved). :func:`lstm_cell` and :func:`gru_cell` run the
  CUDA branch for an input on a virtual GPU. ``nn.LSTM``/``GRU``/``RNN`` (cuDNN's RNN) are
  not played, only counted for a note (:func:`kernel_notes`).

Only meaningful over meta tensors: over CPU tensors (``--compute``) the CPU kernels run,
as the CPU would run them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.nn.modules.rnn as rnn_modules

from dpprof.emulator import aten_kernels, ctc_loss
from dpprof.emulator.catalog import DEFAULT_GPU
from dpprof.emulator.cuda_devices import on_meta
from dpprof.emulator.cudnn_workspace import BACKWARD, FORWARD, conv_workspace_bytes
from dpprof.emulator.embedding_backward import embedding_backward_plan
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


# RNNs a GPU runs with kernels the emulation does not play: the layers' calls (torch's _VF
# functions) -> the key they are counted under in GpuKernels.chosen
# (nn.LSTMCell's lstm_cell and nn.GRUCell's gru_cell are played: GpuKernels runs CUDA's
# fused cells)
NOT_PLAYED = {"lstm": "cudnn_rnn", "gru": "cudnn_rnn", "rnn_tanh": "cudnn_rnn",
              "rnn_relu": "cudnn_rnn"}
NOT_PLAYED_NOTE = (
    "nn.LSTM, nn.GRU or nn.RNN ran on a virtual GPU (calls: {layers}): counted is torch's "
    "own path, step by step, each step's gates kept for the backward, where a GPU runs "
    "cuDNN's RNN (the weights in one buffer, a reserve space kept from the forward to the "
    "backward, a workspace: sizes cuDNN alone knows; with cuDNN off, its fused cells): "
    "what those layers hold is not the GPU's figure")


def _cell_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, w.t())


def kernel_notes(chosen: dict[str, int], compute_capability: tuple[int, int]) -> list[str]:
    """A run's notes on the kernels :class:`GpuKernels` chose (``chosen``): those played as
    the GPU of ``compute_capability`` runs them, and the RNNs it does not play."""
    played = {k: v for k, v in chosen.items() if k not in NOT_PLAYED.values()}
    notes = []
    if played:
        notes.append("kernels as on a GPU of compute capability {}.{}: {}".format(
            *compute_capability, ", ".join(f"{k} x{v}" for k, v in sorted(played.items()))))
    layers = [f"{k} x{v}" for k, v in sorted(chosen.items()) if k in NOT_PLAYED.values()]
    if layers:
        notes.append(NOT_PLAYED_NOTE.format(layers=", ".join(layers)))
    return notes


class _CountedRnns:
    """torch's ``_VF`` as ``torch.nn.modules.rnn`` calls it, counting the RNN calls made
    on a virtual GPU (their first argument, the input, emulated)."""

    def __init__(self, vf: Any, count: Callable[[str, torch.Tensor], None]) -> None:
        self._vf, self._count = vf, count

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._vf, name)
        key = NOT_PLAYED.get(name)
        if key is None:
            return fn

        def counted(input: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(input, torch.Tensor) and on_meta(input):
                self._count(key, input)
            return fn(input, *args, **kwargs)
        return counted


def lstm_cell(kernels: GpuKernels, input: torch.Tensor, hx: Any, w_ih: torch.Tensor,
              w_hh: torch.Tensor, b_ih: torch.Tensor | None = None,
              b_hh: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten::lstm_cell`` as ATen's ``LSTMCell`` runs it (``RNN.cpp``): on a GPU (an input
    on a virtual GPU) the gates' two matmuls and CUDA's fused cell,
    ``_thnn_fused_lstm_cell`` (its outputs and a ``4 x hidden`` workspace, saved for the
    backward), elsewhere the host's path, op for op."""
    h, c = hx[0], hx[1]
    if on_meta(input):
        kernels.count("lstm_cell:fused", input)
        hy, cy, _ = torch.ops.aten._thnn_fused_lstm_cell(
            _cell_matmul(input, w_ih), _cell_matmul(h, w_hh), c, b_ih, b_hh)
        return hy, cy
    gates = F.linear(h, w_hh, b_hh).add_(F.linear(input, w_ih, b_ih))
    ingate, forgetgate, cellgate, outgate = gates.unsafe_chunk(4, 1)
    ingate, forgetgate = ingate.sigmoid_(), forgetgate.sigmoid_()
    cellgate, outgate = cellgate.tanh_(), outgate.sigmoid_()
    cy = (forgetgate * c).add_(ingate * cellgate)
    return outgate * cy.tanh(), cy


def gru_cell(kernels: GpuKernels, input: torch.Tensor, hx: torch.Tensor, w_ih: torch.Tensor,
             w_hh: torch.Tensor, b_ih: torch.Tensor | None = None,
             b_hh: torch.Tensor | None = None) -> torch.Tensor:
    """``aten::gru_cell`` as ATen's ``GRUCell`` runs it (``RNN.cpp``): on a GPU the gates' two
    matmuls and CUDA's fused cell, ``_thnn_fused_gru_cell`` (a ``5 x hidden`` workspace
    saved for the backward), elsewhere the host's path, op for op."""
    if on_meta(input):
        kernels.count("gru_cell:fused", input)
        return torch.ops.aten._thnn_fused_gru_cell(
            _cell_matmul(input, w_ih), _cell_matmul(hx, w_hh), hx, b_ih, b_hh)[0]
    igates = F.linear(input, w_ih, b_ih).unsafe_chunk(3, 1)
    hgates = F.linear(hx, w_hh, b_hh).unsafe_chunk(3, 1)
    reset_gate = hgates[0].add_(igates[0]).sigmoid_()
    input_gate = hgates[1].add_(igates[1]).sigmoid_()
    new_gate = igates[2].add(hgates[2].mul_(reset_gate)).tanh_()
    return (hx - new_gate).mul_(input_gate).add_(new_gate)


def _fused_gru_cell_meta(input_gates: torch.Tensor, hidden_gates: torch.Tensor,
                         hx: torch.Tensor, input_bias: torch.Tensor | None = None,
                         hidden_bias: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``_thnn_fused_gru_cell_cuda``'s outputs (``RNN.cu``): the workspace ``[B, 5 H]``
    (made first), ``hy`` like ``hx``."""
    workspace = hx.new_empty((hx.shape[0], hx.shape[1] * 5))
    return torch.empty(hx.shape, dtype=hx.dtype, device=hx.device), workspace


def _fused_gru_cell_backward_meta(grad_hy: torch.Tensor, workspace: torch.Tensor,
                                  has_bias: bool) -> tuple[torch.Tensor, ...]:
    """``_thnn_fused_gru_cell_backward_cuda``'s outputs: both gates' gradients ``[B, 3 H]``,
    ``hx``'s, and the biases' (their sums over the batch) where there are biases."""
    rows, hidden = workspace.shape[0], workspace.shape[1] // 5
    gates = (workspace.new_empty((rows, 3 * hidden)), workspace.new_empty((rows, 3 * hidden)))
    grad_hx = torch.empty(grad_hy.shape, dtype=grad_hy.dtype, device=grad_hy.device)
    biases = ((gates[0].new_empty(3 * hidden), gates[1].new_empty(3 * hidden)) if has_bias
              else (gates[0].new_empty(0), gates[1].new_empty(0)))
    return (*gates, grad_hx, *biases)


class GpuKernels:
    """Route device-dependent ops to the implementation the target GPU would use.

    A context manager that swaps ``torch.nn.functional.scaled_dot_product_attention``,
    ``torch.nn.functional.dropout`` (what ``nn.Dropout`` calls) and ``rms_norm`` for the
    duration, registers the RNN cells' kernels and plays the kernels' own buffers. (A
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
        # the RNN cells' kernels, registered while entered
        self._kernels = contextlib.ExitStack()

    def __enter__(self) -> GpuKernels:
        if self.rt is not None:
            plans = self.rt.kernel_plans
            plans[torch.ops.aten.embedding_dense_backward.default] = (
                self._embedding_backward_plan)
            plans[torch.ops.aten.convolution.default] = self._convolution_plan
            plans[torch.ops.aten.convolution_backward.default] = (
                self._convolution_backward_plan)
            plans[torch.ops.aten._ctc_loss.default] = ctc_loss.forward_plan
            plans[torch.ops.aten._ctc_loss_backward.default] = ctc_loss.backward_plan
        orig_dropout, orig_rms_norm = F.dropout, F.rms_norm
        self._orig_sdpa = F.scaled_dot_product_attention
        patch = self._patcher.patch
        patch(F, "scaled_dot_product_attention", self._sdpa)
        patch(F, "dropout", lambda *a, **k: self._dropout(orig_dropout, *a, **k))
        patch(F, "rms_norm", lambda *a, **k: self._rms_norm(orig_rms_norm, *a, **k))
        patch(rnn_modules, "_VF", _CountedRnns(rnn_modules._VF, self.count))
        self._kernels.enter_context(aten_kernels.registered((
            ("lstm_cell", functools.partial(lstm_cell, self), "CompositeImplicitAutograd"),
            ("gru_cell", functools.partial(gru_cell, self), "CompositeImplicitAutograd"),
            # torch has no Meta kernels of CUDA's fused GRU cell
            ("_thnn_fused_gru_cell", _fused_gru_cell_meta, "Meta"),
            ("_thnn_fused_gru_cell_backward", _fused_gru_cell_backward_meta, "Meta"))))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._patcher.restore()
        self._kernels.close()
        if self.rt is not None:
            for op in (torch.ops.aten.embedding_dense_backward.default,
                       torch.ops.aten.convolution.default,
                       torch.ops.aten.convolution_backward.default,
                       torch.ops.aten._ctc_loss.default,
                       torch.ops.aten._ctc_loss_backward.default):
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
        self.count("embedding_backward:" + ("sorted" if plan.before else "direct"), grad)
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
        self.count(f"cudnn_workspace:{direction}", x)
        name = "cuDNN workspace"
        return KernelPlan((), (KernelStep(ALLOC, name, nbytes), KernelStep(FREE, name)))

    def count(self, key: str, on: torch.Tensor) -> None:
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
        self.count("dropout:fused", input)
        return torch.native_dropout(input, p, True)[0]

    def _rms_norm(self, func: Callable[..., Any], input: torch.Tensor,
                  normalized_shape: Any, weight: torch.Tensor | None = None,
                  eps: float | None = None) -> torch.Tensor:
        if not on_meta(input) or not fused_rms_norm_applies(input, weight):
            return func(input, normalized_shape, weight, eps)
        self.count("rms_norm:fused", input)
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
        self.count(f"sdpa:{backend}", query)
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
