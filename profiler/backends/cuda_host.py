"""The device seam of the cuda backend: everything it asks of the machine.

- :class:`DeviceOps`: the operations over the chosen devices (peaks, synchronise, timing,
  giving memory back); :class:`CudaOps` implements them over ``torch.cuda``;
- :class:`CudaHost`: the GPUs this process sees, the :class:`DeviceOps` over the chosen
  ones, and how the ``ddp`` ranks talk; the process-wide instance is :data:`HOST`, read
  through :func:`host`.

The tests run the backend without a GPU by installing a CPU implementation of this
interface as :data:`HOST` (``tests/fakehost``); nothing here knows about it.
"""

from __future__ import annotations

import contextlib
import gc
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from dpprof.nvml.devices import torch_cuda_uuids

__all__ = ["HOST", "CudaHost", "CudaOps", "DeviceOps", "host"]


class DeviceOps(ABC):
    """What the measuring code asks of the devices of a run. Logical indices: positions in
    the run's list; ``devices[logical]`` is the physical index.

    ``kind`` is the torch device type the scenarios run on: with ``"cuda"``, DataParallel and
    DDP get explicit ``device_ids`` and the results carry CUDA indices and NVML readings.
    """

    kind = "cuda"

    def __init__(self, devices: Sequence[int]) -> None:
        self.devices = list(devices)  # physical index per logical index

    @abstractmethod
    def device(self, logical: int) -> torch.device: ...

    @abstractmethod
    def set_device(self, logical: int) -> None:
        """Make ``logical`` the current device (``torch.cuda.set_device``)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for every queued kernel on every device of the run."""

    @abstractmethod
    def reset_peaks(self, logical: int) -> None: ...

    @abstractmethod
    def max_allocated(self, logical: int) -> int | None: ...

    @abstractmethod
    def max_reserved(self, logical: int) -> int | None: ...

    @abstractmethod
    def allocated(self, logical: int) -> int | None: ...

    @abstractmethod
    def capacity(self, logical: int) -> int | None: ...

    @abstractmethod
    def release(self) -> None:
        """Give cached memory back (after an OOM)."""

    @abstractmethod
    def start_timer(self) -> Callable[[], float | None]:
        """Start timing on the first device's stream; the returned call gives seconds."""

    def probe(self, logical: int) -> dict[str, int]:
        """What ``dpprof check`` measures of the allocator beside a workload: the bytes one
        cuBLAS workspace holds (``cublas_workspace_bytes``) and the reserved bytes after it
        (``reserved_bytes``); empty where the devices keep no allocator statistics."""
        return {}


class CudaOps(DeviceOps):
    """``torch.cuda`` for the chosen CUDA indices (``devices[logical]`` is a CUDA index)."""

    kind = "cuda"

    def device(self, logical: int) -> torch.device:
        return torch.device("cuda", self.devices[logical])

    def set_device(self, logical: int) -> None:
        torch.cuda.set_device(self.devices[logical])

    def synchronize(self) -> None:
        for d in self.devices:
            torch.cuda.synchronize(d)

    def reset_peaks(self, logical: int) -> None:
        torch.cuda.reset_peak_memory_stats(self.devices[logical])

    def max_allocated(self, logical: int) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.devices[logical]))

    def max_reserved(self, logical: int) -> int | None:
        return int(torch.cuda.max_memory_reserved(self.devices[logical]))

    def allocated(self, logical: int) -> int | None:
        return int(torch.cuda.memory_allocated(self.devices[logical]))

    def capacity(self, logical: int) -> int | None:
        return int(torch.cuda.get_device_properties(self.devices[logical]).total_memory)

    def release(self) -> None:
        gc.collect()
        with contextlib.suppress(Exception):  # a broken context after a fault
            # cuBLAS workspaces are live allocator blocks, one per (handle, stream): DataParallel's
            # worker threads leave some behind; they are made again on demand
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
            for d in self.devices:
                with torch.cuda.device(d):
                    torch.cuda.empty_cache()
                # the next reader of max_memory_allocated starts from what is left
                torch.cuda.reset_peak_memory_stats(d)

    def probe(self, logical: int) -> dict[str, int]:
        d = self.devices[logical]
        torch.cuda.synchronize(d)
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(d)
        with torch.cuda.device(d):
            side = torch.cuda.Stream(d)  # a new (handle, stream) pair: one new workspace
            with torch.cuda.stream(side):
                a = torch.ones(64, 64, device=d)
                b = a @ a
            torch.cuda.synchronize(d)
            del a, b
        return {"cublas_workspace_bytes": int(torch.cuda.memory_allocated(d) - before),
                "reserved_bytes": int(torch.cuda.memory_reserved(d))}

    def start_timer(self) -> Callable[[], float | None]:
        dev = self.devices[0]
        with torch.cuda.device(dev):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()

        def stop() -> float | None:
            with torch.cuda.device(dev):
                end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1000.0

        return stop


class CudaHost:
    """What the cuda backend asks of the machine: how many GPUs it sees, the operations over
    the chosen ones, and how the ``ddp`` ranks talk (``torch.distributed`` backend and device
    type, as :class:`dpprof.backends.ranks.Group` takes them)."""

    ddp_backend = "nccl"
    ddp_device = "cuda"

    def visible_gpus(self) -> int:
        """The CUDA GPUs this process sees (0 when CUDA is unusable)."""
        try:
            return torch.cuda.device_count() if torch.cuda.is_available() else 0
        except Exception:  # a broken driver counts as none
            return 0

    def ops(self, devices: Sequence[int]) -> DeviceOps:
        """The device operations over ``devices`` (CUDA indices)."""
        return CudaOps(devices)

    def uuids(self) -> list[str] | None:
        """The UUID of each CUDA device, as the runtime reports it (None: unknown)."""
        return torch_cuda_uuids()

    def properties(self, index: int) -> tuple[str, int, tuple[int, int]] | None:
        """Name, memory and compute capability of CUDA device ``index`` (None: unknown)."""
        try:
            p = torch.cuda.get_device_properties(index)
        except Exception:
            return None
        return str(p.name), int(p.total_memory), (int(p.major), int(p.minor))


#: The machine the cuda backend runs on (the tests replace it with a CPU implementation).
HOST: CudaHost = CudaHost()


def host() -> CudaHost:
    """The installed :class:`CudaHost` (read at call time, so a replacement is seen)."""
    return HOST
