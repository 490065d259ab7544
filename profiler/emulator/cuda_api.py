"""``torch.cuda`` and ``torch.accelerator``'s own functions played by a
:class:`dpprof.emulator.virtual_cuda.VirtualCuda`, grouped by what they stand in for: device
queries, memory statistics, the random number generators, streams and events, NVTX ranges,
and ``torch.accelerator``'s equivalents. Each group is patched through one ``Patch``
(:meth:`dpprof.emulator.patcher.Patcher.patch`), in :func:`install`'s order."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from dpprof.emulator.patcher import Patch

if TYPE_CHECKING:
    from dpprof.emulator.virtual_cuda import VirtualCuda


def install(vc: VirtualCuda, p: Patch) -> None:
    """Patch ``torch.cuda`` and ``torch.accelerator`` to answer from ``vc``."""
    device_queries(vc, p)
    memory_stats(vc, p)
    random_generators(vc, p)
    streams_and_events(p)
    memory_module(p)
    nvtx_ranges(p)
    accelerator(vc, p)


def device_queries(vc: VirtualCuda, p: Patch) -> None:
    """How many GPUs, which is current, what they are (``torch.cuda``'s initialisation too:
    a CPU build raises from ``_lazy_init``)."""
    cuda = torch.cuda
    # torch.cuda: the module's functions
    p(cuda, "_lazy_init", lambda: None)
    p(cuda, "init", lambda: None)
    p(cuda, "is_initialized", lambda: True)
    p(cuda, "is_available", lambda: vc.device_count() > 0)
    p(cuda, "device_count", vc.device_count)
    p(cuda, "current_device", vc.current_device)
    p(cuda, "set_device", vc.set_device)
    p(cuda, "device", device_class(vc))
    p(cuda, "device_of", lambda obj: device_class(vc)(
        vc.virtual_device(obj).index if obj.is_cuda else -1))
    p(cuda, "get_device_properties", vc.properties)
    p(cuda, "get_device_name", lambda device=None: vc.properties(device).name)
    p(cuda, "get_device_capability",
      lambda device=None: (vc.properties(device).major, vc.properties(device).minor))
    p(cuda, "get_arch_list", lambda: ["sm_{}{}".format(*vc.spec.compute_capability)])
    p(cuda, "is_bf16_supported",
      lambda including_emulation=True: vc.spec.compute_capability >= (8, 0))
    p(cuda, "is_tf32_supported", lambda: vc.spec.compute_capability >= (8, 0))
    p(cuda, "can_device_access_peer", lambda device, peer: True)


def memory_stats(vc: VirtualCuda, p: Patch) -> None:
    """The caching allocator's statistics, answered from the emulator, and the calls that
    wait for the device or free its cache (nothing to do)."""
    cuda = torch.cuda
    p(cuda, "mem_get_info", vc.mem_get_info)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved", "reset_peak_memory_stats", "memory_stats",
                 "memory_summary"):
        p(cuda, name, getattr(vc, name))
    p(cuda, "reset_max_memory_allocated", vc.reset_peak_memory_stats)
    p(cuda, "reset_accumulated_memory_stats", lambda device=None: None)
    p(cuda, "memory_cached", vc.memory_reserved)
    p(cuda, "max_memory_cached", vc.max_memory_reserved)
    for name in ("synchronize", "empty_cache", "ipc_collect", "set_sync_debug_mode"):
        p(cuda, name, Noop())


def random_generators(vc: VirtualCuda, p: Patch) -> None:
    """Seeds and generator states (a GPU's state has no value here: a host stand-in)."""
    cuda = torch.cuda
    # torch.cuda.random's functions too: callers that name the module (Hugging Face's
    # Trainer saves torch.cuda.random.get_rng_state() with each checkpoint) reach its
    # own bindings of current_device and _lazy_call, which are not these
    for owner in (cuda, cuda.random):
        for name in ("manual_seed", "manual_seed_all", "seed", "seed_all",
                     "set_rng_state", "set_rng_state_all"):
            p(owner, name, Noop())
        p(owner, "initial_seed", lambda: 0)
        # a GPU's generator state has no value here: a stand-in, never saved as real
        p(owner, "get_rng_state", lambda device="cuda": vc.rng_state_stand_in())
        p(owner, "get_rng_state_all",
          lambda: [vc.rng_state_stand_in() for _ in range(vc.device_count())])


def streams_and_events(p: Patch) -> None:
    """Streams and events: work is in order, nothing to wait for."""
    cuda = torch.cuda
    p(cuda, "Stream", Stream)
    p(cuda, "Event", Event)
    p(cuda, "current_stream", lambda device=None: Stream(device))
    p(cuda, "default_stream", lambda device=None: Stream(device))
    p(cuda, "stream", lambda stream=None: contextlib.nullcontext(stream))
    p(cuda, "set_stream", Noop())
    p(cuda, "is_current_stream_capturing", lambda: False)


def memory_module(p: Patch) -> None:
    """``torch.cuda.memory``'s own bindings of the memory functions, as patched on
    ``torch.cuda``."""
    cuda = torch.cuda
    with contextlib.suppress(ImportError, AttributeError):
        import torch.cuda.memory as cuda_memory

        for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                     "max_memory_reserved", "reset_peak_memory_stats", "memory_stats",
                     "mem_get_info", "empty_cache"):
            p(cuda_memory, name, getattr(cuda, name))


