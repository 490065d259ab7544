"""A small catalog of common GPUs and a model of what the CUDA context and libraries cost.

Memory figures
--------------
``GpuSpec.total_memory_bytes`` is what ``torch.cuda.get_device_properties(i).total_memory``
reports (``cudaDeviceProp.totalGlobalMem``), which is also the "total capacity" in PyTorch's
out-of-memory message. It is below the marketed size ("80 GB" is 80e9 B, or a round number of
GiB) and below NVML's total (``nvidia-smi``), because the driver keeps some memory for itself
(0.35 to 0.75 GiB on the boards below; it varies with the driver version and with ECC).
Each entry says where its figure comes from (``memory_source``):

- where an out-of-memory message for that GPU was found in a public issue, its "total
  capacity" (two decimals of GiB, so +-5 MiB; drivers move it by up to ~0.1 GiB) is used;
- otherwise (``estimated=True``) NVML's total minus 0.5 GiB, the typical gap seen on the
  boards that have both figures.

``nvml_total_bytes`` is NVML's total: from Modal's published ``nvidia-smi`` table
(modal-labs/modal-client PR 2797, thundergolfer.com/blog/nvidia-gpu-memory-capacity) where
it lists the GPU, otherwise the value ``nvidia-smi`` commonly shows for the board.

Context and workspaces
----------------------
:func:`context_overhead` models what a process pays on a device beyond the caching
allocator's segments (the CUDA context, library code) and which library workspaces the
allocator itself serves (cuBLAS / cuBLASLt workspaces), with the assumptions spelled out.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from dpprof.emulator.allocator import simulate
from dpprof.emulator.vdevice import EventLog

__all__ = [
    "CUBLAS_HANDLES_PER_DEVICE",
    "GPUS",
    "ContextModel",
    "DeviceFigures",
    "GpuSpec",
    "context_overhead",
    "cublas_workspace_size",
    "cublaslt_workspace_size",
    "device_context",
    "fill_gpu_overheads",
    "gpu_model_notes",
    "known_gpus",
    "lookup_gpu",
]

_MiB = 1024 * 1024
_GiB = 1024 * _MiB


def _gib(x: float) -> int:
    """GiB with two decimals (as PyTorch prints them) to bytes, rounded to whole MiB."""
    return round(x * 1024) * _MiB


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model. Bytes are bytes."""

    key: str  # the catalog name, e.g. "a100-80gb"
    name: str  # the device name as CUDA reports it
    total_memory_bytes: int  # torch.cuda.get_device_properties().total_memory
    nvml_total_bytes: int  # nvidia-smi / NVML total
    marketed_gb: int  # the number on the box ("80 GB")
    compute_capability: tuple[int, int]
    generation: str  # architecture name
    memory_source: str  # where total_memory_bytes comes from
    estimated: bool = False  # True: total_memory_bytes estimated from NVML's total
    aliases: tuple[str, ...] = ()

    @property
    def driver_reserved_bytes(self) -> int:
        """NVML's total minus what CUDA reports: memory the driver keeps."""
        return self.nvml_total_bytes - self.total_memory_bytes


_EST = "estimated: NVML total minus 0.5 GiB (typical driver reservation on comparable boards)"

