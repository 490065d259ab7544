"""What the emulated ``torch.cuda`` is to the code that plays its API (:mod:`dpprof.
emulator.cuda_api`, :mod:`dpprof.emulator.tensor_api`): the :class:`EmulatedCuda` protocol,
which :class:`dpprof.emulator.virtual_cuda.VirtualCuda` meets, and the one active now
(:func:`active`). The API's modules depend on this, not on the class that installs them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch

from dpprof.emulator.catalog import GpuSpec
from dpprof.emulator.cuda_devices import CudaDevices
from dpprof.emulator.cuda_memory import CudaMemory

__all__ = ["EmulatedCuda", "activate", "active", "deactivate"]


class EmulatedCuda(Protocol):
    """``torch.cuda`` played by virtual GPUs, as its API's patches call it."""

    rt: CudaDevices  # the dispatch mode that counts the virtual GPUs' bytes
    spec: GpuSpec  # the GPU each virtual one is
    streams: Any  # dpprof.emulator.cuda_api.CurrentStreams: each thread's current streams
    memory: CudaMemory  # torch.cuda's memory functions
    graphs: Any  # dpprof.emulator.cuda_graphs.Captures: the CUDA graphs' pools and captures
    readings: Any  # dpprof.emulator.device_readings.Readings: NVML readings stood in for
    profiled: Any  # dpprof.emulator.profilers.Profiled: GPU profiling left out
    nccl_bytes_on: Callable[[int], int]  # NCCL's memory on a runtime device now
    active: bool  # entered, not yet left
    # what ends a thread the program started without a traceback (the caller's stop)
    quiet_thread_ends: tuple[type[BaseException], ...]

    def device_count(self) -> int: ...
    def initialise(self) -> None: ...
    def is_initialised(self) -> bool: ...
    def current_device(self) -> int: ...
    def index_of(self, device: Any) -> int: ...
    def logical(self, index: int) -> int: ...
    def set_device(self, device: Any) -> None: ...
    def device(self, device: Any) -> contextlib.AbstractContextManager[None]: ...
    def properties(self, device: Any = None) -> Any: ...
    def copy(self, t: torch.Tensor, index: int, dtype: torch.dtype | None,
             real: torch.device | None = None) -> torch.Tensor: ...
    def to_index(self, t: torch.Tensor, index: int, dtype: torch.dtype | None = None,
                 copy: bool = False, memory_format: Any = None) -> torch.Tensor: ...
    def target_of(self, device: Any) -> int | None: ...
    def tensor_to(self, t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor: ...
    def load(self, orig_load: Callable[..., Any], f: Any, map_location: Any, *args: Any,
             **kwargs: Any) -> Any: ...
    def rng_state_stand_in(self) -> torch.Tensor: ...
    def virtual_device(self, t: torch.Tensor) -> torch.device: ...
    def enter_thread(self) -> None: ...
    def leave_thread(self) -> None: ...


_ACTIVE: EmulatedCuda | None = None


def active() -> EmulatedCuda | None:
    """The active emulated CUDA (a :class:`dpprof.emulator.virtual_cuda.VirtualCuda`), if
    any."""
    return _ACTIVE


def activate(cuda: EmulatedCuda) -> None:
    """``cuda`` is the active emulated CUDA from now on; one at a time."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("a VirtualCuda is already active")
    _ACTIVE = cuda


def deactivate() -> None:
    global _ACTIVE
    _ACTIVE = None
