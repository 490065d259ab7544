"""``torch.cuda`` and ``torch.accelerator``'s own functions played by a
:class:`dpprof.emulator.virtual_cuda.VirtualCuda`, grouped by what they stand in for: device
queries, memory statistics, the random number generators, streams and events, CUDA graphs
(:mod:`dpprof.emulator.cuda_graphs`), NVTX ranges, and ``torch.accelerator``'s equivalents.
Each group is patched through one ``Patch`` (:meth:`dpprof.emulator.patcher.Patcher.patch`),
in :func:`install`'s order."""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dpprof.emulator import (
    cuda_comm,
    cuda_graphs,
    cuda_nccl,
    device_readings,
    flex_attention,
    profilers,
)
from dpprof.emulator.emulated_cuda import EmulatedCuda
from dpprof.emulator.memory_snapshot import MemoryHistory
from dpprof.emulator.patcher import Patch

# the NCCL that torch's CUDA builds are built with (its pin, .ci/docker/ci_commit_pins/nccl.txt:
# v2.28.9-1), as torch.cuda.nccl.version() gives it
EMULATED_NCCL_VERSION = (2, 28, 9)
# the CUDA of torch 2.13's wheels on PyPI (torchvision 0.28.0's there says +cu130), as
# torch.version.cuda gives it; where torch is a CUDA build, its own
EMULATED_CUDA_VERSION = "13.0"


def install(vc: EmulatedCuda, p: Patch) -> None:
    """Patch ``torch.cuda`` and ``torch.accelerator`` to answer from ``vc``."""
    device_queries(vc, p)
    memory_stats(vc, p)
    runtime_handles(vc, p)
    device_readings.install(vc, p, vc.readings)
    profilers.install(p, vc.profiled)
    cuda_comm.install(vc, p)
    cuda_nccl.install(vc, p)
    random_generators(vc, p)
    streams_and_events(vc, p)
    cuda_graphs.install(vc, p)
    flex_attention.install(vc, p)
    foreach_kernels(vc, p)
    memory_module(p)
    memory_history(vc, p)
    nvtx_ranges(p)
    accelerator(vc, p)


def device_queries(vc: EmulatedCuda, p: Patch) -> None:
    """How many GPUs, which is current, what they are (``torch.cuda``'s initialisation too:
    a CPU build raises from ``_lazy_init``)."""
    cuda = torch.cuda
    # torch.cuda: the module's functions. CUDA is initialised as torch initialises it: by
    # _lazy_init, which C++ calls before a tensor is made on a GPU (and current_device,
    # set_device, get_device_properties, synchronize call), not by counting the GPUs. A
    # program reads the difference: DeviceMesh sets the device from LOCAL_RANK only while
    # CUDA is not initialised, Lightning's fork strategies refuse once it is.
    p(cuda, "_lazy_init", vc.initialise)
    p(cuda, "init", vc.initialise)
    p(cuda, "is_initialized", vc.is_initialised)
    p(cuda, "is_available", lambda: vc.device_count() > 0)
    p(cuda, "device_count", vc.device_count)
    p(cuda, "current_device", initialising(vc, vc.current_device))
    p(cuda, "set_device", initialising(vc, vc.set_device))
    p(cuda, "device", device_class(vc))
    p(cuda, "device_of", lambda obj: device_class(vc)(
        vc.virtual_device(obj).index if obj.is_cuda else -1))
    p(cuda, "get_device_properties", initialising(vc, vc.properties))
    p(cuda, "get_device_name", lambda device=None: vc.properties(device).name)
    p(cuda, "get_device_capability",
      lambda device=None: (vc.properties(device).major, vc.properties(device).minor))
    p(cuda, "get_arch_list", lambda: ["sm_{}{}".format(*vc.spec.compute_capability)])
    p(cuda, "is_bf16_supported",
      lambda including_emulation=True: vc.spec.compute_capability >= (8, 0))
    p(cuda, "is_tf32_supported", lambda: vc.spec.compute_capability >= (8, 0))
    p(cuda, "can_device_access_peer", lambda device, peer_device: True)
    # torch's c10d logger asks NCCL's version of every collective's caller (the distributed
    # checkpoint's save, for one), DDP of its bf16 hook: a CPU build has no NCCL to ask
    p(cuda.nccl, "version", lambda: EMULATED_NCCL_VERSION)
    # a CPU build says None, which code reads as "not a CUDA build": DDP refuses its bf16
    # compression hook; torch's meta kernel of _grouped_mm pads its output's rows only
    # for a CUDA build
    if torch.version.cuda is None:
        p(torch.version, "cuda", EMULATED_CUDA_VERSION)
    # nn.LSTM / GRU ask whether cuDNN takes their weights; the CPU build answers no with a
    # warning that it was built without cuDNN, which the user's GPU machine never prints.
    # The RNNs run torch's own (non-cuDNN) path, as they do here: no, quietly.
    cudnn_acceptable = torch.backends.cudnn.is_acceptable
    p(torch.backends.cudnn, "is_acceptable",
      lambda tensor: False if vc.virtual_device(tensor).type == "cuda"
      else cudnn_acceptable(tensor))


