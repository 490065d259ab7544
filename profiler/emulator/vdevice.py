"""The virtual-device runtime: GPUs that exist only as byte counters.

:class:`VirtualDevices` is the counting core (:class:`dpprof.emulator.counting.CountingDevices`:
placement, weakly referenced storages, events) with its layers: DataParallel replicas
mirrored (:mod:`dpprof.emulator.mirroring`), the op memo over meta tensors
(:mod:`dpprof.emulator.op_memo`) and the ledgers of variants
(:mod:`dpprof.emulator.ledgers`). Crossing devices is explicit: :func:`to_device` is an
autograd function whose forward copies to the target device and whose backward copies the
gradient back.
"""

from __future__ import annotations

from typing import Any

import torch

from dpprof.emulator.counting import HOST
from dpprof.emulator.ledgers import LedgeredDevices
from dpprof.emulator.mirroring import MirroredDevices
from dpprof.emulator.op_memo import MemoisedDevices


class VirtualDevices(MirroredDevices, LedgeredDevices, MemoisedDevices):
    """Count live bytes per virtual device for everything run under it, with mirrors,
    ledgers and the op memo.

    ``base`` is the real device the tensors live on: ``"meta"`` (memory only) or ``"cpu"``.
    """

    # The layers' hooks fused: one call per event rather than a chain of super() calls
    # (every storage's allocation and free asks), in the order mirrors, then ledgers.

    def _follows_events(self) -> bool:
        return bool(self._mirror_serials or self._mirrors or self.ledgers)

    def _follow(self, device: int, serial: int, requested: int, allocated: int) -> None:
        if self._mirror_serials or self._mirrors:
            self._emit_mirrors(device, serial, requested, allocated)
        if self.ledgers:
            ledger = self.ledgers.get(device)
            if ledger is not None:
                ledger.on_event(serial, requested, allocated)


# ---- crossings ---------------------------------------------------------------------------


class _ToDevice(torch.autograd.Function):
    """``tensor.to(cuda:k)``: forward copies to ``k``, backward copies the gradient back."""

    @staticmethod
    def forward(ctx: Any, rt: VirtualDevices, t: torch.Tensor, index: int) -> torch.Tensor:
        ctx.rt = rt
        ctx.source = rt.device_of(t)
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
    if rt.device_of(t) == index:
        return t
    if t.requires_grad:
        return _ToDevice.apply(rt, t, index)
    return copy_to(rt, t, index)
