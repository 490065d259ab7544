"""The cuda backend: the paired scenarios on real GPUs, measured two ways per device.

- ``dp-loss-primary`` / ``dp-loss-forward``: the real ``torch.nn.DataParallel`` over the
  chosen devices (``device_ids``; ``output_device`` = the first), in this process;
- ``single``: the bare model on the first chosen device, batch ``ceil(B / N)``;
- ``ddp``: ``DistributedDataParallel``, one process per GPU, through :mod:`dpprof.backends.cuda_ddp`
  (spawned by dpprof, or started by ``torchrun``); each rank runs :func:`measure_ddp_rank`.

Every scenario runs the one shared loop, :func:`~dpprof.scenarios.base.training_loop`:
``warmup_steps`` iterations, then ``steps`` measured ones. Memory is read two ways:

- the caching allocator's view: ``torch.cuda.reset_peak_memory_stats`` at the start of each
  phase (input transfer, zero_grad, forward, loss, backward, optimizer step) of the first
  measured step, ``max_memory_allocated`` / ``max_memory_reserved`` at its end (the device is
  synchronised at both ends); the overall peaks cover every measured step;
- NVML's view, from an :class:`~dpprof.nvml.sampler.NvmlSampler` thread (every 20 ms by default)
  over every visible GPU, matched to CUDA indices by UUID (:mod:`dpprof.nvml.devices`): the peak
  ``used``, the timeline with phase markers, GPU utilisation, and per-process usage of this
  process (a rank's context on a GPU that is not its own is flagged: the DDP "forgot
  ``set_device``" case). What NVML sees beyond the allocator's reserve (context, NCCL, other
  processes) is kept as ``nvml_unexplained_bytes``.

Step time is the wall clock around each measured step (ended by a synchronise) and, on CUDA,
``torch.cuda.Event`` timing on the first device's current stream; median and max - min.

An out-of-memory error is a result: caught, parsed (device, bytes asked for), recorded with
the phase and the peaks so far; the frames holding the tensors are dropped, then ``gc`` and
``empty_cache`` give the memory back before the next scenario.

Everything the backend asks of the machine sits behind :class:`CudaHost` (the GPUs it sees,
how the ddp ranks talk, the :class:`DeviceOps` over the chosen devices: :class:`CudaOps` over
``torch.cuda``); the process-wide instance is :data:`HOST`, read through :func:`host`. The
tests run this code without a GPU by installing a CPU implementation of that interface
(``tests/fakehost``); nothing here knows about it.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import os
import socket
import statistics
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dpprof.emulator.kernels import StepAutocast
from dpprof.nvml import libnvml
from dpprof.nvml.devices import resolve_visible_devices, torch_cuda_uuids
from dpprof.nvml.libnvml import NvmlBackend
from dpprof.nvml.sampler import NvmlSampler
from dpprof.result import (
    STATUS_ERROR,
    STATUS_OK,
    STATUS_OOM,
    DeviceResult,
    ScenarioResult,
    TimelinePoint,
    WatchOom,
)
from dpprof.scenarios.base import (
    DDP,
    StepHooks,
    UserStep,
    error_site,
    training_loop,
)
from dpprof.scenarios.registry import find
from dpprof.scenarios.step import (
    Batch,
    StepConfig,
    build_model,
    scenario_batch,
    step_stream,
)
from dpprof.scenarios.workloads import Workload, map_tensors, shard_sizes
from dpprof.units import fmt_bytes
from dpprof.watch.oom_messages import parse_oom_line

__all__ = [
    "ASSUMPTIONS",
    "HOST",
    "CudaHost",
    "CudaOps",
    "CudaRunConfig",
    "DeviceOps",
    "Measured",
    "find_oom",
    "host",
    "is_oom",
    "measure_ddp_rank",
    "run_local_scenario",
    "step_closure",
]

DEFAULT_NVML_INTERVAL_S = 0.02
TIMELINE_POINTS = 400  # NVML points kept per device and scenario (maxima of equal slices)

ASSUMPTIONS = [
    "Measured on real GPUs: DataParallel scenarios through torch.nn.DataParallel in one "
    "process; ddp through DistributedDataParallel (NCCL), one process per GPU.",
    "Allocated/reserved: torch.cuda.max_memory_allocated / max_memory_reserved over the "
    "measured steps (peaks reset at their start); per phase from the first measured step, "
    "with the peaks reset at the start of each phase. A scenario that runs out of memory "
    "before its measured steps reports the peak since its own start (reset there too).",
    "cuBLAS workspaces are caching-allocator blocks (one per cuBLAS handle and stream, "
    "torch's aten/src/ATen/cuda/CublasHandlePool.cpp): they count in allocated and reserved.",
    "NVML used: nvmlDeviceGetMemoryInfo sampled by a thread; a sampled peak is a lower bound. "
    "NVML used minus reserved is what the allocator does not see: the CUDA context and "
    "library code, cuDNN and NCCL buffers allocated outside the caching allocator, and "
    "other processes.",
    "Step time: median over the measured steps of the wall clock (each step ends with "
    "torch.cuda.synchronize), and of CUDA events on the first device's stream. The first "
    "measured step also reads the per-phase peaks (one synchronize per phase), so it is "
    "slower; the median is robust to it. DDP: per step, the slowest rank.",
]


# --------------------------------------------------------------------------- OOM


def _oom_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = []
    for owner in (torch, torch.cuda):
        t = getattr(owner, "OutOfMemoryError", None)
        if isinstance(t, type) and t not in types:
            types.append(t)
    return tuple(types)


OOM_ERRORS = _oom_error_types()


def is_oom(exc: BaseException) -> bool:
    """``torch.cuda.OutOfMemoryError``, or an allocation failure that torch raises as a
    ``RuntimeError``: ``CUDA error: out of memory`` (a ``cudaMalloc`` outside the caching
    allocator, a context or kernel workspace), cuBLAS / cuDNN ``*_STATUS_ALLOC_FAILED``,
    NCCL's out of memory: the formats ``dpprof watch`` recognises in a program's output."""
    if isinstance(exc, OOM_ERRORS):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        find_oom(text) is not None
        or "CUDA out of memory" in text
        or ("NCCL error" in text and "out of memory" in text.lower())
    )


def find_oom(text: str) -> WatchOom | None:
    """The out-of-memory error stated in ``text``, read by the one parser of PyTorch's
    messages (:func:`dpprof.watch.oom_messages.parse_oom_line`): device and bytes asked for
    where the caching allocator's message gives them. DataParallel re-raises a replica's
    error with the replica's traceback in the message, so the last such line wins."""
    for line in reversed(text.splitlines()):
        found = parse_oom_line(line)
        if found is not None:
            return found
    return None


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line. DataParallel's worker threads re-raise a replica's
    error as ``Caught X in replica 0 on device 0.`` followed by the original traceback;
    the original error's own line (the traceback's last) is what the user needs."""
    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if len(lines) > 1 and "Original Traceback" in text:
        return lines[-1]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".strip()


# --------------------------------------------------------------------------- the device seam


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


# --------------------------------------------------------------------------- NVML


class NvmlWatch:
    """An :class:`NvmlSampler` over every visible GPU, with CUDA index -> NVML index by UUID.

    ``cuda_uuids``: the UUID per CUDA index (default: what the CUDA runtime reports). When
    NVML or the UUIDs are unavailable, :attr:`reason` says why and nothing is sampled. A MIG
    device is sampled through its own NVML handle (the parent GPU's figures span every slice,
    and a user without root may not read them); ``nvml_index`` in the results stays the
    parent GPU's.
    """

    def __init__(
        self,
        nvml: NvmlBackend | None,
        interval_s: float,
        cuda_uuids: Sequence[str] | None,
        pids: Sequence[int] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.nvml = nvml
        self.map: dict[int, int] = {}  # cuda index -> the NVML index sampled for it
        self.parents: dict[int, int] = {}  # cuda index -> the physical GPU's NVML index
        self.uuids: dict[int, str] = {}
        self.unsampled: dict[int, str] = {}  # cuda index -> why it is matched but not sampled
        self.reason: str | None = None
        self.sampler: NvmlSampler | None = None
        self.pids = list(pids)
        if nvml is None:
            self.reason = "NVML not used on CPU devices"
            return
        status = nvml.status()
        if not status.available:
            self.reason = f"NVML not available: {status.reason}"
            return
        if cuda_uuids is None:
            self.reason = "the CUDA runtime reports no device UUIDs"
            return
        found = resolve_visible_devices(nvml, env, list(cuda_uuids))
        for dev in found.devices:
            if dev.nvml_index is None:
                continue
            self.parents[dev.cuda_index] = dev.nvml_index
            if dev.uuid:
                self.uuids[dev.cuda_index] = dev.uuid
            if dev.sample_index is None:
                self.unsampled[dev.cuda_index] = (
                    f"MIG device {dev.uuid}: NVML cannot address it on its own here, and the "
                    "parent GPU's figures would span every MIG slice")
            else:
                self.map[dev.cuda_index] = dev.sample_index
        if not self.map:
            self.reason = next(iter(self.unsampled.values()), None) or (
                "no CUDA device could be matched to an NVML device by UUID")
            return
        self.sampler = NvmlSampler(
            nvml, sorted(set(self.map.values())), interval_s, pids=self.pids or None
        )

    def __enter__(self) -> NvmlWatch:
        if self.sampler is not None:
            self.sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.sampler is not None:
            self.sampler.stop()

    def mark(self, name: str) -> None:
        if self.sampler is not None:
            self.sampler.mark(name)

    def fill(self, dev: DeviceResult, cuda_index: int) -> None:
        """Put NVML's view of ``cuda_index`` into ``dev`` (or the reason it is missing)."""
        dev.uuid = self.uuids.get(cuda_index)
        dev.nvml_index = self.parents.get(cuda_index)
        nvml_index = self.map.get(cuda_index)
        if self.sampler is None or nvml_index is None:
            dev.nvml_reason = self.unsampled.get(cuda_index) or self.reason or (
                f"cuda:{cuda_index} not matched to an NVML device")
            return
        s = self.sampler
        dev.nvml_peak_used_bytes = s.peak_used_bytes(nvml_index)
        if dev.nvml_peak_used_bytes is None:
            dev.nvml_reason = s.errors.get(nvml_index, "no NVML sample was taken")
        elif dev.peak_reserved_bytes is not None:
            dev.nvml_unexplained_bytes = dev.nvml_peak_used_bytes - dev.peak_reserved_bytes
        samples = [x for x in s.samples if x.device == nvml_index]
        if samples:
            dev.nvml_baseline_used_bytes = samples[0].used_bytes
        utils = [x.util_percent for x in samples if x.util_percent is not None]
        if utils:
            dev.gpu_utilization_mean_percent = float(statistics.fmean(utils))
            dev.gpu_utilization_max_percent = int(max(utils))
        markers = s.markers
        points = []
        for x in samples:
            phase = ""
            for m in markers:
                if m.t_s <= x.t_s:
                    phase = m.name
                else:
                    break
            points.append(TimelinePoint(x.t_s, x.used_bytes, phase))
        dev.timeline = _thin(points)
        for pid in self.pids:
            peak = s.peak_process_bytes(nvml_index, pid)
            if peak is not None:
                dev.process_used_bytes[str(pid)] = peak

    def foreign_pids(self, cuda_indices: Sequence[int]) -> bool:
        """Whether NVML listed processes on these GPUs (where this process worked) but never
        this process's PIDs: it reports the PIDs of another PID namespace (a container run
        without the host's), so per-process usage and stray contexts cannot be seen."""
        if self.sampler is None or not self.pids:
            return False
        devices = {self.map[c] for c in cuda_indices if c in self.map}
        listed = {d for d in devices if self.sampler.listed_processes(d)}
        return bool(listed) and not any(
            self.sampler.listed_pid(d, pid) for d in listed for pid in self.pids)

    def notes(self, cuda_indices: Sequence[int]) -> list[str]:
        """What the sampler could not read, per CUDA device, for the scenario's notes."""
        if self.sampler is None:
            return []
        s = self.sampler
        back = {v: k for k, v in self.map.items()}
        found: list[str] = []
        for device, texts in sorted(s.notes.items()):
            where = f"cuda:{back[device]}" if device in back else "NVML"
            found.extend(f"NVML on {where}: {t}" for t in texts)
        if s.thread_error:
            found.append(f"the NVML sampler stopped: {s.thread_error}")
        if self.foreign_pids(cuda_indices):
            found.append(
                "NVML lists processes on the GPUs but never dpprof's own: it reports the PIDs "
                "of another PID namespace (a container without the host's, e.g. docker run "
                "without --pid=host), so per-process usage and CUDA contexts on the wrong GPU "
                "cannot be seen here")
        return found

    def contexts_of(self, pid: int) -> dict[int, int]:
        """CUDA index -> peak used bytes of every GPU where ``pid`` held memory.

        An entry of 0 bytes is not a context: with peer access (NVLink, P2P over PCIe) NVML
        lists every process that mapped a GPU's memory on that GPU with 0 bytes, so each DDP
        rank shows up on every peer's GPU. An entry whose usage the driver cannot tell
        (None) proves nothing either way and is left out too.
        """
        if self.sampler is None:
            return {}
        back = {v: k for k, v in self.map.items()}
        found: dict[int, int] = {}
        for p in self.sampler.process_samples:
            if p.pid == pid and p.device in back and p.used_bytes:
                cuda = back[p.device]
                found[cuda] = max(found.get(cuda, 0), p.used_bytes)
        return found


