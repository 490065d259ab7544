"""The GPU catalog and the CUDA context / library workspace model."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import pytest

from dpprof.emulator.catalog import GPUS, GpuSpec, known_gpus, lookup_gpu
from dpprof.emulator.context import (
    ContextModel,
    context_overhead,
    cublas_workspace_size,
    cublaslt_workspace_size,
    device_context,
)
from dpprof.emulator.reserved import AllocationEvent, gpu_overheads

MiB = 1024 * 1024
GiB = 1024 * MiB

REQUIRED = (
    "a100-80gb",
    "a100-40gb",
    "h100-80gb",
    "h200",
    "v100-16gb",
    "v100-32gb",
    "a10g",
    "l4",
    "t4",
    "rtx-3090",
    "rtx-4090",
    "a6000",
    "l40s",
)


# ----------------------------------------------------------------------------- catalog


def test_catalog_has_the_common_gpus() -> None:
    assert set(REQUIRED) <= set(GPUS)
    assert known_gpus() == sorted(GPUS)


@pytest.mark.parametrize("key", REQUIRED)
def test_usable_memory_is_below_nvml_and_below_the_marketed_size(key: str) -> None:
    spec = GPUS[key]
    assert spec.key == key
    assert spec.total_memory_bytes % MiB == 0
    assert 0 < spec.driver_reserved_bytes < GiB  # NVML total minus what CUDA reports
    assert spec.total_memory_bytes < spec.marketed_gb * GiB
    assert spec.memory_source  # every figure says where it comes from
    assert spec.compute_capability[0] in (7, 8, 9)


@pytest.mark.parametrize(
    ("key", "gib", "cc", "generation"),
    [
        ("a100-80gb", 79.25, (8, 0), "Ampere"),
        ("a100-40gb", 39.50, (8, 0), "Ampere"),
        ("h100-80gb", 79.11, (9, 0), "Hopper"),
        ("v100-32gb", 31.74, (7, 0), "Volta"),
        ("t4", 14.58, (7, 5), "Turing"),
        ("rtx-4090", 23.64, (8, 9), "Ada Lovelace"),
        ("l40s", 44.53, (8, 9), "Ada Lovelace"),
        ("a10g", 21.99, (8, 6), "Ampere"),
    ],
)
def test_catalog_figures(key: str, gib: float, cc: tuple[int, int], generation: str) -> None:
    spec = GPUS[key]
    assert spec.total_memory_bytes == round(gib * 1024) * MiB
    assert spec.compute_capability == cc
    assert spec.generation == generation
    assert not spec.estimated


def test_estimated_entries_are_flagged() -> None:
    assert GPUS["h200"].estimated and "estimated" in GPUS["h200"].memory_source
    assert GPUS["h200"].nvml_total_bytes == 143771 * MiB


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("a100-80gb", "a100-80gb"),
        ("A100-80GB", "a100-80gb"),
        ("a100_80gb", "a100-80gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA H100 80GB HBM3", "h100-80gb"),
        ("h100", "h100-80gb"),
        ("Tesla T4", "t4"),
        ("Tesla V100-SXM2-32GB", "v100-32gb"),
        ("NVIDIA GeForce RTX 3090", "rtx-3090"),
        ("RTX 4090", "rtx-4090"),
        ("NVIDIA RTX A6000", "a6000"),
        ("NVIDIA A10G", "a10g"),
        ("  L40S ", "l40s"),
    ],
)
def test_lookup_by_name_alias_or_cuda_device_name(name: str, key: str) -> None:
    spec = lookup_gpu(name)
    assert isinstance(spec, GpuSpec)
    assert spec.key == key


def test_unknown_gpu_lists_the_known_names() -> None:
    with pytest.raises(KeyError) as err:
        lookup_gpu("a100")  # ambiguous (40 or 80 GB): not guessed
    message = str(err.value)
    assert "'a100'" in message
    for key in REQUIRED:
        assert key in message
    with pytest.raises(KeyError, match="known GPUs"):
        lookup_gpu("voodoo-2")


# ----------------------------------------------------------------------------- workspaces


@pytest.mark.parametrize(
    ("cc", "expected"),
    [
        ((7, 0), 4096 * 1024 * 2 + 16 * 1024 * 8),  # :4096:2:16:8 = 8,519,680 B
        ((7, 5), 8_519_680),
        ((8, 0), 8_519_680),
        ((8, 9), 8_519_680),
        ((9, 0), 32 * MiB),  # Hopper
        ((10, 0), 32 * MiB),  # Blackwell
        ((12, 0), 32 * MiB),
    ],
)
def test_cublas_workspace_by_compute_capability(cc: tuple[int, int], expected: int) -> None:
    assert cublas_workspace_size(cc) == expected


def test_cublas_workspace_config_overrides_the_default() -> None:
    assert cublas_workspace_size((8, 0), ":4096:8") == 32 * MiB
    assert cublas_workspace_size((9, 0), ":4096:2:16:8") == 8_519_680
    assert cublas_workspace_size((9, 0), ":16:8") == 128 * 1024
    with pytest.raises(ValueError, match="CUBLAS_WORKSPACE_CONFIG"):
        cublas_workspace_size((8, 0), "4096")


def test_cublaslt_workspace_is_shared_unless_split() -> None:
    assert cublaslt_workspace_size() == 0
    assert cublaslt_workspace_size(unified=False) == MiB
    assert cublaslt_workspace_size(unified=False, cublaslt_workspace_kib=4096) == 4 * MiB


# ----------------------------------------------------------------------------- context model


def test_cuda_context_lazy_and_eager_from_pr_86509() -> None:
    lazy = context_overhead("a100-80gb")
    eager = context_overhead("a100-80gb", lazy_loading=False)
    assert lazy.cuda_context_bytes == 287_047_680 - 20 * MiB
    assert eager.cuda_context_bytes == 666_632_192 - 20 * MiB
    assert any("86509" in a for a in lazy.assumptions)
    given = context_overhead((8, 0), cuda_context_bytes=300 * MiB)
    assert given.cuda_context_bytes == 300 * MiB


def test_context_model_on_a100_splits_outside_and_inside_the_allocator() -> None:
    m = context_overhead(lookup_gpu("a100-80gb"))
    assert m.compute_capability == (8, 0)
    assert m.cublas_workspaces == 1
    assert m.allocator_requests == [8_519_680]
    # the 8.125 MiB workspace is a large-pool request below 10 MiB: a 20 MiB segment
    assert m.workspace_reserved_bytes == 20 * MiB
    assert m.outside_allocator_bytes == m.cuda_context_bytes  # no cuDNN
    assert m.total_bytes == m.cuda_context_bytes + 20 * MiB
    assert m.components()["cublas_workspaces"] == 8_519_680
    assert any("CublasHandlePool" in a and "caching allocator" in a for a in m.assumptions)


def test_workspaces_per_handle_and_stream() -> None:
    a100 = context_overhead("8.0", cublas_handles=2)
    assert a100.allocator_requests == [8_519_680, 8_519_680]
    assert a100.workspace_reserved_bytes == 20 * MiB  # both fit one 20 MiB segment
    h100 = context_overhead("sm_90", cublas_handles=3, streams=2)
    assert h100.cublas_workspaces == 6
    assert h100.workspace_bytes == 6 * 32 * MiB
    assert h100.workspace_reserved_bytes == 6 * 32 * MiB
    split_lt = context_overhead((8, 6), cublas_handles=2, cublaslt_unified=False)
    assert split_lt.allocator_requests == [8_519_680, 8_519_680, MiB, MiB]
    assert split_lt.cublaslt_workspaces == 2
    assert split_lt.workspace_reserved_bytes == 20 * MiB + 2 * MiB  # Lt: small-pool segment
    none = context_overhead((8, 0), cublas_handles=0)
    assert none.allocator_requests == [] and none.workspace_reserved_bytes == 0


def test_cudnn_costs_are_assumptions_and_off_without_cudnn() -> None:
    plain = context_overhead("t4")
    assert plain.cudnn_library_bytes == 0 and plain.cudnn_workspace_bytes == 0
    assert plain.transient_allocator_requests == []
    conv = context_overhead("t4", uses_cudnn=True)
    assert conv.cudnn_library_bytes > 0
    # the convolution workspace is each convolution's, in the allocation sequence
    # (dpprof.emulator.cudnn_workspace), not one figure beside it
    assert conv.transient_allocator_requests == [] and conv.cudnn_workspace_bytes == 0
    assert any("cudnn_workspace" in a for a in conv.assumptions)
    assert conv.outside_allocator_bytes == conv.cuda_context_bytes + conv.cudnn_library_bytes
    assert sum("assumption" in a and "cuDNN" in a for a in conv.assumptions) == 1
    eager = context_overhead("t4", uses_cudnn=True, lazy_loading=False)
    assert eager.cudnn_library_bytes > conv.cudnn_library_bytes
    fixed = context_overhead("t4", uses_cudnn=True, cudnn_workspace_bytes=64 * MiB)
    assert fixed.transient_allocator_requests == [64 * MiB]


def test_context_overhead_rejects_bad_counts() -> None:
    with pytest.raises(ValueError):
        context_overhead((8, 0), cublas_handles=-1)
    with pytest.raises(ValueError):
        context_overhead((8, 0), streams=0)
    with pytest.raises(KeyError):
        context_overhead("not-a-gpu")


@dataclass(frozen=True)
class Dev:
    """What gpu_overheads reads of a device's result (frozen: it writes nothing)."""

    index: int
    used: bool = True
    rank: int | None = None
    transient_bytes: dict[str, int] = field(default_factory=dict)