def nvtx_ranges(p: Patch) -> None:
    """NVTX ranges and marks (no profiler to tell)."""
    with contextlib.suppress(ImportError, AttributeError):
        import torch.cuda.nvtx as nvtx

        p(nvtx, "range_push", lambda msg: 0)
        p(nvtx, "range_pop", lambda: 0)
        p(nvtx, "mark", Noop())
        p(nvtx, "range", lambda msg, *a, **k: contextlib.nullcontext())


def accelerator(vc: VirtualCuda, p: Patch) -> None:
    """``torch.accelerator`` (torch >= 2.6), the device-generic names of the above."""
    cuda = torch.cuda
    acc = getattr(torch, "accelerator", None)
    if acc is not None:
        p(acc, "is_available", cuda.is_available)
        p(acc, "current_accelerator",
          lambda check_available=False: torch.device("cuda"))
        p(acc, "device_count", vc.device_count)
        p(acc, "current_device_index", vc.current_device)
        p(acc, "current_device_idx", vc.current_device)
        p(acc, "set_device_index", vc.set_device)
        p(acc, "set_device_idx", vc.set_device)
        p(acc, "synchronize", Noop())
        p(acc, "current_stream", lambda device=None: Stream(device))
        p(acc, "set_stream", Noop())
        p(acc, "device_index", device_class(vc))
        p(acc, "get_device_capability", lambda device=None: {
            "major": vc.spec.compute_capability[0],
            "minor": vc.spec.compute_capability[1]})
        mems = [acc]
        if hasattr(acc, "memory"):
            mems.append(acc.memory)
        for m in mems:
            for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                         "max_memory_reserved", "reset_peak_memory_stats", "memory_stats"):
                if hasattr(m, name):
                    p(m, name, getattr(vc, name))
            for name in ("empty_cache", "empty_host_cache",
                         "reset_accumulated_memory_stats"):
                if hasattr(m, name):
                    p(m, name, Noop())
            if hasattr(m, "get_memory_info"):
                p(m, "get_memory_info", vc.mem_get_info)


class Stream:
    """``torch.cuda.Stream`` on a virtual device: work is in order, nothing to wait for."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.device = torch.device("cuda", device_index(device) or 0)
        self.priority = priority
        self.cuda_stream = 0

    def wait_stream(self, stream: Any) -> None: ...
    def wait_event(self, event: Any) -> None: ...

    def record_event(self, event: Any = None) -> Event:
        return event or Event()

    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:
        return False

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None: ...


class Event:
    """``torch.cuda.Event`` on a virtual device: recorded at once, no time elapses."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, **_: Any) -> None:
        self.enable_timing = enable_timing

    def record(self, stream: Any = None) -> None: ...
    def wait(self, stream: Any = None) -> None: ...
    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


def device_index(device: Any) -> int | None:
    """The cuda index named by ``device`` (None: the current one)."""
    if device is None:
        return None
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        return device.index
    return None


class Noop:
    """A callable that does nothing (one per hooked name)."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


def device_class(vc: VirtualCuda) -> type:
    """``torch.cuda.device`` for ``vc``."""
    class device:
        """``torch.cuda.device(k)``: the current device inside the block."""

        def __init__(self, device: Any) -> None:
            self.idx = device_index(device)
            self._cm: contextlib.AbstractContextManager[None] | None = None

        def __enter__(self) -> None:
            self._cm = vc.device(self.idx)
            self._cm.__enter__()

        def __exit__(self, *exc: Any) -> None:
            if self._cm is not None:
                self._cm.__exit__(*exc)


    return device