def _thin(points: list[TimelinePoint]) -> list[TimelinePoint]:
    if len(points) <= TIMELINE_POINTS:
        return points
    step = len(points) / TIMELINE_POINTS
    kept = []
    for k in range(TIMELINE_POINTS):
        chunk = points[int(k * step) : int((k + 1) * step) or None]
        if chunk:
            kept.append(max(chunk, key=lambda p: p.allocated_bytes))
    return kept


# --------------------------------------------------------------------------- measuring


@dataclass
class CudaRunConfig:
    """What every cuda-backend scenario shares (picklable: it travels to DDP ranks)."""

    devices: list[int]  # CUDA indices, in DataParallel device_ids order
    # the step's options as they are (batch, seed, warm-up and measured steps, dtype,
    # autocast, DDP's options); unset warm-up and steps: the cuda backend's defaults
    step: StepConfig = field(default_factory=StepConfig)
    nvml_interval_s: float = DEFAULT_NVML_INTERVAL_S
    debug: bool = False

    @property
    def warmup_steps(self) -> int:
        return self.step.warmup_steps("cuda")

    @property
    def steps(self) -> int:
        return self.step.measured_steps("cuda")


@dataclass
class Measured:
    """One process's measurement of one scenario (a DDP rank's travels to rank 0)."""

    status: str = STATUS_OK
    message: str = ""
    devices: list[DeviceResult] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    event_times_s: list[float] = field(default_factory=list)
    loss: float | None = None
    rows: int = 0
    oom_device: int | None = None  # logical index (DP position, or the rank under DDP)
    oom_bytes: int | None = None
    oom_phase: str | None = None
    traceback: str | None = None
    notes: list[str] = field(default_factory=list)
    stray_contexts: list[dict[str, Any]] = field(default_factory=list)
    rank: int | None = None
    first_failure: bool = False  # this rank failed before any other (DDP)


