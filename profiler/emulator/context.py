"""What the CUDA context and libraries cost on a device, beside the tensors.

:func:`context_overhead` models what a process pays on a device beyond the caching
allocator's segments (the CUDA context, library code) and which library workspaces the
allocator itself serves (cuBLAS / cuBLASLt workspaces), with the assumptions spelled out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dpprof.emulator import calibration, cudnn_workspace
from dpprof.emulator.allocator_replay import simulate
from dpprof.emulator.catalog import GpuSpec, compute_capability_of, peak_rates_of
from dpprof.emulator.nccl_memory import (
    FIXED_BYTES,
    NcclRankMemory,
    NcclSettings,
    nccl_clique_memory,
    nccl_rank_memory,
)

__all__ = [
    "CUBLAS_HANDLES_PER_DEVICE",
    "MEASURED_CUDA_CONTEXT_BYTES",
    "MEASURED_CUDNN_LIBRARY_BYTES",
    "NCCL_RANK_BYTES",
    "ContextModel",
    "context_overhead",
    "cublas_workspace_size",
    "cublaslt_workspace_size",
    "device_context",
    "gpu_model_notes",
    "link_of",
]

_MiB = 1024 * 1024

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

# aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize():
# ":4096:2:16:8 default, 32MiB for Hopper and Blackwell"
_CUBLAS_DEFAULT_OLD = 4096 * 1024 * 2 + 16 * 1024 * 8  # 8,519,680 B = 8.125 MiB
_CUBLAS_DEFAULT_32MB = 4096 * 8 * 1024  # 33,554,432 B
_CUBLAS_32MB_MAJORS = (9, 10, 11, 12)



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
    # what a DDP rank's NCCL communicator holds outside the allocator (its library code and
    # buffers), added to DDP ranks' context only: the high end of the model's range
    # (dpprof.emulator.nccl_memory); the range itself is stated in the assumptions
    nccl_bytes: int = 0

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
    cublaslt_handles: int | None = None,
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
    ``cublaslt_handles``: the (handle, stream) pairs that run cuBLASLt (``addmm`` with a bias:
    a Linear's forward, not its backward); default every cuBLAS one.
    """
    if cublas_handles < 0 or streams < 1:
        raise ValueError("cublas_handles must be >= 0 and streams >= 1")
    cc = compute_capability_of(spec_or_cc)
    assumptions: list[str] = []

    ctx_bytes = _cuda_context(cuda_context_bytes, lazy_loading, assumptions)
    lib_bytes, cudnn_ws_bytes = _cudnn(uses_cudnn, lazy_loading, cudnn_library_bytes,
                                       cudnn_workspace_bytes, assumptions)
    cublas_ws, n_ws = _cublas_workspaces(cc, cublas_workspace_config, cublas_handles, streams,
                                         assumptions)
    lt_ws = _cublaslt_workspace(cublaslt_unified, cublaslt_workspace_kib, assumptions)
    n_lt = n_ws if cublaslt_handles is None else cublaslt_handles
    requests = [cublas_ws] * n_ws + ([lt_ws] * n_lt if lt_ws else [])
    events = [("alloc", i, size) for i, size in enumerate(requests)]
    reserved = simulate(events, timeline_points=None).peak_reserved_bytes if events else 0

    return ContextModel(
        compute_capability=cc,
        cuda_context_bytes=ctx_bytes,
        cudnn_library_bytes=lib_bytes or 0,
        cublas_workspace_bytes=cublas_ws,
        cublas_workspaces=n_ws,
        cublaslt_workspace_bytes=lt_ws,
        cublaslt_workspaces=n_lt if lt_ws else 0,
        cudnn_workspace_bytes=cudnn_ws_bytes or 0,
        workspace_reserved_bytes=reserved,
        assumptions=assumptions,
    )


def _cuda_context(cuda_context_bytes: int | None, lazy_loading: bool,
                  assumptions: list[str]) -> int:
    """The CUDA context's bytes (given, or the measured default for the loading mode)."""
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

    return cuda_context_bytes


def _cudnn(uses_cudnn: bool, lazy_loading: bool, cudnn_library_bytes: int | None,
           cudnn_workspace_bytes: int | None, assumptions: list[str]
           ) -> tuple[int | None, int | None]:
    """cuDNN's library and convolution workspace bytes (none without convolutions)."""
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
            cudnn_workspace_bytes = 0  # per convolution, in the allocation sequence
            assumptions.append(
                "cuDNN convolution workspace: taken from the caching allocator at each "
                "convolution and freed after it, counted in allocated there; its size, the "
                "engine's that cuDNN's heuristics pick, estimated from the input, output and "
                f"weight bytes as {cudnn_workspace.MEASURED_ON} measured them "
                "(dpprof.emulator.cudnn_workspace); other GPUs and cuDNN versions pick other "
                "engines"
            )

    return cudnn_library_bytes, cudnn_workspace_bytes


def _cublas_workspaces(cc: tuple[int, int], cublas_workspace_config: str | None,
                       cublas_handles: int, streams: int,
                       assumptions: list[str]) -> tuple[int, int]:
    """cuBLAS's workspace bytes per (handle, stream), and how many there are."""
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
    return cublas_ws, n_ws