GPUS: dict[str, GpuSpec] = {
    s.key: s
    for s in (
        GpuSpec(
            "a100-80gb",
            "NVIDIA A100-SXM4-80GB",
            _gib(79.25),
            81920 * _MiB,
            80,
            (8, 0),
            "Ampere",
            "OOM message '79.25 GiB total capacity' (levihsu/OOTDiffusion issue 235); "
            "A800-80GB shows 79.33 GiB on other drivers",
            aliases=("a100-sxm4-80gb", "a100-pcie-80gb", "a100-80g", "a100 80gb"),
        ),
        GpuSpec(
            "a100-40gb",
            "NVIDIA A100-SXM4-40GB",
            _gib(39.50),
            40960 * _MiB,
            40,
            (8, 0),
            "Ampere",
            "OOM message 'total capacity of 39.50 GiB' on one A100 40GB (TianheWu/CoSeR issue 10)",
            aliases=("a100-sxm4-40gb", "a100-pcie-40gb", "a100-40g"),
        ),
        GpuSpec(
            "h100-80gb",
            "NVIDIA H100 80GB HBM3",
            _gib(79.11),
            81559 * _MiB,
            80,
            (9, 0),
            "Hopper",
            "OOM message 'total capacity of 79.11 GiB' on H100 (vllm-project/vllm issue 27508)",
            aliases=("h100", "h100-sxm", "h100-sxm5-80gb", "h100-80gb-hbm3", "h100-pcie"),
        ),
        GpuSpec(
            "h200",
            "NVIDIA H200",
            _gib(139.90),
            143771 * _MiB,
            141,
            (9, 0),
            "Hopper",
            _EST,
            estimated=True,
            aliases=("h200-141gb", "h200-sxm", "h200-nvl"),
        ),
        GpuSpec(
            "v100-16gb",
            "Tesla V100-SXM2-16GB",
            _gib(15.75),
            16160 * _MiB,
            16,
            (7, 0),
            "Volta",
            "OOM message '15.75 GiB total capacity' on a 16 GB card (Morizeyao/GPT2-Chinese "
            "issue 215); NVML 16160 MiB",
            aliases=("v100-sxm2-16gb", "v100-pcie-16gb"),
        ),
        GpuSpec(
            "v100-32gb",
            "Tesla V100-SXM2-32GB",
            _gib(31.74),
            32510 * _MiB,
            32,
            (7, 0),
            "Volta",
            "OOM message '31.74 GiB total capacity' on 8x V100 (haotian-liu/LLaVA issue 812)",
            aliases=("v100-sxm2-32gb", "v100-pcie-32gb", "v100s", "v100s-32gb"),
        ),
        GpuSpec(
            "a10g",
            "NVIDIA A10G",
            _gib(21.99),
            23028 * _MiB,
            24,
            (8, 6),
            "Ampere",
            "OOM message 'total capacity of 21.99 GiB' on an A10 (zai-org/CogVLM issue 236); "
            "A10 and A10G both show 23028 MiB in NVML",
            aliases=("a10", "a10-24gb", "a10g-24gb"),
        ),
        GpuSpec(
            "l4",
            "NVIDIA L4",
            _gib(21.99),
            23034 * _MiB,
            24,
            (8, 9),
            "Ada Lovelace",
            _EST,
            estimated=True,
            aliases=("l4-24gb",),
        ),
        GpuSpec(
            "t4",
            "Tesla T4",
            _gib(14.58),
            15360 * _MiB,
            16,
            (7, 5),
            "Turing",
            "OOM message 'total capacity of 14.58 GiB' on T4, driver 535.183 "
            "(mbzuai-oryx/GeoPixel issue 5); older drivers showed 14.75 GiB",
            aliases=("tesla-t4", "t4-16gb"),
        ),
        GpuSpec(
            "rtx-3090",
            "NVIDIA GeForce RTX 3090",
            _gib(23.70),
            24576 * _MiB,
            24,
            (8, 6),
            "Ampere",
            "OOM message '23.70 GiB total capacity' on RTX 3090 (GaoLii/DSP issue 10, "
            "xiaoxiangAQ/GAS-Net issue 7)",
            aliases=("3090", "rtx3090", "geforce-rtx-3090"),
        ),
        GpuSpec(
            "rtx-4090",
            "NVIDIA GeForce RTX 4090",
            _gib(23.64),
            24564 * _MiB,
            24,
            (8, 9),
            "Ada Lovelace",
            "OOM message 'total capacty of 23.64 GiB' on RTX 4090 (3DTopia/Phidias-Diffusion "
            "issue 8); older drivers showed 23.65-23.68 GiB",
            aliases=("4090", "rtx4090", "geforce-rtx-4090"),
        ),
        GpuSpec(
            "a6000",
            "NVIDIA RTX A6000",
            _gib(47.49),
            49140 * _MiB,
            48,
            (8, 6),
            "Ampere",
            _EST,
            estimated=True,
            aliases=("rtx-a6000", "rtxa6000", "a6000-48gb"),
        ),
        GpuSpec(
            "l40s",
            "NVIDIA L40S",
            _gib(44.53),
            46068 * _MiB,
            48,
            (8, 9),
            "Ada Lovelace",
            "OOM message 'total capacity of 44.53 GiB' on L40S (Wan-Video/Wan2.1 issue 205)",
            aliases=("l40s-48gb",),
        ),
    )
}