class PhaseRecorder:
    """The ``phase`` hook of :class:`StepHooks`: allocator peaks per phase and device."""

    def __init__(self, ops: DeviceOps, logical: Sequence[int], watch: NvmlWatch | None) -> None:
        self.ops = ops
        self.logical = list(logical)
        self.watch = watch
        self.current = ""
        self.profile = False
        self.peak_allocated: dict[int, dict[str, int]] = {i: {} for i in self.logical}
        self.peak_reserved: dict[int, dict[str, int]] = {i: {} for i in self.logical}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.current = name
        if self.watch is not None:
            self.watch.mark(name)
        if not self.profile:
            yield
            return
        self.ops.synchronize()
        for i in self.logical:
            self.ops.reset_peaks(i)
        yield
        self.ops.synchronize()
        for i in self.logical:
            a, r = self.ops.max_allocated(i), self.ops.max_reserved(i)
            if a is not None:
                self.peak_allocated[i][name] = max(a, self.peak_allocated[i].get(name, 0))
            if r is not None:
                self.peak_reserved[i][name] = max(r, self.peak_reserved[i].get(name, 0))




def _model(wl: Workload, device: torch.device, seed: int) -> tuple[nn.Module, Any]:
    """The model (and a loss module, if the loss is one) from the seed, on ``device``."""
    model = build_model(wl, seed).to(device)
    loss_fn = wl.loss
    if isinstance(loss_fn, nn.Module):
        loss_fn = copy.deepcopy(loss_fn).to(device)
    if wl.dtype != torch.float32:
        model = model.to(wl.dtype)
        if isinstance(loss_fn, nn.Module):
            loss_fn = loss_fn.to(wl.dtype)
    return model, loss_fn


