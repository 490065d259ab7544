"""A machine with "GPUs" made of CPU tensors, for running the cuda backend's code without a GPU.

:class:`CpuHost` implements :class:`dpprof.backends.cuda_host.CudaHost` (the interface through which
the cuda backend asks the machine how many GPUs it sees, for the operations over the chosen
ones and for the ``ddp`` ranks' process group): it claims ``gpus`` devices, runs every
scenario on CPU tensors (:class:`CpuOps`: no allocator statistics, wall-clock timing) and
lets the ranks talk over gloo. Like ``fake_nvml.py`` it lives here, not in the package.

In this process, install it with :func:`install` (a ``monkeypatch``); in child processes
(``dpprof`` started by a test, its spawned DDP ranks, torchrun's workers) through
``tests/fakehost/sitecustomize.py``, with the environment :func:`fakehost_env` returns.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dpprof.backends import cuda_host
from dpprof.backends.cuda_host import CudaHost, DeviceOps

if TYPE_CHECKING:
    import pytest

FAKEHOST = Path(__file__).with_name("fakehost")  # the folder of the sitecustomize seam
ENV = "DPPROF_FAKEHOST"  # what it installs: "gpus=N", "nvml=NAME" (watch_fakes.NAME())


class CpuOps(DeviceOps):
    """CPU tensors behind every logical device: the same code paths as the CUDA ops, no
    allocator statistics (None), wall-clock timing only."""

    kind = "cpu"

    def device(self, logical: int) -> torch.device:
        return torch.device("cpu")

    def set_device(self, logical: int) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def reset_peaks(self, logical: int) -> None:
        pass

    def max_allocated(self, logical: int) -> int | None:
        return None

    def max_reserved(self, logical: int) -> int | None:
        return None

    def allocated(self, logical: int) -> int | None:
        return None

    def capacity(self, logical: int) -> int | None:
        return None

    def release(self) -> None:
        gc.collect()

    def start_timer(self) -> Callable[[], float | None]:
        return lambda: None


class AllocatorStats:
    """The caching allocator's counters for each device, process-wide as torch keeps them:
    ``max_memory_allocated`` is the peak since the program started or since the last
    ``reset_peak_memory_stats``; ``empty_cache`` does not reset it (c10/cuda/
    CUDACachingAllocator.cpp: only resetPeakStats sets peak = current)."""

    def __init__(self) -> None:
        self.current: dict[int, int] = {}
        self.peak: dict[int, int] = {}

    def touch(self, device: int, nbytes: int) -> None:
        """Allocate ``nbytes`` on ``device`` and free them again (a temporary)."""
        now = self.current.get(device, 0)
        self.peak[device] = max(self.peak.get(device, 0), now + nbytes)


class AllocatorOps(CpuOps):
    """:class:`CpuOps` with allocator statistics that behave like torch's (shared by every
    scenario of the process; the workload calls :meth:`AllocatorStats.touch`)."""

    def __init__(self, devices: Sequence[int], stats: AllocatorStats) -> None:
        super().__init__(devices)
        self.stats = stats

    def reset_peaks(self, logical: int) -> None:
        d = self.devices[logical]
        self.stats.peak[d] = self.stats.current.get(d, 0)

    def max_allocated(self, logical: int) -> int | None:
        return self.stats.peak.get(self.devices[logical], 0)

    def max_reserved(self, logical: int) -> int | None:
        return self.max_allocated(logical)

    def allocated(self, logical: int) -> int | None:
        return self.stats.current.get(self.devices[logical], 0)


class CpuHost(CudaHost):
    """``gpus`` GPUs of CPU tensors; the ``ddp`` ranks over gloo on the CPU."""

    ddp_backend = "gloo"
    ddp_device = "cpu"

    def __init__(
        self, gpus: int, ops: Callable[[Sequence[int]], DeviceOps] = CpuOps
    ) -> None:
        self.gpus = gpus
        self.make_ops = ops

    def visible_gpus(self) -> int:
        return self.gpus

    def ops(self, devices: Sequence[int]) -> DeviceOps:
        return self.make_ops(devices)

    def uuids(self) -> list[str] | None:
        """The installed NVML's first ``gpus`` GPUs, as the runtime spells them (no prefix);
        None without NVML (a real runtime would still know them, this stand-in does not)."""
        from dpprof.nvml import libnvml

        nvml = libnvml.default_nvml()
        if not nvml.available or nvml.device_count() < self.gpus:
            return None
        found = [nvml.uuid(i) for i in range(self.gpus)]
        return [u[4:] for u in found if u] if all(found) else None

    def properties(self, index: int) -> tuple[str, int, tuple[int, int]] | None:
        return None


def install(
    monkeypatch: pytest.MonkeyPatch,
    gpus: int,
    ops: Callable[[Sequence[int]], DeviceOps] = CpuOps,
    children: bool = True,
) -> CpuHost:
    """Install a :class:`CpuHost` in this process and, with ``children``, in every process
    started from it (the environment of :func:`fakehost_env`; CPU ops only there)."""
    fake = CpuHost(gpus, ops)
    monkeypatch.setattr(cuda_host, "HOST", fake)
    if children:
        for k, v in fakehost_env(gpus=gpus).items():
            monkeypatch.setenv(k, v)
    return fake


def fakehost_env(
    gpus: int | None = None, nvml: str | None = None, base: dict[str, str] | None = None
) -> dict[str, str]:
    """``base`` (default: this process's environment) with the sitecustomize seam on
    ``PYTHONPATH``: ``gpus`` CPU GPUs (:class:`CpuHost`) and/or the NVML fake
    ``watch_fakes.<nvml>()`` in every Python process started with it."""
    env = dict(os.environ if base is None else base)
    parts = [f"gpus={gpus}"] if gpus is not None else []
    parts += [f"nvml={nvml}"] if nvml is not None else []
    env[ENV] = ",".join(parts)
    paths = [str(FAKEHOST)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env