def _norm(name: str) -> str:
    s = name.strip().lower()
    s = re.sub(r"^(nvidia|tesla|geforce)[\s_-]+", "", s)
    s = re.sub(r"^(tesla|geforce)[\s_-]+", "", s)
    return re.sub(r"[\s_]+", "-", s)


_INDEX: dict[str, str] = {}
for _spec in GPUS.values():
    for _n in (_spec.key, _spec.name, *_spec.aliases):
        _INDEX.setdefault(_norm(_n), _spec.key)


def known_gpus() -> list[str]:
    """The catalog's names, sorted."""
    return sorted(GPUS)


def lookup_gpu(name: str) -> GpuSpec:
    """The :class:`GpuSpec` for a catalog name, an alias or a CUDA device name.

    Case, spaces and underscores do not matter; ``"NVIDIA A100-SXM4-80GB"``, ``"a100_80gb"``
    and ``"A100-80GB"`` all find ``a100-80gb``. Raises ``KeyError`` naming the known GPUs.
    """
    key = _INDEX.get(_norm(str(name)))
    if key is None:
        raise KeyError(
            f"unknown GPU {name!r}; known GPUs: {', '.join(known_gpus())} "
            "(or give the memory instead, e.g. --gpu-memory 80GiB)"
        )
    return GPUS[key]


# --------------------------------------------------------------------------- the context

# PyTorch PR 86509 (CUDA_MODULE_LOADING=LAZY by default): after
# torch.randn(20, 16, 50, 100).cuda(), total - free = 287,047,680 B with lazy loading and
# 666,632,192 B with eager loading. That tensor (6.4 MB) sits in a 20 MiB segment of the
# caching allocator, so the context itself is 20 MiB less.
_PR86509_LAZY = 287_047_680
_PR86509_EAGER = 666_632_192
CUDA_CONTEXT_LAZY_BYTES = _PR86509_LAZY - 20 * _MiB  # 266,076,160 B = 253.75 MiB
CUDA_CONTEXT_EAGER_BYTES = _PR86509_EAGER - 20 * _MiB  # 645,660,672 B = 615.75 MiB

# Assumptions without a measurement to cite (override them through context_overhead()).
CUDNN_LIBRARY_LAZY_BYTES = 64 * _MiB
CUDNN_LIBRARY_EAGER_BYTES = 512 * _MiB
CUDNN_WORKSPACE_BYTES = 128 * _MiB

# aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize():
# ":4096:2:16:8 default, 32MiB for Hopper and Blackwell"
_CUBLAS_DEFAULT_OLD = 4096 * 1024 * 2 + 16 * 1024 * 8  # 8,519,680 B = 8.125 MiB
_CUBLAS_DEFAULT_32MB = 4096 * 8 * 1024  # 33,554,432 B
_CUBLAS_32MB_MAJORS = (9, 10, 11, 12)


def compute_capability_of(spec_or_cc: GpuSpec | tuple[int, int] | str) -> tuple[int, int]:
    """A compute capability from a spec, a (major, minor) pair, "8.6", "sm_90" or a name."""
    if isinstance(spec_or_cc, GpuSpec):
        return spec_or_cc.compute_capability
    if isinstance(spec_or_cc, str):
        text = spec_or_cc.strip().lower()
        m = re.fullmatch(r"(\d+)\.(\d+)", text) or re.fullmatch(r"sm_?(\d+)(\d)", text)
        if m:
            return int(m.group(1)), int(m.group(2))
        return lookup_gpu(spec_or_cc).compute_capability
    major, minor = spec_or_cc
    return int(major), int(minor)