class StepBatches(Sequence[Batch]):
    """The loader's host batches, one per iteration, each made by the one seed rule
    (:func:`dpprof.scenarios.step.scenario_batch`) when :meth:`prepare` asks for it, outside
    the timed step; only the current one is kept (a long run holds one batch, not one per
    step)."""

    def __init__(self, make: Callable[[int], Batch], count: int) -> None:
        self.make = make
        self.length = count
        self.current: tuple[int, Batch] | None = None

    def prepare(self, k: int) -> None:
        if self.current is None or self.current[0] != k:
            self.current = None  # the previous host batch goes before the next is made
            self.current = (k, self.make(k))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, k: int) -> Batch:  # type: ignore[override]
        self.prepare(k)
        assert self.current is not None
        return self.current[1]


def step_closure(wl: Workload, ops: DeviceOps, rows: int, seed: int = 0) -> Callable[[], None]:
    """One training step of ``wl`` on ``ops``' first device, ``rows`` rows, through the
    shared loop: the model, optimizer and batch are made once and kept by the closure."""
    dev = ops.device(0)
    model, loss_fn = _model(wl, dev, seed)
    opt = _optimizer(wl, model, loss_fn)
    model.train()
    batch = [scenario_batch(wl, seed, 0, rows, 1, 0)]

    def move(x: Any, is_target: bool) -> Any:
        return map_tensors(x, lambda t: t.clone() if dev.type == "cpu" else t.to(dev))

    def step() -> None:
        training_loop(model, loss_fn, opt, batch, move, False, step=wl.step)

    return step