def reserved_bytes(devs: list[Dev], log: Iterable[AllocationEvent],
                   ctx: ContextModel) -> list[int | None]:
    """Each device's simulated reserve (None: unused)."""
    return [None if f is None else f.peak_reserved_bytes for f in gpu_overheads(devs, log, ctx)]


def test_an_allocation_on_a_side_stream_is_pooled_apart_in_a_devices_reserve() -> None:
    """The stream an allocation was made on (``EventLog.streams``) reaches the simulation:
    a device whose first block was a side stream's cannot reuse it on the default stream."""
    from dpprof.emulator.events import EventLog

    mib = 2**20
    log = EventLog()
    for d in (0, 1):  # the same sizes and order on both devices
        log.add(d, 10 * d + 1, 30 * mib, 30 * mib)
        if d == 1:
            log.streams[len(log) - 1] = 7  # made inside torch.cuda.stream(side)
        log.add(d, 10 * d + 1, -30 * mib, -30 * mib)
        log.add(d, 10 * d + 2, 30 * mib, 30 * mib)
    ctx = device_context((8, 0), uses_cudnn=False)
    first, side = reserved_bytes([Dev(0), Dev(1)], log, ctx)
    assert first is not None and side is not None
    assert side - first == 30 * mib


def test_devices_with_the_same_allocation_sequence_share_one_simulation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Sequences equal up to their storages' serials simulate once; any other difference
    (a size, the order of a free, which storage is freed) gets its own simulation, and each
    device's figure is that of simulating its own sequence."""
    from dpprof.emulator import reserved
    from dpprof.emulator.allocator_config import block_bytes
    from dpprof.emulator.allocator_replay import simulate
    from dpprof.emulator.events import EventLog

    mib = 2**20
    # (serial, signed bytes); device 1 is device 0 renamed, 2 frees in another order,
    # 3 frees the other storage, 4 differs in one size, 5 has no events
    seqs = {
        0: [(1, 30 * mib), (2, 5 * mib), (1, -30 * mib), (3, 40 * mib), (2, -5 * mib)],
        1: [(11, 30 * mib), (12, 5 * mib), (11, -30 * mib), (13, 40 * mib), (12, -5 * mib)],
        2: [(21, 30 * mib), (22, 5 * mib), (22, -5 * mib), (23, 40 * mib), (21, -30 * mib)],
        3: [(31, 30 * mib), (32, 5 * mib), (32, -5 * mib), (33, 40 * mib), (33, -40 * mib)],
        4: [(41, 30 * mib), (42, 6 * mib), (41, -30 * mib), (43, 40 * mib), (42, -6 * mib)],
    }
    log = EventLog()
    log.add(-1, 99, 123, 512)  # a host storage: not on any GPU
    for k in range(5):  # interleaved, as devices' events are
        for d, seq in seqs.items():
            serial, size = seq[k]
            log.add(d, serial, size, block_bytes(abs(size)) * (1 if size > 0 else -1))
    calls: list[int] = []

    def counting(events, *a, **kw):  # type: ignore[no-untyped-def]
        calls.append(1)
        return simulate(events, *a, **kw)

    ctx = device_context((8, 0), uses_cudnn=False)
    monkeypatch.setattr(reserved, "simulate", counting)
    devs = [Dev(i) for i in range(6)]
    got = reserved_bytes(devs, log, ctx)
    assert len(calls) == 5  # {0, 1}, 2, 3, 4 and 5 (no events)
    workspaces = [("alloc", -1 - k, s) for k, s in enumerate(ctx.allocator_requests)]
    for dev, bytes_ in zip(devs, got, strict=True):
        own = [("alloc", s, b) if b > 0 else ("free", s, 0) for s, b in seqs.get(dev.index, [])]
        assert bytes_ == simulate(
            workspaces + own, timeline_points=None, stop_on_oom=False).peak_reserved_bytes
    # the same figures from a plain list of events (no EventLog)
    calls.clear()
    assert reserved_bytes(devs, list(log), ctx) == got


