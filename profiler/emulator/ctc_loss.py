"""CTC loss on virtual GPUs, as torch runs it on a GPU.

``F.ctc_loss`` (``nn.CTCLoss``: OCR and speech recognition) is ``aten::ctc_loss``, a
composite (``aten/src/ATen/native/LossCTC.cpp``). Given its lengths as tensors, plain torch
reads them to the host and goes on with lists; under any dispatch mode, though,
``isTensorSubclassLike`` holds for every tensor and it takes the path for subclasses,
``_ctc_loss.Tensor``, which has no Meta kernel: a script training with CTC over meta
tensors stopped at its loss. Its backward, ``_ctc_loss_backward``, has none either.

:data:`KERNELS` gives, while an emulation runs, both overloads of ``ctc_loss``
the GPU's path (:func:`ctc_loss`: the lengths read to the host, the values the emulator
follows, then ``_ctc_loss`` with lists, whose Meta kernel sizes ``log_alpha`` by the
longest target, and the reduction as ``ctc_loss_impl`` makes it), and the backward a Meta
kernel (its gradient, like ``log_probs``). :func:`forward_plan` and :func:`backward_plan`
are the buffers CUDA's kernels (``aten/src/ATen/native/cuda/LossCTC.cu``) allocate
themselves: the lengths and each target's offset copied to the GPU (three ``[B]`` int64
tensors, forward and backward), ``log_beta`` (``log_alpha``'s size) for the backward, and
on a "large" problem (``2 T + 24 B / 10 + 2 C / 10 > 450``) the blanks' ``logsumexp``
and, with ``zero_infinity``, the gradient's second copy made by ``where``.

Not modelled: cuDNN's CTC, which torch picks instead where every input has its full length,
the targets are int32 on the host, the blank is 0 and ``log_probs`` float32
(``_use_cudnn_ctc_loss``); there the native kernel is counted (cuDNN keeps a ``log_probs``-
sized gradient from the forward to the backward instead of ``log_alpha``, and takes a
workspace of its own).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from dpprof.emulator.aten_kernels import Kernel
from dpprof.emulator.events import ALLOC, FREE, KernelPlan, KernelStep

__all__ = ["KERNELS", "backward_plan", "ctc_loss", "forward_plan"]

aten = torch.ops.aten

MEAN, SUM = 1, 2  # at::Reduction


def _host_list(lengths: torch.Tensor | Sequence[int]) -> list[int]:
    """The lengths as ints: a tensor read to the host as ``ctc_loss`` reads it (over meta,
    the values the emulator follows, else its stated stand-ins); the copy it reads them
    into is the host's, not the GPU's."""
    if isinstance(lengths, torch.Tensor):
        return [int(v) for v in lengths.reshape(-1).tolist()]
    return [int(v) for v in lengths]


def ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor,
             input_lengths: torch.Tensor | Sequence[int],
             target_lengths: torch.Tensor | Sequence[int], blank: int = 0,
             reduction: int = MEAN, zero_infinity: bool = False) -> torch.Tensor:
    """``aten::ctc_loss`` as a GPU runs it for plain tensors: ``ctc_loss_impl`` with the
    lengths as lists and torch's own kernel, ``_ctc_loss``."""
    il, tl = _host_list(input_lengths), _host_list(target_lengths)
    batched = log_probs.dim() == 3
    lp = log_probs if batched else log_probs.unsqueeze(1)
    res = aten._ctc_loss.default(lp, targets.to(lp.device, torch.long), il, tl, blank,
                                 zero_infinity)[0]
    if zero_infinity:  # C++'s order: the zero, the mask, the result, then the old result
        zero = torch.zeros((), dtype=res.dtype, device=res.device)
        infinite = res == math.inf
        res = torch.where(infinite, zero, res)
        del infinite, zero
    if reduction == MEAN:
        clamped = torch.tensor(tl, dtype=res.dtype, device=res.device).clamp_min(1)
        return (res / clamped).mean()
    if reduction == SUM:
        return res.sum()
    return res if batched else res.squeeze(0)