def _parse_cublas_config(text: str) -> int:
    """``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT`` pairs) to bytes, as PyTorch sums it."""
    pairs = re.findall(r":([0-9]+):([0-9]+)", text)
    if not pairs:
        raise ValueError(
            f"cannot parse CUBLAS_WORKSPACE_CONFIG {text!r}; expected ':SIZE:COUNT' pairs, "
            "e.g. ':4096:8'"
        )
    return sum(int(size) * 1024 * int(count) for size, count in pairs)


def cublas_workspace_size(
    spec_or_cc: GpuSpec | tuple[int, int] | str, cublas_workspace_config: str | None = None
) -> int:
    """``getChosenWorkspaceSize()``: bytes of one cuBLAS workspace (one per handle and stream).

    32 MiB on compute capability 9.x-12.x (Hopper, Blackwell), else ``:4096:2:16:8`` =
    2 x 4 MiB + 8 x 16 KiB = 8,519,680 B; ``CUBLAS_WORKSPACE_CONFIG`` overrides it.
    """
    if cublas_workspace_config:
        return _parse_cublas_config(cublas_workspace_config)
    major, _ = compute_capability_of(spec_or_cc)
    return _CUBLAS_DEFAULT_32MB if major in _CUBLAS_32MB_MAJORS else _CUBLAS_DEFAULT_OLD


def cublaslt_workspace_size(
    *, unified: bool = True, cublaslt_workspace_kib: int | None = None
) -> int:
    """Bytes of a cuBLASLt workspace of its own (``getCUDABlasLtWorkspaceSize()``).

    Unified (``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` unset, the default outside fbcode) cuBLASLt
    uses the cuBLAS workspace of the same handle and stream: 0 extra bytes. Otherwise it gets
    its own ``CUBLASLT_WORKSPACE_SIZE`` KiB (default 1024 KiB on every compute capability in
    CUDA builds; 76 MiB is the ROCm default).
    """
    if unified:
        return 0
    kib = 1024 if cublaslt_workspace_kib is None else cublaslt_workspace_kib
    return kib * 1024


@dataclass
class ContextModel:
    """What a process costs on one device besides its tensors. Bytes are bytes.

    ``outside_allocator_bytes`` is memory NVML sees but ``torch.cuda.memory_reserved()``
    does not (context, library code); ``allocator_requests`` are long-lived allocations the
    caching allocator serves (workspaces), ``transient_allocator_requests`` short-lived ones
    (cuDNN convolution workspace), both to be added to the device's allocation events.
    """

    compute_capability: tuple[int, int]
    cuda_context_bytes: int
    cudnn_library_bytes: int
    cublas_workspace_bytes: int  # one workspace
    cublas_workspaces: int  # handles x streams
    cublaslt_workspace_bytes: int  # one separate cuBLASLt workspace (0 when unified)
    cublaslt_workspaces: int
    cudnn_workspace_bytes: int  # transient, per convolution call
    workspace_reserved_bytes: int  # segments the long-lived workspaces take on their own
    assumptions: list[str] = field(default_factory=list)

    @property
    def outside_allocator_bytes(self) -> int:
        return self.cuda_context_bytes + self.cudnn_library_bytes

    @property
    def allocator_requests(self) -> list[int]:
        return [self.cublas_workspace_bytes] * self.cublas_workspaces + [
            self.cublaslt_workspace_bytes
        ] * (self.cublaslt_workspaces if self.cublaslt_workspace_bytes else 0)

    @property
    def transient_allocator_requests(self) -> list[int]:
        return [self.cudnn_workspace_bytes] if self.cudnn_workspace_bytes else []

    @property
    def workspace_bytes(self) -> int:
        """Bytes the long-lived workspaces ask for (before the allocator rounds them)."""
        return sum(self.allocator_requests)

    @property
    def total_bytes(self) -> int:
        """Context + library code + the segments the workspaces take when alone."""
        return self.outside_allocator_bytes + self.workspace_reserved_bytes

    def components(self) -> dict[str, int]:
        """Per component bytes, for a report's breakdown."""
        return {
            "cuda_context": self.cuda_context_bytes,
            "cudnn_library": self.cudnn_library_bytes,
            "cublas_workspaces": self.cublas_workspace_bytes * self.cublas_workspaces,
            "cublaslt_workspaces": self.cublaslt_workspace_bytes * self.cublaslt_workspaces,
            "cudnn_workspace_transient": self.cudnn_workspace_bytes,
        }


