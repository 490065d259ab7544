"""A DDP rank's NVML figure and dpprof's own other processes on its GPU.

NVML's used memory is the device's: every process on it. A rank that dpprof spawned shares
its GPU with dpprof's own process when that process holds a CUDA context there from work it
did before (a compare run earlier in the same process: ``benchmarks/emulator_vs_gpu.py``
once ran every workload in one process, and every DDP rank after the first workload's counted
751-767 MiB of the parent's context). A job of the user's own would not have that memory on
its GPU, so the rank's figure leaves it out, reading by reading, from NVML's per-process
figures; another user's process stays counted (it is on the user's GPU too)."""

from __future__ import annotations

from fake_nvml import FakeDevice, FakeNvml

from dpprof.backends.nvml_watch import NvmlWatch
from dpprof.result import DeviceResult

MiB = 2**20
RANK, DPPROF, STRANGER = 4101, 4100, 977
CONTEXT = 751 * MiB  # the parent's CUDA context, as the H200 run left it
UUID = "GPU-0b6e4a1c-3f2d-4c5e-9a7b-8d1e2f3a4b5c"


def _watch(readings: list[int], processes: list[list[tuple[int, int | None]]],
           fail: dict[str, str] | None = None) -> tuple[NvmlWatch, DeviceResult]:
    def used(n: int) -> int:  # the first call is resolve_visible_devices' own reading
        return readings[max(n - 1, 0)]

    def procs(n: int) -> list[tuple[int, int | None]]:
        return processes[n]

    nvml = FakeNvml([FakeDevice(uuid=UUID, used=used, util=50, processes=procs,
                                fail=fail or {})])
    watch = NvmlWatch(nvml, 0.01, [UUID], [RANK], env={}, others=[DPPROF])
    assert watch.sampler is not None, watch.reason
    for _ in readings:
        watch.sampler.sample_once()
    dev = DeviceResult(index=0, peak_reserved_bytes=400 * MiB)
    return watch, watch.fill(dev, 0)


def test_a_ranks_used_memory_leaves_out_dpprofs_own_context_reading_by_reading() -> None:
    rank = [1200 * MiB, 1900 * MiB, 1700 * MiB]
    dpprof = [CONTEXT, CONTEXT, CONTEXT - 20 * MiB]
    readings = [r + d + 64 * MiB for r, d in zip(rank, dpprof, strict=True)]
    processes = [[(RANK, r), (DPPROF, d), (STRANGER, 64 * MiB)]
                 for r, d in zip(rank, dpprof, strict=True)]
    watch, dev = _watch(readings, processes)
    # the device less dpprof's own process at each reading: the rank and the stranger
    assert dev.nvml_peak_used_bytes == max(rank) + 64 * MiB
    assert dev.nvml_unexplained_bytes == dev.nvml_peak_used_bytes - 400 * MiB
    assert [p.allocated_bytes for p in dev.timeline] == [r + 64 * MiB for r in rank]
    assert dev.process_used_bytes == {str(RANK): max(rank), str(DPPROF): CONTEXT}
    notes = watch.notes([0])
    assert len(notes) == 1 and f"pid {DPPROF}" in notes[0] and "751 MiB" in notes[0]


def test_a_parent_without_a_context_changes_nothing() -> None:
    readings = [1000 * MiB, 1500 * MiB]
    processes = [[(RANK, 900 * MiB)], [(RANK, 1400 * MiB)]]
    watch, dev = _watch(readings, processes)
    assert dev.nvml_peak_used_bytes == 1500 * MiB
    assert watch.notes([0]) == []


def test_without_per_process_figures_the_devices_figure_stands() -> None:
    readings = [1000 * MiB + CONTEXT, 1500 * MiB + CONTEXT]
    watch, dev = _watch(readings, [[], []], fail={"processes": "Not Supported"})
    assert dev.nvml_peak_used_bytes == 1500 * MiB + CONTEXT
    assert not any("left out" in n for n in watch.notes([0]))