def _backward_meta(grad: torch.Tensor, log_probs: torch.Tensor, targets: torch.Tensor,
                   input_lengths: Sequence[int], target_lengths: Sequence[int],
                   neg_log_likelihood: torch.Tensor, log_alpha: torch.Tensor, blank: int,
                   zero_infinity: bool = False) -> torch.Tensor:
    """``_ctc_loss_backward``'s gradient: ``full_like(log_probs)``, contiguous."""
    return torch.empty(log_probs.shape, dtype=log_probs.dtype, device=log_probs.device)


# both overloads of ctc_loss the GPU's path, the backward a Meta kernel (registered while an
# emulation runs: dpprof.emulator.aten_kernels)
KERNELS: tuple[Kernel, ...] = (
    ("ctc_loss.IntList", ctc_loss, "CompositeImplicitAutograd"),
    ("ctc_loss.Tensor", ctc_loss, "CompositeImplicitAutograd"),
    ("_ctc_loss_backward", _backward_meta, "Meta"),
)


def _lengths_on_gpu(batch: int) -> tuple[KernelStep, ...]:
    """The kernel's ``at::tensor(target_lengths)``, ``at::tensor(input_lengths)`` and
    ``tg_batch_offsets.cuda()``: ``[B]`` int64 each."""
    return tuple(KernelStep(ALLOC, name, 8 * batch)
                 for name in ("target lengths", "input lengths", "target offsets"))


# the three freed as the kernel returns, in the order C++ destroys its locals
_LENGTHS_FREED = tuple(KernelStep(FREE, name)
                       for name in ("input lengths", "target lengths", "target offsets"))


def forward_plan(args: Any, kwargs: dict[str, Any]) -> KernelPlan:
    """``ctc_loss_gpu_template``'s own buffers around ``neg_log_likelihood`` and
    ``log_alpha``."""
    return KernelPlan(_lengths_on_gpu(int(args[0].shape[1])), _LENGTHS_FREED)


def backward_plan(args: Any, kwargs: dict[str, Any]) -> KernelPlan:
    """``ctc_loss_backward_gpu_template``'s own buffers around the gradient."""
    log_probs, log_alpha = args[1], args[6]
    zero_infinity = bool(args[8] if len(args) > 8 else kwargs.get("zero_infinity", False))
    steps, batch, labels = int(log_probs.shape[0]), int(log_probs.shape[1]), \
        int(log_probs.shape[2])
    size = log_probs.element_size()
    before = (*_lengths_on_gpu(batch),
              KernelStep(ALLOC, "log_beta", log_alpha.numel() * log_alpha.element_size()))
    after: tuple[KernelStep, ...] = ()
    if 2 * steps + (24 * batch) // 10 + (2 * labels) // 10 > 450:  # the kernel's is_large
        # the blanks' logsumexp over log_alpha + log_beta at even positions ([B, T, S+1]),
        # as at::logsumexp computes it (amax, a mask of its infinities, the shifted exp)
        pairs = batch * int(log_alpha.shape[1]) * (int(log_alpha.shape[2]) // 2 + 1) * size
        row = batch * int(log_alpha.shape[1])
        after = (KernelStep(ALLOC, "alpha+beta", pairs), KernelStep(ALLOC, "maxes", row * size),
                 KernelStep(ALLOC, "abs", row * size), KernelStep(ALLOC, "infinite", row),
                 KernelStep(FREE, "infinite"), KernelStep(FREE, "abs"),
                 KernelStep(ALLOC, "shifted", pairs), KernelStep(ALLOC, "sum", row * size),
                 KernelStep(FREE, "shifted"), KernelStep(FREE, "maxes"),
                 KernelStep(FREE, "sum"), KernelStep(FREE, "alpha+beta"))
        if zero_infinity:  # grad = at::where(nll == inf, zeros({}), grad): a second copy
            after += (KernelStep(ALLOC, "nll infinite", batch), KernelStep(ALLOC, "zero", size),
                      KernelStep(ALLOC, "gradient (where)", steps * batch * labels * size),
                      KernelStep(FREE, "zero"), KernelStep(FREE, "nll infinite"),
                      KernelStep(FREE, "gradient (where)"))
    return KernelPlan(before, (*after, KernelStep(FREE, "log_beta"), *_LENGTHS_FREED))