def context_overhead(
    spec_or_cc: GpuSpec | tuple[int, int] | str,
    *,
    lazy_loading: bool = True,
    uses_cudnn: bool = False,
    cublas_handles: int = 1,
    streams: int = 1,
    cublaslt_unified: bool = True,
    cublas_workspace_config: str | None = None,
    cublaslt_workspace_kib: int | None = None,
    cuda_context_bytes: int | None = None,
    cudnn_library_bytes: int | None = None,
    cudnn_workspace_bytes: int | None = None,
) -> ContextModel:
    """Model the CUDA context and library workspaces on one device.

    ``spec_or_cc`` is a :class:`GpuSpec`, a catalog name, or a compute capability
    (``(8, 0)``, ``"8.0"``, ``"sm_90"``). ``cublas_handles`` counts the threads that run cuBLAS
    on the device (PyTorch keeps one handle per thread and device: under DataParallel, the
    parallel_apply worker thread and the autograd engine's device thread each have one),
    ``streams`` the streams each handle runs on; one workspace per (handle, stream).
    """
    if cublas_handles < 0 or streams < 1:
        raise ValueError("cublas_handles must be >= 0 and streams >= 1")
    cc = compute_capability_of(spec_or_cc)
    assumptions: list[str] = []

    if cuda_context_bytes is None:
        cuda_context_bytes = CUDA_CONTEXT_LAZY_BYTES if lazy_loading else CUDA_CONTEXT_EAGER_BYTES
        assumptions.append(
            "CUDA context: {:.0f} MiB with {} module loading, from PyTorch PR 86509 "
            "(287,047,680 B lazy / 666,632,192 B eager used after one 6.4 MB tensor, less the "
            "20 MiB segment holding it); reports range from ~250 to ~400 MiB with the GPU, "
            "driver and CUDA version; memory outside the caching allocator".format(
                cuda_context_bytes / _MiB, "lazy" if lazy_loading else "eager"
            )
        )
    else:
        assumptions.append(f"CUDA context: {cuda_context_bytes} B as given")

    if not uses_cudnn:
        cudnn_library_bytes = 0
        cudnn_workspace_bytes = 0
    else:
        if cudnn_library_bytes is None:
            cudnn_library_bytes = (
                CUDNN_LIBRARY_LAZY_BYTES if lazy_loading else CUDNN_LIBRARY_EAGER_BYTES
            )
            assumptions.append(
                f"cuDNN library code and handle: {cudnn_library_bytes // _MiB} MiB, an "
                "assumption (no measurement cited); kernels load into the context on first "
                "use, outside the caching allocator"
            )
        if cudnn_workspace_bytes is None:
            cudnn_workspace_bytes = CUDNN_WORKSPACE_BYTES
            assumptions.append(
                f"cuDNN convolution workspace: {cudnn_workspace_bytes // _MiB} MiB at the "
                "largest convolution, an assumption; it is taken from the caching allocator "
                "for the call and freed after it, its real size depends on the algorithm "
                "(larger with torch.backends.cudnn.benchmark) and CUDNN_CONV_WSCAP_DBG caps it"
            )

    cublas_ws = cublas_workspace_size(cc, cublas_workspace_config)
    n_ws = cublas_handles * streams
    assumptions.append(
        f"cuBLAS workspace: {cublas_ws} B per (handle, stream), {n_ws} of them; "
        "getChosenWorkspaceSize() in aten/src/ATen/cuda/CublasHandlePool.cpp: 32 MiB on "
        "compute capability 9.x-12.x, else :4096:2:16:8 = 8,519,680 B"
        + (" (CUBLAS_WORKSPACE_CONFIG given)" if cublas_workspace_config else "")
        + "; allocated through the CUDA caching allocator by setWorkspaceForHandle() on the "
        "handle's first use and kept for the process, so it counts in memory_reserved() "
        "and memory_allocated(), not in the context (torch 2.13; newer trees make this "
        "caching opt-in with TORCH_CUBLAS_WORKSPACE_CACHE=1 and otherwise leave cuBLAS its "
        "own default workspace, outside the allocator)"
    )
    lt_ws = cublaslt_workspace_size(
        unified=cublaslt_unified, cublaslt_workspace_kib=cublaslt_workspace_kib
    )
    if cublaslt_unified:
        assumptions.append(
            "cuBLASLt workspace: shares the cuBLAS workspace of the same handle and stream "
            "(TORCH_CUBLASLT_UNIFIED_WORKSPACE unset, the default outside fbcode), no extra bytes"
        )
    else:
        assumptions.append(
            f"cuBLASLt workspace: {lt_ws} B per (handle, stream), its own allocation from the "
            "caching allocator (CUBLASLT_WORKSPACE_SIZE, default 1024 KiB)"
        )

    requests = [cublas_ws] * n_ws + ([lt_ws] * n_ws if lt_ws else [])
    events = [("alloc", i, size) for i, size in enumerate(requests)]
    reserved = simulate(events, timeline_points=None).peak_reserved_bytes if events else 0

    return ContextModel(
        compute_capability=cc,
        cuda_context_bytes=cuda_context_bytes,
        cudnn_library_bytes=cudnn_library_bytes or 0,
        cublas_workspace_bytes=cublas_ws,
        cublas_workspaces=n_ws,
        cublaslt_workspace_bytes=lt_ws,
        cublaslt_workspaces=n_ws if lt_ws else 0,
        cudnn_workspace_bytes=cudnn_workspace_bytes or 0,
        workspace_reserved_bytes=reserved,
        assumptions=assumptions,
    )


