"""``torch.cuda``'s NVML readings on virtual GPUs (:func:`install`).

A CUDA build answers ``torch.cuda.utilization()``, ``temperature()``, ``power_draw()``,
``clock_rate()``, ``memory_usage()``, ``device_memory_used()`` and ``list_gpu_processes()``
from NVML (``torch/cuda/__init__.py``, ``torch/cuda/memory.py``); a CPU build has no NVML
and raises, which stopped a script that logs them. Here the memory readings are the
emulation's own: what NVML would count as used is the caching allocator's reserve at that
moment (simulated) plus the CUDA context and the libraries' memory as dpprof models them
for one process. The others measure activity a virtual GPU does not have (nothing runs):
each answers 0, a stand-in, and every such reading is counted with the line that asked
(:class:`Readings`) for the report's note."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dpprof.emulator.call_sites import caller_site, relative_site
from dpprof.emulator.context import ContextModel, context_overhead
from dpprof.emulator.emulated_cuda import EmulatedCuda
from dpprof.emulator.patcher import Patch

__all__ = ["ACTIVITY_READINGS", "Readings", "beside_tensors_bytes", "install", "outside_bytes",
           "used_bytes"]

# torch.cuda's readings of what the GPU is doing (percent, degrees C, milliwatts, MHz):
# stand-ins on a virtual GPU
ACTIVITY_READINGS = ("utilization", "memory_usage", "temperature", "power_draw", "clock_rate")


@dataclass
class Readings:
    """The activity readings answered with a stand-in, counted by call site
    (``"train.py:40 (utilization)"``)."""

    sites: dict[str, int] = field(default_factory=dict)

    def add(self, name: str) -> None:
        key = f"{relative_site(caller_site())} ({name})"
        self.sites[key] = self.sites.get(key, 0) + 1

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def note(self) -> str | None:
        """The report's words on them (None: none was read)."""
        if not self.sites:
            return None
        where = "; ".join(f"{s} x{c}" for s, c in list(self.sites.items())[:3])
        return (f"{self.total} reading(s) of GPU activity (torch.cuda's utilization, "
                "memory_usage, temperature, power_draw or clock_rate) answered 0: a virtual "
                f"GPU runs nothing to read: {where}")


@functools.cache
def _context(compute_capability: tuple[int, int], uses_cudnn: bool) -> ContextModel:
    return context_overhead(compute_capability, uses_cudnn=uses_cudnn)


def outside_bytes(vc: EmulatedCuda, device: int) -> int:
    """What a process holds on runtime ``device`` beside the caching allocator's reserve, as
    modelled now: the CUDA context, the libraries (cuDNN's once a convolution ran) and
    NCCL's communicators."""
    ctx = _context(vc.spec.compute_capability, vc.rt.saw_convolution)
    return ctx.outside_allocator_bytes + vc.nccl_bytes_on(device)


def beside_tensors_bytes(vc: EmulatedCuda, device: int) -> int:
    """What runtime ``device`` holds beside a process's tensors, as modelled now:
    :func:`outside_bytes` and the cuBLAS workspaces the caching allocator serves."""
    ctx = _context(vc.spec.compute_capability, vc.rt.saw_convolution)
    return outside_bytes(vc, device) + ctx.workspace_reserved_bytes


def used_bytes(vc: EmulatedCuda, device: Any = None) -> int:
    """What NVML would count as used on ``device`` now: the caching allocator's reserve
    (simulated over the allocations so far) and :func:`outside_bytes`."""
    return vc.memory.memory_reserved(device) + outside_bytes(vc, vc.index_of(device))


def install(vc: EmulatedCuda, p: Patch, readings: Readings) -> None:
    """Patch ``torch.cuda``'s NVML readings (and ``torch.cuda.memory``'s bindings of them)
    to answer for ``vc``'s devices."""
    import torch.cuda.memory as cuda_memory

    def stand_in(name: str) -> Callable[..., int]:
        def reading(device: Any = None) -> int:
            vc.index_of(device)  # an unknown device raises as torch would
            readings.add(name)
            return 0
        reading.__name__ = name
        return reading

    def device_memory_used(device: Any = None) -> int:
        return used_bytes(vc, device)

    def list_gpu_processes(device: Any = None) -> str:
        # torch's own format (torch/cuda/memory.py): this process and its memory
        index = vc.index_of(device)
        mib = used_bytes(vc, device) / (1024 * 1024)
        return "\n".join([f"GPU:{index}",
                          f"process {os.getpid():>10d} uses {mib:>12.3f} MB GPU memory"])

    for owner in (torch.cuda, cuda_memory):
        for name in ACTIVITY_READINGS:
            if hasattr(owner, name):
                p(owner, name, stand_in(name))
        for name, func in (("device_memory_used", device_memory_used),
                           ("list_gpu_processes", list_gpu_processes)):
            if hasattr(owner, name):
                p(owner, name, func)