def _optimizer(wl: Workload, model: nn.Module, loss_fn: Any) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if isinstance(loss_fn, nn.Module):
        params += list(loss_fn.parameters())
    opt = wl.optimizer(params)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"optimizer() returned {type(opt).__name__}, not a torch Optimizer")
    return opt


class _Run:
    """The measuring loop around one wrapped model; shared by DP, single and each DDP rank."""

    def __init__(
        self,
        ops: DeviceOps,
        cfg: CudaRunConfig,
        logical: Sequence[int],
        watch: NvmlWatch | None,
    ) -> None:
        self.ops = ops
        self.cfg = cfg
        self.logical = list(logical)
        self.rec = PhaseRecorder(ops, logical, watch)
        self.overall_allocated: dict[int, int] = {}
        self.overall_reserved: dict[int, int] = {}
        self.measuring = False
        # The allocator's peaks are process-wide and cumulative until reset: without this,
        # an OOM in a warm-up step (before the reset of the first measured one) would report
        # the previous scenario's peak as this one's.
        ops.synchronize()
        for i in self.logical:
            ops.reset_peaks(i)

    def peaks_now(self) -> None:
        """Fold the allocator's current peaks into the overall peaks (measured steps only)."""
        if not self.measuring:
            return
        for i in self.logical:
            a, r = self.ops.max_allocated(i), self.ops.max_reserved(i)
            if a is not None:
                self.overall_allocated[i] = max(a, self.overall_allocated.get(i, 0))
            if r is not None:
                self.overall_reserved[i] = max(r, self.overall_reserved.get(i, 0))

    def loop(
        self,
        wrapped: Callable[..., Any],
        loss_fn: Any,
        opt: torch.optim.Optimizer,
        batches: StepBatches,
        loss_inside: bool,
        out: Measured,
        wl_step: UserStep | None = None,
    ) -> None:
        """The shared loop (the workload's own step, if it has one), timed and measured."""
        dev0 = self.ops.device(self.logical[0])
        cfg = self.cfg

        @contextlib.contextmanager
        def iteration(k: int, last: bool) -> Iterator[None]:
            batches.prepare(k)  # the loader's work, before the step's clock starts
            measured = k >= cfg.warmup_steps
            if k == cfg.warmup_steps:
                self.ops.synchronize()
                for i in self.logical:
                    self.ops.reset_peaks(i)
                self.measuring = True
            self.rec.profile = k == cfg.warmup_steps
            t0 = time.perf_counter()
            stop = self.ops.start_timer() if measured else None
            yield
            event_s = stop() if stop is not None else None
            self.ops.synchronize()
            wall = time.perf_counter() - t0
            self.rec.current = ""
            if measured:
                self.peaks_now()
                out.step_times_s.append(wall)
                if event_s is not None:
                    out.event_times_s.append(event_s)

        def move(x: Any, is_target: bool) -> Any:
            # On the CPU (the test mode) the host-to-device copy is a copy too.
            return map_tensors(x, lambda t: t.clone() if dev0.type == "cpu" else t.to(dev0))

        amp = StepAutocast(cfg.step.amp, dev0.type)  # --amp: forward and loss, as the user's
        hooks = StepHooks(phase=amp.phase(self.rec.phase), iteration=iteration)
        with amp, step_stream(cfg.step.seed):
            loss = training_loop(wrapped, loss_fn, opt, batches, move, loss_inside, hooks,
                                 step=wl_step, micro_batches=cfg.step.micro_batches)
        out.loss = None if loss is None else float(loss)
        self.rec.profile = False

    def fold_phases(self) -> None:
        for i in self.logical:
            for _name, a in self.rec.peak_allocated[i].items():
                self.overall_allocated[i] = max(a, self.overall_allocated.get(i, 0))
            for _name, r in self.rec.peak_reserved[i].items():
                self.overall_reserved[i] = max(r, self.overall_reserved.get(i, 0))

    def device_result(self, logical: int, rows: int, used: bool) -> DeviceResult:
        alloc = self.overall_allocated.get(logical)
        phases = self.rec.peak_allocated.get(logical, {})
        peak_phase = max(phases, key=lambda k: phases[k]) if phases else ""
        return DeviceResult(
            index=logical,
            peak_allocated_bytes=alloc or 0,
            capacity_bytes=self.ops.capacity(logical) or 0,
            peak_reserved_bytes=self.overall_reserved.get(logical),
            peak_phase=peak_phase,
            used=used,
            batch_rows=rows,
            cuda_index=self.ops.devices[logical] if self.ops.kind == "cuda" else None,
            phase_peak_allocated_bytes=dict(phases),
            phase_peak_reserved_bytes=dict(self.rec.peak_reserved.get(logical, {})),
            allocator_stats=alloc is not None,
        )