# ---- the one model of a device's memory outside the tensors ---------------------------------
# Every emulated figure of reserved memory and context comes from here (meta, --compute,
# --count-reserved, --maxbatch): the caching allocator simulated over the device's own
# allocation sequence, the long-lived cuBLAS workspaces first, and the context beside it.

CUBLAS_HANDLES_PER_DEVICE = 2  # the forward's thread and the autograd engine's device thread


def device_context(compute_capability: tuple[int, int], uses_cudnn: bool) -> ContextModel:
    """The context/workspace model of one device of the target GPU running a model."""
    return context_overhead(compute_capability, uses_cudnn=uses_cudnn,
                            cublas_handles=CUBLAS_HANDLES_PER_DEVICE)


class AllocationEvent(Protocol):
    """What the model reads of an emulated allocation (``VirtualDevices.events``)."""

    @property
    def device(self) -> int: ...  # < 0: a host storage

    @property
    def serial(self) -> int: ...

    @property
    def requested(self) -> int: ...  # > 0: an allocation of that size, < 0: a free


class DeviceFigures(Protocol):
    index: int
    used: bool
    rank: int | None  # DDP: the rank, else None
    peak_reserved_bytes: int | None
    workspace_bytes: int | None
    context_bytes: int | None
    context_breakdown_bytes: dict[str, int]


