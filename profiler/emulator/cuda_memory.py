"""``torch.cuda``'s memory functions answered for virtual GPUs (:class:`CudaMemory`):
allocated bytes from the runtime's ledger of storages, reserved bytes from the caching
allocator simulated over a device's allocations so far, each with the cuBLAS workspaces the
process's handles took from the allocator so far (as a GPU's readings count them: 32 MiB at
a thread's first matmul on Hopper), and the most each call told the program
(:class:`MemoryAnswered`: the reported peak must be at least that)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dpprof.emulator import allocator_stats
from dpprof.emulator.allocator_config import (
    AllocatorConfig,
    allocator_setting,
    config_from_setting,
)
from dpprof.emulator.allocator_replay import simulate
from dpprof.emulator.call_sites import caller_site, relative_site
from dpprof.emulator.context import ContextModel, device_context
from dpprof.emulator.cuda_devices import CudaDevices
from dpprof.emulator.events import EMPTY_CACHE
from dpprof.emulator.reserved import workspace_inserts

# c10's forceUncachedAllocator: each allocation a cudaMalloc of its own, no statistics
NO_CACHING = "PYTORCH_NO_CUDA_MEMORY_CACHING"


@dataclass
class MemoryAnswered:
    """The most ``torch.cuda``'s memory functions told the program of one device, and which
    call told it (``"torch.cuda.max_memory_allocated() at train.py:30"``)."""

    allocated_bytes: int = 0  # memory_allocated, max_memory_allocated, memory_stats
    allocated_by: str = ""
    reserved_bytes: int = 0  # memory_reserved, max_memory_reserved, memory_stats, and
    reserved_by: str = ""  # the capacity less mem_get_info's free bytes


class CudaMemory:
    """``torch.cuda.memory_allocated`` and its kin for the devices of ``rt``, each ``device``
    argument resolved to a virtual device by ``index_of`` (None: the current one)."""

    def __init__(self, rt: CudaDevices, capacity_bytes: int,
                 index_of: Callable[[Any], int],
                 compute_capability: tuple[int, int] | None = None) -> None:
        self.rt = rt
        self.capacity_bytes = capacity_bytes
        self._dev = index_of
        # the GPU's, for its cuBLAS workspaces' size (None: none counted)
        self._workspace_model: ContextModel | None = (
            None if compute_capability is None
            else device_context(compute_capability, uses_cudnn=False))
        # the event spans of processes that ended (a spawned rank's function that returned):
        # the workspaces their handles took went with them
        self.ended_processes: list[tuple[int, int]] = []
        self._peak_from = [0] * rt.num_devices  # event index of each device's last reset
        self._accumulated_from = [0] * rt.num_devices  # ... of reset_accumulated_memory_stats
        # runtime index -> the most torch.cuda's memory functions told the program of it
        self.answered: dict[int, MemoryAnswered] = {}
        self._config: AllocatorConfig | None = None
        # the variable and value it was read from (None: unset, torch's defaults)
        self.setting: tuple[str, str] | None = None
        # runtime index -> (fraction, the call that set it): set_per_process_memory_fraction
        self.fractions: dict[int, tuple[float, str]] = {}
        # caching_allocator_alloc's blocks by the address handed out, each a storage counted
        # on its device as any tensor's
        self._raw: dict[int, torch.Tensor] = {}
        # what switched the caching allocator off, in order
        self.uncached_by: dict[str, None] = {}
        # where the program changed the allocator's settings after it allocated (None: not)
        self.settings_late: str | None = None

    def allocator_config(self) -> AllocatorConfig:
        """The caching allocator's configuration, as the program's environment sets it
        (``PYTORCH_ALLOC_CONF``) when first asked: torch reads it once, at the first
        allocation; the simulations read it here, the run asks before its end."""
        if self._config is None:
            if os.environ.get(NO_CACHING) == "1":  # c10's check_env: "1" only
                self.uncached_by.setdefault(f"{NO_CACHING}=1 in the script's environment")
            self.setting = allocator_setting(dict(os.environ))
            self._config = config_from_setting(self.setting[1] if self.setting else None)[0]
        return self._config

    def set_allocator_settings(self, env: str) -> None:
        """``torch._C._accelerator_setAllocatorSettings`` (``torch.cuda.memory.
        _set_allocator_settings``): the settings as a program sets them at run time, in
        place of its environment's. The simulations take one configuration for the whole
        run: set after the first allocation, it is noted (:attr:`settings_late`)."""
        self.allocator_config()
        if len(self.rt.storages.events):
            self.settings_late = caller_site()
        self.setting = (f"the allocator settings set at {relative_site(caller_site())}",
                        str(env))
        self._config = config_from_setting(str(env))[0]

    def get_allocator_settings(self) -> str:
        self.allocator_config()
        return self.setting[1] if self.setting else ""

    def _told(self, i: int, allocated: int = 0, reserved: int = 0, what: str = "") -> None:
        """Note what the program was told of device ``i`` (the reported peak must be at
        least that: dpprof.script checks it)."""
        told = self.answered.setdefault(i, MemoryAnswered())
        if allocated > told.allocated_bytes:
            told.allocated_bytes, told.allocated_by = allocated, f"{what} at {caller_site()}"
        if reserved > told.reserved_bytes:
            told.reserved_bytes, told.reserved_by = reserved, f"{what} at {caller_site()}"

    def memory_allocated(self, device: Any = None) -> int:
        i = self._dev(device)
        live = self.rt.storages.live_bytes(i) + self._workspace_bytes(i)
        self._told(i, allocated=live, what="torch.cuda.memory_allocated()")
        return live

    def max_memory_allocated(self, device: Any = None) -> int:
        i = self._dev(device)
        placed = sorted((at, size) for at, _, size, _ in self.workspaces(i))
        peak, held, n = 0, 0, 0
        for k, b in self.rt.storages.timeline(i, self._peak_from[i]):  # in event order
            while n < len(placed) and placed[n][0] <= k:
                held += placed[n][1]
                n += 1
            peak = max(peak, b + held)
        self._told(i, allocated=peak, what="torch.cuda.max_memory_allocated()")
        return peak

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache``: every device's cached segments go back (in the
        simulations of reserved memory, at this point of the allocations)."""
        log = self.rt.storages.events
        log.marks.append((len(log), EMPTY_CACHE))

    def workspaces(self, i: int) -> list[tuple[int, int, int, int]]:
        """Device ``i``'s cuBLAS workspaces this process took so far, as
        :func:`dpprof.emulator.reserved.workspace_inserts` places them (each handle's at its
        first cuBLAS op), less those of processes that ended."""
        if self._workspace_model is None:
            return []
        return [w for w in workspace_inserts(self._workspace_model, i, self.rt.blas_first,
                                             self.rt.blas_side, used_only=True)
                if not any(start <= w[0] <= end for start, end in self.ended_processes)]

    def process_ended(self, start: int) -> None:
        """A process the run plays in this one ended (a spawned rank's function returned):
        the handles it took from the event ``start`` on went with it."""
        self.ended_processes.append((start, len(self.rt.storages.events)))

    def _workspace_bytes(self, i: int) -> int:
        return sum(size for _, _, size, _ in self.workspaces(i))

    def events_of(self, i: int, accumulated: bool = False) -> list[tuple[Any, ...]]:
        """Device ``i``'s allocations and frees so far as the simulations replay them, with
        the allocator's own steps between them (the log's marks: the cache emptied, a
        graph's pool released), its cuBLAS workspaces where their handles took them, where
        the peaks were reset (and, ``accumulated``, where the accumulated statistics
        were)."""
        events: list[tuple[Any, ...]] = []
        log = self.rt.storages.events
        marks = iter(log.marks)
        mark = next(marks, None)
        workspaces = iter(sorted(self.workspaces(i)))
        workspace = next(workspaces, None)
        for k in range(len(log) + 1):  # a mark may follow the last event
            while mark is not None and mark[0] <= k:
                events.append(mark[1])
                mark = next(marks, None)
            while workspace is not None and workspace[0] <= k:
                _, block, size, key = workspace
                events.append(("alloc", block, size, key) if key else ("alloc", block, size))
                workspace = next(workspaces, None)
            if k == self._peak_from[i]:
                events.append(("reset_peak", -1, 0))
            if accumulated and k == self._accumulated_from[i]:
                events.append(("reset_accumulated", -1, 0))
            if k == len(log):
                break
            ev = log[k]
            if ev.device == i and ev.requested != 0:
                events.append(("alloc", ev.serial, ev.requested, log.stream_of(k))
                              if ev.requested > 0 else ("free", ev.serial, 0))
        return events

    def _reserved(self, i: int) -> tuple[int, int]:
        """(current, peak since the last reset) reserved bytes: the caching allocator
        simulated over the device's allocations so far."""
        stats = simulate(self.events_of(i), timeline_points=None, stop_on_oom=False,
                         config=self.allocator_config())
        return stats.final_reserved_bytes, stats.peak_reserved_bytes

    def memory_reserved(self, device: Any = None) -> int:
        i = self._dev(device)
        reserved = self._reserved(i)[0]
        self._told(i, reserved=reserved, what="torch.cuda.memory_reserved()")
        return reserved

    def max_memory_reserved(self, device: Any = None) -> int:
        i = self._dev(device)
        peak = self._reserved(i)[1]
        self._told(i, reserved=peak, what="torch.cuda.max_memory_reserved()")
        return peak

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self._peak_from[self._dev(device)] = len(self.rt.storages.events)

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        i = self._dev(device)
        reserved = self._reserved(i)[0]
        self._told(i, reserved=reserved, what="torch.cuda.mem_get_info()")
        return (max(self.capacity_bytes - reserved, 0), self.capacity_bytes)

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        """``torch.cuda.memory_stats``: every statistic torch's has
        (:mod:`dpprof.emulator.allocator_stats`), over the device's allocations so far;
        torch's own ``memory_summary`` prints them."""
        i = self._dev(device)
        stats = allocator_stats.memory_stats(self.events_of(i, accumulated=True),
                                             self.allocator_config())
        self._told(i, allocated=stats["allocated_bytes.all.peak"],
                   reserved=stats["reserved_bytes.all.peak"], what="torch.cuda.memory_stats()")
        return stats

    def reset_accumulated_memory_stats(self, device: Any = None) -> None:
        self._accumulated_from[self._dev(device)] = len(self.rt.storages.events)

    def set_per_process_memory_fraction(self, fraction: float, device: Any = None) -> None:
        """``torch.cuda.set_per_process_memory_fraction``: the caching allocator of the device
        may reserve at most ``fraction`` of its memory (``allowed_memory_maximum``; beyond it
        an allocation fails as out of memory, after the cache is released)."""
        i = self._dev(device)
        if not isinstance(fraction, float | int) or isinstance(fraction, bool):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.fractions[i] = (float(fraction), caller_site())

    def get_per_process_memory_fraction(self, device: Any = None) -> float:
        return self.fractions.get(self._dev(device), (1.0, ""))[0]

    def limit_bytes(self, i: int) -> int | None:
        """What the caching allocator of runtime device ``i`` may reserve (None: no fraction
        set), as c10 computes it: ``fraction x total memory``."""
        if i not in self.fractions:
            return None
        return int(self.fractions[i][0] * self.capacity_bytes)

    def caching_allocator_alloc(self, size: int, device: Any = None, stream: Any = None) -> int:
        """``torch.cuda.caching_allocator_alloc``: ``size`` bytes from the device's caching
        allocator (counted as a tensor's storage would be), at an address of its own."""
        i = self._dev(device)
        if size < 0:
            raise RuntimeError(f"caching_allocator_alloc: negative size {size}")
        block = self.rt.storages.new_empty((int(size),), torch.uint8, i)
        address = 0x7F00_0000_0000 + 512 * (len(self._raw) + 1) + (i << 40)
        while address in self._raw:
            address += 512
        self._raw[address] = block
        return address

    def caching_allocator_delete(self, mem_ptr: int) -> None:
        """``torch.cuda.caching_allocator_delete``: the block back to its pool."""
        if self._raw.pop(int(mem_ptr), None) is None:
            raise RuntimeError(f"invalid device pointer: {mem_ptr:#x}")

    def caching_allocator_enable(self, value: bool = True) -> None:
        """``torch.cuda.memory.caching_allocator_enable``: off, a GPU's allocations bypass
        the caching allocator (``cudaMalloc`` and ``cudaFree`` each, outside torch.cuda's
        statistics), which the simulation does not follow: the call is noted
        (:attr:`uncached_by`) and the allocations counted as cached."""
        if not value:
            self.uncached_by.setdefault(
                f"caching_allocator_enable(False) at {relative_site(caller_site())}", None)

    @contextlib.contextmanager
    def caching_allocator_disabled(self) -> Iterator[None]:
        """``torch.cuda.memory.caching_allocator_disabled``: off inside the block (noted)."""
        self.uncached_by.setdefault(
            "caching_allocator_disabled() at "
            f"{relative_site(caller_site((contextlib.__file__,)))}", None)
        yield

    def get_allocator_backend(self) -> str:
        """``native``, or ``cudaMallocAsync`` where the allocator's configuration asks it."""
        self.allocator_config()  # torch reads its configuration at the first allocation
        setting = self.setting[1] if self.setting else ""
        for item in setting.replace(" ", "").split(","):
            if item == "backend:cudaMallocAsync":
                return "cudaMallocAsync"
        return "native"