def _cublaslt_workspace(cublaslt_unified: bool, cublaslt_workspace_kib: int | None,
                        assumptions: list[str]) -> int:
    """cuBLASLt's own workspace bytes per (handle, stream) (0: it shares cuBLAS's)."""
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

    return lt_ws



CUBLAS_HANDLES_PER_DEVICE = 2  # the forward's thread and the autograd engine's device thread

# Measured on a real GPU (an NVIDIA H100 80GB HBM3, driver 580.159.04, CUDA 13.0, torch
# 2.11.0+cu130, 2026-11-25; scripts/gpu_attribution.py and dpprof check, mlp at batch 64):
_MEASURED_ON = ("an NVIDIA H100 80GB HBM3 (driver 580.159.04, CUDA 13.0, torch 2.11.0+cu130, "
                "2026-11-25)")
# - the CUDA context once a training step has loaded its kernels: NVML's used memory of the
#   process minus memory_reserved at the step's peak (single and DataParallel alike). The
#   cited PR 86509 figure (254 MiB) is three times too low there.
MEASURED_CUDA_CONTEXT_BYTES: dict[tuple[int, int], int] = {(9, 0): 787_283_968}
# - cuDNN 9.19's code once a convnet's step has run (convnet, batch 32): the same NVML figure
#   minus that context; the assumed 64 MiB was four times too high there.
MEASURED_CUDNN_LIBRARY_BYTES: dict[tuple[int, int], int] = {(9, 0): 16_777_216}
# - a DDP rank (NCCL, world 1) holds this much more outside the allocator than the same step
#   in one process: NCCL's library code and communicator (1,376,583,680 - 787,283,968 B =
#   562 MiB); the high end of NCCL's memory at world 1 (dpprof.emulator.nccl_memory, which
#   models more peers and the NCCL_* settings)
NCCL_RANK_BYTES = FIXED_BYTES[1]
# - the first addmm (a Linear with a bias) grew memory_allocated by 1 MiB beyond the cuBLAS
#   workspace: cuBLASLt's own workspace (CUBLASLT_WORKSPACE_SIZE's 1024 KiB, not unified with
#   cuBLAS's), on the forward's handle only (the backward runs plain mm).
CUBLASLT_HANDLES_PER_DEVICE = 1
# - five fresh DDP ranks (NCCL, world 1: mlp, lm, attention, convnet, classifier) on an NVIDIA
#   H200 (torch 2.11.0+cu130, NCCL 2.28.9; scripts/gpu_measure.py's rank-* parts in
#   tests/data/h200_measured.json): the process's NVML used memory minus memory_reserved
#   after six steps, float32 and bf16, MiB (the convolution models' with cuDNN loaded;
#   attention's bf16 steps loaded 18 MiB more of kernels)
RANK_OUTSIDE_SPREAD_MIB = (1298, 1318)
RANK_OUTSIDE_MEASURED_ON = "an NVIDIA H200 (torch 2.11.0+cu130, NCCL 2.28.9, 2026-11-28)"