def fill_gpu_overheads(devices: Sequence[DeviceFigures], events: Iterable[AllocationEvent],
                       ctx: ContextModel,
                       source: Callable[[DeviceFigures], int] | None = None) -> None:
    """Per used device: the caching allocator's reserve (a simulation of its pools over the
    device's allocation sequence, cuBLAS workspaces included) and the context.

    ``source``: the event log's device whose sequence a result's device stands for
    (default: its index; DDP ranks: rank 0's device; a mirror: the device it mirrors).
    """
    workspaces = [("alloc", -1 - k, size) for k, size in enumerate(ctx.allocator_requests)]
    sequences = _DeviceSequences(events)
    simulated: dict[Any, Any] = {}  # one simulation per distinct sequence
    keys: dict[int, Any] = {}
    for d in devices:
        if not d.used:
            continue
        src = source(d) if source is not None else d.index
        key = keys.get(src)
        if key is None:
            key = keys[src] = sequences.key(src)
        stats = simulated.get(key)
        if stats is None:
            stats = simulated[key] = simulate(workspaces + sequences.sequence(src),
                                              timeline_points=None, stop_on_oom=False)
        d.peak_reserved_bytes = stats.peak_reserved_bytes
        d.workspace_bytes = ctx.workspace_bytes
        d.context_bytes = ctx.outside_allocator_bytes
        d.context_breakdown_bytes = {k: v for k, v in ctx.components().items()
                                     if v and k in ("cuda_context", "cudnn_library")}


class _DeviceSequences:
    """Each device's allocation sequence (host storages and 0-byte storages left out: they
    take no block) as ("alloc" | "free", serial, bytes) rows, and a key per sequence equal
    for two devices exactly when their sequences are equal up to the names of their
    storages (DataParallel's replicas on equal shards, DDP's ranks): they simulate alike.
    Over an :class:`EventLog` the columns are read as arrays, so the cost of a device's key
    is not a Python step per event."""

    def __init__(self, events: Iterable[AllocationEvent]) -> None:
        if isinstance(events, EventLog):
            dev = events.column("device")
            req = events.column("requested")
            keep = (dev >= 0) & (req != 0)
            self.device, self.serial, self.requested = (
                dev[keep], events.column("serial")[keep], req[keep])
        else:
            rows = [(ev.device, ev.serial, ev.requested) for ev in events
                    if ev.device >= 0 and ev.requested != 0]
            self.device, self.serial, self.requested = (
                np.array([r[i] for r in rows], dtype=np.int64) for i in range(3))
        self._rows: dict[int, np.ndarray] = {}

    def _of(self, device: int) -> np.ndarray:
        rows = self._rows.get(device)
        if rows is None:
            rows = self._rows[device] = np.flatnonzero(self.device == device)
        return rows

    def key(self, device: int) -> tuple[bytes, bytes]:
        """The sequence with its serials renumbered in order of first appearance."""
        rows = self._of(device)
        serials = self.serial[rows]
        _, first, inverse = np.unique(serials, return_index=True, return_inverse=True)
        rank = np.empty(len(first), dtype=np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(len(first), dtype=np.int64)
        sizes = self.requested[rows]
        # (kind, bytes) as one number: an allocation's size, or -1 for a free
        return (np.where(sizes > 0, sizes, -1).tobytes(), rank[inverse.reshape(-1)].tobytes())

    def sequence(self, device: int) -> list[tuple[str, int, int]]:
        rows = self._of(device)
        return [("alloc", serial, size) if size > 0 else ("free", serial, 0)
                for serial, size in zip(self.serial[rows].tolist(),
                                        self.requested[rows].tolist(), strict=True)]


def gpu_model_notes(ctx: ContextModel) -> list[str]:
    """The assumptions behind reserved and context figures, for the report."""
    return [
        "reserved: dpprof.emulator.allocator's simulation of the CUDA caching allocator (512 B "
        "rounding, 1 MiB small / large pools, 2 / 20 MiB segments, best-fit splitting and "
        "merging, one stream) over this device's emulated allocation sequence, with "
        f"{CUBLAS_HANDLES_PER_DEVICE} cuBLAS workspaces (forward thread + autograd thread) "
        "allocated first",
        *ctx.assumptions,
    ]