def _fail(out: Measured, exc: BaseException, run: _Run | None, cfg: CudaRunConfig) -> None:
    """Record ``exc`` in ``out`` (OOM or error); keeps only strings and numbers."""
    out.traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    out.message = one_line(exc) + error_site(exc)
    if run is not None:
        out.oom_phase = run.rec.current or None
        with contextlib.suppress(Exception):
            run.measuring = True
            run.peaks_now()
    if is_oom(exc):
        out.status = STATUS_OOM
        oom = find_oom(str(exc))
        device = oom.cuda_index if oom else None
        out.oom_bytes = oom.requested_bytes if oom else None
        if device is not None and run is not None and run.ops.kind == "cuda":
            phys = run.ops.devices
            out.oom_device = phys.index(device) if device in phys else None
            if out.oom_device is None:
                out.notes.append(f"the OOM happened on cuda:{device}, outside the run")
        elif run is not None:  # CPU test mode: logical indices stand for the devices
            if device in run.logical:
                out.oom_device = device
            elif len(run.logical) == 1:
                out.oom_device = run.logical[0]
        first = (oom.text if oom else out.message).split(". ", 2)
        out.message = "out of memory" + (
            f" on cuda:{device}" if device is not None else ""
        ) + (f" asking for {fmt_bytes(out.oom_bytes)}" if out.oom_bytes else "") + (
            f" during {out.oom_phase}" if out.oom_phase else ""
        ) + f" ({first[0][:200]})"
    else:
        out.status = STATUS_ERROR


def run_local_scenario(
    name: str,
    wl: Workload,
    cfg: CudaRunConfig,
    ops: DeviceOps | None = None,
    nvml: NvmlBackend | None = None,
    cuda_uuids: Sequence[str] | None = None,
) -> ScenarioResult:
    """Run ``dp-loss-primary``, ``dp-loss-forward`` or ``single`` in this process.

    Never raises for the workload's failures: an OOM or any error becomes the result's
    status, and the memory is given back before returning.
    """
    kind = find(name)
    if kind is None or kind.one_process_per_gpu or not kind.paired:
        raise ValueError(f"{name!r} is not an in-process scenario")
    ops = ops or host().ops(cfg.devices)
    n = len(cfg.devices)
    logical = list(range(n)) if kind.scatters_batch else [0]
    result = ScenarioResult(name=name, batch=cfg.step.batch)
    out = Measured()
    watch = _watch(ops, cfg, nvml, cuda_uuids, [os.getpid()])
    run: _Run | None = None
    shards = shard_sizes(cfg.step.batch, n)
    def body() -> None:  # its frame holds the tensors: gone with the exception
        nonlocal run
        run = _Run(ops, cfg, logical, watch)
        ops.set_device(0)
        rows = kind.samples_per_step(cfg.step.batch, shards)
        rank = kind.rank  # single: one GPU's share, DP: the whole batch
        batches = StepBatches(
            lambda k: scenario_batch(wl, cfg.step.seed, k, cfg.step.batch, n, rank),
            cfg.warmup_steps + cfg.steps)
        model, loss_fn = _model(wl, ops.device(0), cfg.step.seed)
        opt = _optimizer(wl, model, loss_fn)
        model.train()
        ids = cfg.devices if ops.kind == "cuda" else None
        wrapped: Any = kind.wrap(model, loss_fn, _InProcess(ids))
        out.rows = rows
        run.loop(wrapped, loss_fn, opt, batches, kind.loss_inside, out, wl.step)
        run.fold_phases()

    try:
        with watch:
            body()
    except Exception as exc:
        _fail(out, exc, run, cfg)
    ops.release()  # after the except block: the exception, its frames and tensors are gone
    used = len(shards) if kind.scatters_batch else 1
    for i in logical:
        rows_i = kind.rows_of(shards, i) if i < used else 0
        dev = run.device_result(i, rows_i, i < used) if run else DeviceResult(index=i)
        watch.fill(dev, cfg.devices[i])
        result.devices.append(dev)
    worked = [cfg.devices[i] for i in logical] if out.step_times_s else []
    result.notes.extend(watch.notes(worked))
    pid = os.getpid()
    for cuda, used_bytes in sorted(watch.contexts_of(pid).items()):
        if cuda not in cfg.devices:  # e.g. --devices 2,3 and something touched cuda:0
            result.stray_contexts.append(
                {"rank": None, "pid": pid, "cuda_index": cuda, "used_bytes": used_bytes}
            )
            result.notes.append(
                f"this process (pid {pid}) holds a CUDA context on cuda:{cuda}, outside the "
                f"chosen GPUs {cfg.devices}"
            )
    _finish(result, out, cfg, kind.samples_per_step(cfg.step.batch, shards))
    if kind.scatters_batch and len(shards) < n:
        result.notes.append(
            f"batch {cfg.step.batch} over {n} GPUs: tensor.chunk makes {len(shards)} chunk(s) "
            f"{shards}, so DataParallel uses only {len(shards)} GPU(s)"
        )
    return result