def test_the_overheads_make_new_results_and_leave_the_devices_given_as_they_were() -> None:
    """The model returns its figures; the frozen results' adapter builds new results from
    them: an unused device comes back as it was, a DDP rank's context counts its NCCL
    communicator and another device's does not, and a device whose peak counts a transient
    gets the reserve of its sequence with that storage freed where the steady state frees
    it -- the reserve of a device that frees it there itself."""
    import dataclasses

    from dpprof.backends.emulated_figures import with_gpu_overheads
    from dpprof.emulator.allocator_config import block_bytes
    from dpprof.emulator.events import EventLog
    from dpprof.result import DeviceResult

    mib = 2**20
    log = EventLog()

    def add(device: int, serial: int, size: int) -> None:
        log.add(device, serial, size, block_bytes(abs(size)) * (1 if size > 0 else -1))

    # device 0 keeps storage 1 (the transient) to the end; device 1 frees it where the
    # steady state does, before storage 3 is allocated
    add(0, 1, 40 * mib)
    add(0, 2, 20 * mib)
    steady_free = len(log)
    add(0, 3, 40 * mib)
    add(0, 1, -40 * mib)
    add(1, 11, 40 * mib)
    add(1, 12, 20 * mib)
    add(1, 11, -40 * mib)
    add(1, 13, 40 * mib)
    ctx = dataclasses.replace(device_context((8, 0), uses_cudnn=False), nccl_bytes=64 * mib)
    devices = (
        DeviceResult(index=0, transient_bytes={"warm_up": 40 * mib}),
        DeviceResult(index=1, rank=1),
        DeviceResult(index=2, used=False),
    )
    given = dataclasses.replace(devices[0]), dataclasses.replace(devices[1])
    out = with_gpu_overheads(devices, log, ctx, transients={1: (steady_free, "warm_up")})
    assert devices[:2] == given
    assert out[2] is devices[2]
    transient, rank, _ = out
    assert transient.peak_reserved_bytes is not None and rank.peak_reserved_bytes is not None
    assert transient.steady_peak_reserved_bytes == rank.peak_reserved_bytes
    assert transient.steady_peak_reserved_bytes < transient.peak_reserved_bytes
    assert rank.steady_peak_reserved_bytes is None  # no transient at its peak
    assert "nccl" not in transient.context_breakdown_bytes
    assert rank.context_breakdown_bytes["nccl"] == 64 * mib
    assert rank.context_bytes == sum(rank.context_breakdown_bytes.values())
    assert transient.context_bytes == sum(transient.context_breakdown_bytes.values())
    assert transient.workspace_bytes == rank.workspace_bytes == sum(ctx.allocator_requests)
    # nccl=True: every used device holds a communicator
    told = with_gpu_overheads(devices, log, ctx, nccl=True)
    assert told[0].context_breakdown_bytes["nccl"] == 64 * mib