def device_context(compute_capability: tuple[int, int], uses_cudnn: bool, *,
                   world_size: int = 1, link: str = "nvlink", gpus_per_node: int | None = None,
                   nccl_env: Mapping[str, str] | None = None) -> ContextModel:
    """The context/workspace model of one device of the target GPU running a model: what
    ``dpprof check --save-calibration`` measured on a GPU of this compute capability
    (:mod:`dpprof.emulator.calibration`), else what was measured on an H100 (above), else the
    cited figures. A rank of a process group over NCCL (``world_size`` ranks,
    ``gpus_per_node`` to a node, else the environment's ``LOCAL_WORLD_SIZE``, else all on one,
    joined by ``link``, ``nccl_env`` the environment its ``NCCL_*`` settings come from) adds
    NCCL's memory (``nccl_bytes``)."""
    local = (nccl_env or {}).get("LOCAL_WORLD_SIZE", "")
    if gpus_per_node is None and local.isdigit():
        gpus_per_node = int(local)
    cc = (int(compute_capability[0]), int(compute_capability[1]))
    found = calibration.load(cc)
    common: dict[str, Any] = {"uses_cudnn": uses_cudnn, "cublas_handles": CUBLAS_HANDLES_PER_DEVICE,
                              "cublaslt_unified": False,
                              "cublaslt_handles": CUBLASLT_HANDLES_PER_DEVICE}
    measured = MEASURED_CUDA_CONTEXT_BYTES.get(cc)
    if found is not None:
        cal, path = found
        # the measured workspace as CUBLAS_WORKSPACE_CONFIG would give it (KiB:count)
        model = context_overhead(
            cc, cuda_context_bytes=cal.cuda_context_bytes,
            cublas_workspace_config=f":{max(cal.cublas_workspace_bytes // 1024, 1)}:1", **common)
        notes = [*model.assumptions, "Calibrated: " + cal.note(path) + "."]
    elif measured is not None:
        model = context_overhead(cc, cuda_context_bytes=measured,
                                 cudnn_library_bytes=MEASURED_CUDNN_LIBRARY_BYTES.get(cc),
                                 **common)
        notes = [a if not a.startswith("CUDA context:") else
                 f"CUDA context: {measured:,} B, NVML's used memory minus memory_reserved at a "
                 f"training step's peak on {_MEASURED_ON}; it grows with the kernels a program "
                 "loads and moves with the driver and CUDA version (`dpprof check "
                 "--save-calibration` measures your own)" for a in model.assumptions]
    else:
        model = context_overhead(cc, **common)
        # the cited figure, with what one real GPU measured beside it: the user can judge
        notes = [a if not a.startswith("CUDA context:") else
                 f"{a}; a training step's context measured {MEASURED_CUDA_CONTEXT_BYTES[(9, 0)]:,}"
                 f" B on {_MEASURED_ON}, three times this: `dpprof check --save-calibration` "
                 "on this GPU measures its own" for a in model.assumptions]
    if found is None and measured is not None and model.cudnn_library_bytes:
        notes.append(f"cuDNN library code and handle: {model.cudnn_library_bytes:,} B, as "
                     f"measured (NVML, outside the allocator) after a convnet's step on "
                     f"{_MEASURED_ON}")
    notes = [a if not a.startswith("cuBLASLt workspace:") else
             f"cuBLASLt workspace: {model.cublaslt_workspace_bytes:,} B on the forward's handle "
             "(addmm), its own allocation beside the cuBLAS workspace, as measured on "
             f"{_MEASURED_ON}" for a in notes]
    nccl = nccl_rank_memory(max(world_size, 1), compute_capability=cc, link=link,
                            gpus_per_node=gpus_per_node,
                            settings=NcclSettings.from_env(nccl_env or {}))
    notes.append(
        f"DDP (and FSDP) ranks: NCCL's memory outside the allocator, {nccl.low_bytes:,}-"
        f"{nccl.high_bytes:,} B a rank at world size {world_size} (the high end counted): "
        + "; ".join(nccl.notes) + ". A rank's memory outside the allocator (context, cuBLAS, "
        f"NCCL) measured {RANK_OUTSIDE_SPREAD_MIB[0]:,}-{RANK_OUTSIDE_SPREAD_MIB[1]:,} MiB in "
        f"five fresh ranks at world size 1 on {RANK_OUTSIDE_MEASURED_ON}, where the model "
        "(compute capability 9.0) gives "
        f"{(MEASURED_CUDA_CONTEXT_BYTES[(9, 0)] + NCCL_RANK_BYTES) // _MiB:,} MiB (+ "
        "cuDNN's where convolutions run), within 1.2 % of each; more peers are modelled, not "
        "measured. Over NCCL the first "
        "iteration's buckets outlive DDP's rebuild until the process group's "
        "watchdog reaps their all-reduce (within ~100 ms: the early steps of a fast "
        "loop): the peaks count them (the worst case), the steady state is shown "
        "beside")
    return replace(model, assumptions=notes, nccl_bytes=nccl.high_bytes)


def clique_nccl_memory(cliques: Iterable[Sequence[int]], compute_capability: tuple[int, int],
                       *, link: str = "nvlink", nccl_env: Mapping[str, str] | None = None
                       ) -> dict[int, NcclRankMemory]:
    """NCCL's memory on each device of one process's own communicators, by device:
    ``cliques`` are the device lists of ``torch.cuda.nccl``'s calls
    (:attr:`dpprof.emulator.virtual_devices.VirtualDevices.nccl_cliques`), each a
    communicator per device; a device counts the largest list it is in (torch keys its
    communicators by the list in order: the same GPUs in another order would make more,
    which DataParallel does not)."""
    settings = NcclSettings.from_env(nccl_env or {})
    cc = (int(compute_capability[0]), int(compute_capability[1]))
    sizes: dict[int, int] = {}
    for clique in cliques:
        for device in clique:
            sizes[device] = max(sizes.get(device, 0), len(clique))
    models = {n: nccl_clique_memory(n, compute_capability=cc, link=link, settings=settings)
              for n in set(sizes.values())}
    return {device: models[n] for device, n in sizes.items()}


def link_of(spec: GpuSpec, interconnect: str = "") -> str:
    """The link NCCL's peers use: ``interconnect`` where given, else NVLink on a GPU that has
    it (the high end of NCCL's memory: NVLink's channels and NVLS), else PCIe."""
    return interconnect or ("nvlink" if peak_rates_of(spec).nvlink_gbytes_per_s else "pcie")


def gpu_model_notes(ctx: ContextModel) -> list[str]:
    """The assumptions behind reserved and context figures, for the report."""
    return [
        "reserved: dpprof.emulator.allocator's simulation of the CUDA caching allocator (512 B "
        "rounding, 1 MiB small / large pools, 2 / 20 MiB segments, best-fit splitting and "
        "merging, each stream's blocks pooled apart) over this device's emulated allocation "
        "sequence, with "
        f"{CUBLAS_HANDLES_PER_DEVICE} cuBLAS workspaces (forward thread + autograd thread) "
        "allocated first",
        *ctx.assumptions,
    ]
