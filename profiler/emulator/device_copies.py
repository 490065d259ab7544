"""Copies between virtual devices, explicit as on GPUs: :func:`to_device` is an autograd
function whose forward copies to the target device and whose backward copies the gradient
back."""

from __future__ import annotations

from typing import Any

import torch

from dpprof.emulator.dispatch_state import HOST
from dpprof.emulator.virtual_devices import VirtualDevices


class _ToDevice(torch.autograd.Function):
    """``tensor.to(cuda:k)``: forward copies to ``k``, backward copies the gradient back."""

    @staticmethod
    def forward(ctx: Any, rt: VirtualDevices, t: torch.Tensor, index: int) -> torch.Tensor:
        ctx.rt = rt
        ctx.source = rt.storages.device_of(t)
        return copy_to(rt, t, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor | None, None]:
        if not ctx.needs_input_grad[1]:
            return None, None, None
        return None, copy_to(ctx.rt, grad, ctx.source), None


# a tensor's device as torch answers it (an emulation patches the property)
_real_device = torch._C.TensorBase.__dict__["device"].__get__


def copy_to(rt: VirtualDevices, t: torch.Tensor, index: int) -> torch.Tensor:
    """A new tensor on ``index`` with ``t``'s contents (``_to_copy``, preserve format). A
    real host tensor beside meta GPUs (a real host) is copied onto the base: a virtual GPU's
    bytes are the base's."""
    with rt.placing_on(index):
        if index != HOST and _real_device(t) != rt.base:
            return torch.ops.aten._to_copy.default(t, device=rt.base)
        return t.clone(memory_format=torch.preserve_format)


def to_device(rt: VirtualDevices, t: torch.Tensor, index: int) -> torch.Tensor:
    """The emulated ``t.to(f"cuda:{index}")``: no copy when already there (as torch)."""
    if rt.storages.device_of(t) == index:
        return t
    if t.requires_grad:
        return _ToDevice.apply(rt, t, index)
    return copy_to(rt, t, index)