class _InProcess:
    """torch's DataParallel over the chosen GPUs (:class:`~dpprof.scenarios.kind.Wrappers`);
    DDP runs in ranks of its own (:func:`measure_ddp_rank`)."""

    def __init__(self, ids: list[int] | None) -> None:
        self.ids = ids

    def data_parallel(self, module: nn.Module) -> nn.DataParallel[nn.Module]:
        ids = self.ids
        return nn.DataParallel(module, device_ids=ids, output_device=ids[0] if ids else None)

    def ddp(self, model: nn.Module) -> Any:
        raise ValueError("DDP runs one process per GPU, not in this process")


def _watch(
    ops: DeviceOps,
    cfg: CudaRunConfig,
    nvml: NvmlBackend | None,
    cuda_uuids: Sequence[str] | None,
    pids: Sequence[int],
) -> NvmlWatch:
    if nvml is None and ops.kind == "cuda":
        nvml = libnvml.default_nvml()
    if cuda_uuids is None and ops.kind == "cuda":
        cuda_uuids = host().uuids()
    return NvmlWatch(nvml, cfg.nvml_interval_s, cuda_uuids, pids)


def _finish(result: ScenarioResult, out: Measured, cfg: CudaRunConfig,
            samples_per_step: int) -> None:
    """Timing, status and OOM fields of ``result`` from ``out``; throughput is the samples
    one step trains (``single``: its ``ceil(B / N)`` rows; DataParallel and DDP: the batch)
    over the median step time."""
    result.status = out.status
    result.message = out.message
    result.loss = out.loss
    result.oom_device = out.oom_device
    result.oom_bytes = out.oom_bytes
    result.oom_phase = out.oom_phase
    result.notes.extend(out.notes)
    result.step_times_s = list(out.step_times_s)
    if out.step_times_s:
        result.step_time_s = statistics.median(out.step_times_s)
        result.step_time_spread_s = max(out.step_times_s) - min(out.step_times_s)
        result.throughput_samples_per_s = samples_per_step / result.step_time_s
    if out.event_times_s:
        result.event_step_time_s = statistics.median(out.event_times_s)
    if out.traceback and (out.status == STATUS_ERROR or cfg.debug):
        result.traceback = out.traceback


# --------------------------------------------------------------------------- DDP, one rank