def initialising(vc: EmulatedCuda, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` as a ``torch.cuda`` function that calls ``_lazy_init`` first."""
    @functools.wraps(func)
    def call(*args: Any, **kwargs: Any) -> Any:
        vc.initialise()
        return func(*args, **kwargs)
    return call


def memory_stats(vc: EmulatedCuda, p: Patch) -> None:
    """The caching allocator's statistics and controls, answered from the emulator (its
    simulation releases the cache at ``empty_cache``, a memory fraction limits it), and the
    calls that wait for the device (nothing to wait for)."""
    import torch.cuda.memory as cuda_memory

    cuda = torch.cuda

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        free, total = vc.memory.mem_get_info(device)
        # cudaMemGetInfo's free memory is the device's: the context, the libraries and NCCL's
        # communicators hold theirs beside the allocator's reserve
        return max(free - device_readings.outside_bytes(vc, vc.index_of(device)), 0), total

    p(cuda, "mem_get_info", initialising(vc, mem_get_info))
    # torch's own memory_summary prints these statistics (it reads torch.cuda.memory's
    # memory_stats, patched below)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved", "reset_peak_memory_stats", "memory_stats",
                 "reset_accumulated_memory_stats"):
        p(cuda, name, getattr(vc.memory, name))
    p(cuda, "reset_max_memory_allocated", vc.memory.reset_peak_memory_stats)
    p(cuda, "memory_cached", vc.memory.memory_reserved)
    p(cuda, "max_memory_cached", vc.memory.max_memory_reserved)
    p(cuda, "synchronize", initialising(vc, Noop()))
    p(cuda, "empty_cache", vc.memory.empty_cache)
    p(cuda, "ipc_collect", Noop())
    # the allocator's controls: a fraction limits what it may reserve (the run's figures
    # are checked against it), raw blocks are counted as tensors' storages
    for name in ("set_per_process_memory_fraction", "get_per_process_memory_fraction",
                 "caching_allocator_alloc", "caching_allocator_delete",
                 "get_allocator_backend"):
        p(cuda, name, getattr(vc.memory, name))
    # the allocator's settings set at run time (torch.cuda.memory._set_allocator_settings
    # calls the first)
    for name, func in (("_accelerator_setAllocatorSettings", vc.memory.set_allocator_settings),
                       ("_accelerator_getAllocatorSettings", vc.memory.get_allocator_settings)):
        if hasattr(torch._C, name):
            p(torch._C, name, func)
    for owner in (cuda, cuda_memory):
        for name in ("caching_allocator_enable", "caching_allocator_disabled"):
            if hasattr(owner, name):
                p(owner, name, getattr(vc.memory, name))
    # the host's pinned-memory statistics: no pinned memory is allocated here
    for name in ("reset_peak_host_memory_stats", "reset_accumulated_host_memory_stats"):
        if hasattr(cuda, name):
            p(cuda, name, Noop())


def runtime_handles(vc: EmulatedCuda, p: Patch) -> None:
    """What the CUDA runtime and its libraries hand out: cuBLAS's and cuSOLVER's handles
    (addresses: stand-ins, each handle one of its own), the synchronisation debug mode (kept,
    nothing synchronises), the runtime's module (``cudart()``: its profiler calls succeed,
    there is no profiler to start) and a stream from another library (an emulated one)."""
    cuda = torch.cuda
    handles: dict[tuple[str, int], int] = {}

    def handle(kind: str) -> Callable[[], int]:
        def current() -> int:
            key = (kind, vc.index_of(None))
            return handles.setdefault(key, 0x5000_0000 + 0x1000 * len(handles))
        return current

    p(cuda, "current_blas_handle", handle("cublas"))
    p(cuda, "current_solver_handle", handle("cusolver"))
    kept = [0]

    def set_sync_debug_mode(debug_mode: int | str) -> None:
        modes = {"default": 0, "warn": 1, "error": 2}
        kept[0] = modes[debug_mode] if isinstance(debug_mode, str) else int(debug_mode)

    p(cuda, "set_sync_debug_mode", set_sync_debug_mode)
    p(cuda, "get_sync_debug_mode", lambda: kept[0])
    p(cuda, "cudart", lambda: CudaRuntime())
    p(cuda, "check_error", check_error)
    p(cuda, "get_stream_from_external",
      lambda data_ptr, device=None: Stream(device, stream_id=int(data_ptr)))
    p(cuda, "ExternalStream", ExternalStream)


def check_error(res: int) -> None:
    """``torch.cuda.check_error``: a runtime call's status, 0 for success (every emulated
    runtime call's)."""
    if res != 0:
        raise RuntimeError(f"CUDA error: status {res} (a CUDA runtime call failed)")


class CudaRuntime:
    """``torch.cuda.cudart()`` of a virtual GPU: every runtime call succeeds (0,
    ``cudaSuccess``) and does nothing (the profiler's start and stop, host registration)."""

    def __getattr__(self, name: str) -> Callable[..., int]:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: 0


def random_generators(vc: EmulatedCuda, p: Patch) -> None:
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


def streams_and_events(vc: EmulatedCuda, p: Patch) -> None:
    """Streams and events: work is in order, nothing to wait for; but which stream is
    current is kept (:class:`CurrentStreams`), since the caching allocator pools each
    stream's blocks apart."""
    cuda = torch.cuda
    streams = vc.streams
    p(cuda, "Stream", Stream)
    p(cuda, "Event", Event)
    p(cuda, "current_stream", streams.current)
    p(cuda, "default_stream", streams.default)
    p(cuda, "stream", streams.using)
    p(cuda, "set_stream", streams.set)


def foreach_kernels(vc: EmulatedCuda, p: Patch) -> None:
    """CUDA's ``_foreach_*`` kernels for the virtual GPUs' tensors: torch groups tensors by
    their real device (the emulation's meta or CPU), and ``clip_grad_norm_(foreach=True)``
    refuses a device without foreach kernels, as it would never refuse a GPU's."""
    import torch.utils._foreach_utils as foreach_utils

    supported = foreach_utils._get_foreach_kernels_supported_devices
    base = vc.rt.base.type
    p(foreach_utils, "_get_foreach_kernels_supported_devices",
      lambda: list(dict.fromkeys([*supported(), "cuda", base])))


def memory_module(p: Patch) -> None:
    """``torch.cuda.memory``'s own bindings of the memory functions, as patched on
    ``torch.cuda``."""
    cuda = torch.cuda
    with contextlib.suppress(ImportError, AttributeError):
        import torch.cuda.memory as cuda_memory

        for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                     "max_memory_reserved", "reset_peak_memory_stats", "memory_stats",
                     "mem_get_info", "empty_cache",
                     "reset_accumulated_memory_stats", "reset_max_memory_allocated",
                     "memory_cached", "max_memory_cached", "set_per_process_memory_fraction",
                     "get_per_process_memory_fraction", "caching_allocator_alloc",
                     "caching_allocator_delete", "get_allocator_backend",
                     "reset_peak_host_memory_stats", "reset_accumulated_host_memory_stats"):
            if hasattr(cuda_memory, name):
                p(cuda_memory, name, getattr(cuda, name))


def memory_history(vc: EmulatedCuda, p: Patch) -> None:
    """The memory snapshot and its record of the allocator's actions
    (:mod:`dpprof.emulator.memory_snapshot`): ``_dump_snapshot`` pickles what the patched
    ``_snapshot`` gives, through Python's ``open``."""
    import torch.cuda.memory as cuda_memory

    history = MemoryHistory(vc.rt, lambda: [vc.index_of(k) for k in range(vc.device_count())],
                            vc.memory.allocator_config, vc.memory.workspaces)
    p(cuda_memory, "_record_memory_history", history.record)
    p(cuda_memory, "_snapshot", history.snapshot)
    p(cuda_memory, "memory_snapshot", history.segments)
    p(torch.cuda, "memory_snapshot", history.segments)


def nvtx_ranges(p: Patch) -> None:
    """NVTX ranges and marks (no profiler to tell)."""
    with contextlib.suppress(ImportError, AttributeError):
        import torch.cuda.nvtx as nvtx

        p(nvtx, "range_push", lambda msg: 0)
        p(nvtx, "range_pop", lambda: 0)
        p(nvtx, "mark", Noop())
        p(nvtx, "range", lambda msg, *a, **k: contextlib.nullcontext())


def accelerator(vc: EmulatedCuda, p: Patch) -> None:
    """``torch.accelerator`` (torch >= 2.6), the device-generic names of the above."""
    cuda = torch.cuda
    acc = getattr(torch, "accelerator", None)
    if hasattr(torch._C, "_get_accelerator"):
        # what torch.distributed reads for its default device: FSDP2's default mesh,
        # the default backend of init_process_group
        p(torch._C, "_get_accelerator", lambda check=False: torch.device("cuda"))
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
        p(acc, "current_stream", vc.streams.current)
        p(acc, "set_stream", vc.streams.set)
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
                    p(m, name, getattr(vc.memory, name))
            if hasattr(m, "empty_cache"):
                p(m, "empty_cache", vc.memory.empty_cache)
            if hasattr(m, "reset_accumulated_memory_stats"):
                p(m, "reset_accumulated_memory_stats", vc.memory.reset_accumulated_memory_stats)
            if hasattr(m, "empty_host_cache"):
                p(m, "empty_host_cache", Noop())
            if hasattr(m, "get_memory_info"):  # torch.cuda's, the context left out of free
                p(m, "get_memory_info", cuda.mem_get_info)


class _ThreadSideStreams(threading.local):
    """One thread's current side streams: runtime device -> its stream (absent: the
    default)."""

    def __init__(self) -> None:
        self.current: dict[int, Stream] = {}


class CurrentStreams:
    """Which stream is current on each virtual device (``torch.cuda.current_stream``,
    ``set_stream``, ``torch.cuda.stream(s)``), told to the runtime
    (:meth:`dpprof.emulator.storage_ledger.StorageLedger.set_stream`) so that each allocation
    is known to be its stream's: FSDP2 allocates its all-gather and reduce-scatter buffers
    on streams of its own, and the caching allocator never lends one stream's free blocks
    to another. Each thread has its own current streams, as in CUDA."""

    def __init__(self, vc: EmulatedCuda) -> None:
        self.vc = vc
        self._threads = _ThreadSideStreams()
        self._defaults: dict[int, Stream] = {}

    def _index(self, device: Any) -> int:
        """The runtime's index of the device ``device`` names (None: the current one)."""
        i = device_index(device)
        return self.vc.index_of(self.vc.current_device() if i is None else i)

    def default(self, device: Any = None) -> Stream:
        return self._default_at(self._index(device))

    def _default_at(self, i: int) -> Stream:
        stream = self._defaults.get(i)
        if stream is None:
            stream = self._defaults[i] = Stream(self.vc.logical(i), stream_id=0)
        return stream

    def current(self, device: Any = None) -> Stream:
        i = self._index(device)
        return self._threads.current.get(i) or self._default_at(i)

    def set(self, stream: Any) -> None:
        if stream is None:
            return
        i = self._index(stream.device)
        sid = getattr(stream, "stream_id", 0)
        if sid:
            self._threads.current[i] = stream
        else:
            self._threads.current.pop(i, None)
        self.vc.rt.storages.set_stream(i, sid)

    @contextlib.contextmanager
    def using(self, stream: Any = None) -> Iterator[None]:
        """``torch.cuda.stream(stream)``: ``stream`` current inside (None: no change)."""
        if stream is None:
            yield
            return
        before = self.current(stream.device)
        self.set(stream)
        try:
            yield
        finally:
            self.set(before)


_STREAM_IDS = itertools.count(1)


class Stream:
    """``torch.cuda.Stream`` on a virtual device: work is in order, nothing to wait for.
    Each new stream has an id of its own (``stream_id``; 0 is a device's default stream),
    by which the caching allocator's simulation pools its blocks."""

    def __init__(self, device: Any = None, priority: int = 0, stream_id: int | None = None,
                 **_: Any) -> None:
        i = device_index(device)
        self.device = torch.device("cuda", torch.cuda.current_device() if i is None else i)
        self.priority = priority
        self.stream_id = next(_STREAM_IDS) if stream_id is None else stream_id
        self.cuda_stream = self.stream_id
        self._before: list[Stream] = []

    @property
    def device_index(self) -> int:
        return self.device.index or 0

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Stream) and other.stream_id == self.stream_id
                and other.device == self.device)

    def __hash__(self) -> int:
        return hash((self.stream_id, self.device))

    def __repr__(self) -> str:
        return f"<torch.cuda.Stream device={self.device} cuda_stream={self.cuda_stream:#x}>"

    def wait_stream(self, stream: Any) -> None: ...
    def wait_event(self, event: Any) -> None: ...

    def record_event(self, event: Any = None) -> Event:
        return event or Event()

    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:
        return bool(_current_streams().vc.graphs.stream_capturing(self))

    def __enter__(self) -> Stream:
        """``with stream:``: the stream current inside, as ``torch.cuda.stream``."""
        streams = _current_streams()
        self._before.append(streams.current(self.device))
        streams.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _current_streams().set(self._before.pop())


class ExternalStream(Stream):
    """``torch.cuda.ExternalStream``: a stream another library made, by its address."""

    def __init__(self, stream_ptr: int, device: Any = None, **kwargs: Any) -> None:
        super().__init__(device, stream_id=int(stream_ptr))


def _current_streams() -> CurrentStreams:
    """The active virtual CUDA's streams (a Stream is only made while one is active)."""
    from dpprof.emulator.emulated_cuda import active

    vc = active()
    if vc is None:
        raise RuntimeError("a virtual torch.cuda.Stream was used outside the emulation")
    return vc.streams


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


def device_class(vc: EmulatedCuda) -> type:
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