def measure_ddp_rank(
    wl: Workload,
    cfg: CudaRunConfig,
    rank: int,
    world: int,
    local_device: int,
    ops: DeviceOps | None = None,
    nvml: NvmlBackend | None = None,
    cuda_uuids: Sequence[str] | None = None,
    visible: Sequence[int] | None = None,
) -> Measured:
    """Measure this rank's device under ``DistributedDataParallel`` (process group set up).

    The caller (:mod:`dpprof.backends.ranks`) has called ``torch.cuda.set_device(local_device)``
    and ``init_process_group``. ``visible``: the CUDA indices to watch for stray contexts of
    this process (default: every visible GPU). DDP's options are ``cfg.step.ddp``. Never
    raises.
    """
    ops = ops or host().ops([local_device])
    out = Measured(rank=rank)
    pid = os.getpid()
    watch = _watch(ops, cfg, nvml, cuda_uuids, [pid])
    run: _Run | None = None
    per = math.ceil(cfg.step.batch / world)
    def body() -> None:  # its frame holds the tensors: gone with the exception
        nonlocal run
        run = _Run(ops, cfg, [0], watch)
        batches = StepBatches(
            lambda k: scenario_batch(wl, cfg.step.seed, k, cfg.step.batch, world, rank),
            cfg.warmup_steps + cfg.steps)
        model, loss_fn = _model(wl, ops.device(0), cfg.step.seed)
        model.train()
        ids = [local_device] if ops.kind == "cuda" else None
        wrapped = cfg.step.ddp.wrap(model, ids)
        opt = _optimizer(wl, model, loss_fn)
        out.rows = per
        run.loop(wrapped, loss_fn, opt, batches, False, out, wl.step)
        run.fold_phases()

    try:
        with watch:
            body()
    except Exception as exc:
        _fail(out, exc, run, cfg)
        if out.status == STATUS_OOM:
            out.oom_device = rank
    ops.release()
    dev = run.device_result(0, per, True) if run else DeviceResult(index=0)
    dev.index = rank
    dev.rank = rank
    dev.cuda_index = local_device if ops.kind == "cuda" else None
    dev.node = socket.gethostname()
    watch.fill(dev, local_device)
    out.devices = [dev]
    strays = {
        cuda: used
        for cuda, used in watch.contexts_of(pid).items()
        if cuda != local_device and (visible is None or cuda in visible)
    }
    for cuda, used in sorted(strays.items()):
        out.stray_contexts.append(
            {"rank": rank, "pid": pid, "cuda_index": cuda, "used_bytes": used}
        )
        out.notes.append(
            f"rank {rank} (pid {pid}) holds a CUDA context on cuda:{cuda}"
            + (f" ({fmt_bytes(used)})" if used else "")
            + f", not only on its own cuda:{local_device}: call torch.cuda.set_device("
            "local_rank) before anything touches CUDA"
        )
    out.notes.extend(watch.notes([local_device] if out.step_times_s else []))
    return out


def ddp_scenario(outcomes: Sequence[Measured], cfg: CudaRunConfig, world: int) -> ScenarioResult:
    """The ``ddp`` result from every rank's :class:`Measured` (rank order)."""
    result = ScenarioResult(name=DDP, batch=cfg.step.batch)
    merged = Measured()
    failed = [o for o in outcomes if o.status != STATUS_OK]
    first = next(
        (o for o in failed if o.first_failure),
        next((o for o in failed if o.status == STATUS_OOM), failed[0] if failed else None),
    )
    for o in sorted(outcomes, key=lambda o: o.rank or 0):
        result.devices.extend(o.devices)
        result.stray_contexts.extend(o.stray_contexts)
        for note in o.notes:
            if note not in result.notes:
                result.notes.append(note)
    ok = [o for o in outcomes if o.step_times_s]
    if ok and not failed:
        # a DDP step ends when the slowest rank's does: median over steps of the max over ranks
        steps = min(len(o.step_times_s) for o in ok)
        merged.step_times_s = [max(o.step_times_s[k] for o in ok) for k in range(steps)]
        events = [o for o in ok if o.event_times_s]
        if events:
            n_ev = min(len(o.event_times_s) for o in events)
            merged.event_times_s = [max(o.event_times_s[k] for o in events) for k in range(n_ev)]
        losses = [o.loss for o in ok if o.loss is not None]
        merged.loss = statistics.fmean(losses) if losses else None
    if first is not None:
        merged.status = first.status
        merged.message = f"rank {first.rank}: {first.message}"
        merged.oom_device = first.oom_device
        merged.oom_bytes = first.oom_bytes
        merged.oom_phase = first.oom_phase
        merged.traceback = first.traceback
        others = [o for o in failed if o is not first]
        if others:
            merged.notes.append(
                "then: " + "; ".join(f"rank {o.rank}: {o.message[:160]}" for o in others)
            )
    _finish(result, merged, cfg, cfg.step.batch)  # DistributedSampler's pad rows repeat
    if first is not None and first.traceback:
        result.traceback = first.traceback
    batch = cfg.step.batch
    if batch % world:
        result.notes.append(
            f"each rank gets ceil({batch} / {world}) = {math.ceil(batch / world)} rows "
            "(DistributedSampler pads)"
        )
    return result
