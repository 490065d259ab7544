"""The figures a script run's scenario gets beside the allocations it counted: each used
device's reserved memory and context (a DDP rank's NCCL at the run's world size, in the
script's environment), the measured steps' predicted time, and the check that no device's
reported peak is below what ``torch.cuda``'s memory functions told the script."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from dpprof.backends.emulated_figures import apply_overheads, clique_note
from dpprof.backends.emulated_time import write_prediction
from dpprof.emulator.call_sites import relative_site
from dpprof.emulator.context import clique_nccl_memory, device_context, link_of
from dpprof.emulator.nccl_memory import NcclRankMemory
from dpprof.emulator.reserved import GpuOverheads, gpu_overheads
from dpprof.emulator.step_time import H200_FIT, predict_steps, rates_for
from dpprof.result import STATUS_ERROR, DeviceResult, ScenarioResult
from dpprof.units import fmt_bytes

if TYPE_CHECKING:
    from dpprof.emulator.virtual_cuda import VirtualCuda
    from dpprof.script.runner import ScriptConfig


CUDNN_BENCHMARK_NOTE = (
    "torch.backends.cudnn.benchmark is on where the script's convolutions ran: on a GPU the "
    "first call of each convolution's shape times cuDNN's candidate engines in one workspace "
    "as large as the largest of them asks, up to the memory free then (Conv_v8.cpp, "
    "generate_and_filter_plans), and the caching allocator keeps that segment; the figures "
    "here count the workspace of the engine cuDNN's heuristics pick (as with benchmark "
    "off), where the trials' fastest may take another: after the first step the GPU's "
    "reserved memory and NVML's used memory can be higher. The trials take only memory "
    "that is free then")


def rank_device(vc: VirtualCuda, local_rank: int) -> int:
    """The device whose figures stand for a DDP run's rank: the rank's own GPU
    (``local_rank``), where the run used it, else the first it used."""
    counters = vc.rt.storages.counters
    if local_rank < len(vc.visible) and counters[vc.visible[local_rank]].peak_allocated > 0:
        return vc.visible[local_rank]
    return next((i for i in vc.visible if counters[i].peak_allocated > 0), vc.visible[0])


class MeasuredSteps(Protocol):
    """What of the run's :class:`dpprof.script.hooks.Stepper` the step time reads."""

    step_ends: list[int]

    @property
    def batches_per_step(self) -> float: ...


def predict_time(s: ScenarioResult, vc: VirtualCuda, cfg: ScriptConfig,
                 steps: MeasuredSteps, local_rank: int) -> ScenarioResult:
    """``s`` with the measured steps' mean time on the target GPU, predicted from their ops
    (:func:`dpprof.emulator.step_time.predict_steps`), and the samples a second of it (each
    step's batches: several where the script accumulates gradients): a rank of DDP (or
    FSDP2) stands for every rank; the script's devices are the visible ones it names."""
    step_ends = steps.step_ends
    log = vc.rt.op_log
    if log is None or not s.devices or s.status == STATUS_ERROR or not log.records:
        return s
    if not step_ends:
        # the log ran from the warm-up's end, and no step ended after it: what it holds is
        # the script's work after its only step (an evaluation), not a training step
        return dataclasses.replace(s, notes=(*s.notes, (
            "step time not predicted: no optimizer step ended after the warm-up step "
            "(--steps counts the warm-up; what ran after the script's only step is not a "
            "training step)")))
    ranks_from = rank_device(vc, local_rank)

    def source(d: DeviceResult) -> int:
        return ranks_from if d.rank is not None else vc.visible[d.index]

    shown = sorted({source(d) for d in s.devices if d.used})
    rates = rates_for(cfg.gpu, cfg.interconnect)
    pred = predict_steps(log.records, step_ends, rates, H200_FIT, shown)
    s = write_prediction(s, pred, round(s.batch * steps.batches_per_step), source)
    if not pred.evaluation_ops:
        return s
    return dataclasses.replace(s, notes=(*s.notes, (
        f"step time: the training step's; the script's evaluation between its steps (its "
        f"model called in eval mode without gradients: {pred.evaluation_ops:,} ops) is left "
        f"out of it, predicted at {pred.evaluation_s * 1e3:,.1f} ms in all over the "
        f"measured steps")))


def below_what_the_script_was_told(s: ScenarioResult, vc: VirtualCuda,
                                    local_rank: int) -> str:
    """Where a device's reported peak is below what ``torch.cuda``'s memory functions told
    the script of it (the peak the GPU reaches is at least every reading of it), why the
    run cannot be reported; "" where none is."""
    ranks_from = rank_device(vc, local_rank)
    for d in s.devices:
        told = vc.memory.answered.get(ranks_from if d.rank is not None else vc.visible[d.index])
        if told is None:
            continue
        for reported, read, by, what in (
                (d.gpu_allocated_bytes, told.allocated_bytes, told.allocated_by, "allocated"),
                (d.peak_reserved_bytes, told.reserved_bytes, told.reserved_by, "reserved")):
            if reported is not None and read > reported:
                return (f"not reported: dpprof's peak {what} for cuda:{d.index} "
                        f"({fmt_bytes(reported)}) is below what the script was told, "
                        f"{fmt_bytes(read)} by {by}; the peak the GPU reaches is at least "
                        "every reading of it, so these figures are wrong (a dpprof bug: "
                        "please report it)")
    return ""


@dataclasses.dataclass(frozen=True)
class AllocatorLimit:
    """The share of a GPU the script lets its caching allocator reserve
    (``torch.cuda.set_per_process_memory_fraction``), and whether the device ran out of it."""

    device: DeviceResult
    limit_bytes: int
    fraction: float
    set_by: str  # the script's call, "train.py:3"
    over: bool

    def message(self) -> str:
        d = self.device
        return (f"out of memory on cuda:{d.index}: torch.cuda.set_per_process_memory_fraction"
                f"({self.fraction:g}) at {relative_site(self.set_by)} lets its caching "
                f"allocator reserve {fmt_bytes(self.limit_bytes)}; the run needs more "
                f"(reserved {fmt_bytes(d.peak_reserved_bytes or 0)} without the limit, at "
                f"{d.peak_phase or 'its peak'}): raise the fraction or lower the batch")


def own_nccl(vc: VirtualCuda, cfg: ScriptConfig) -> dict[int, NcclRankMemory]:
    """NCCL's memory on each runtime device of the process's own communicators
    (``torch.cuda.nccl``'s: DataParallel's broadcast and reduce), in the script's
    environment."""
    return clique_nccl_memory(vc.rt.nccl_cliques, cfg.gpu.compute_capability,
                              link=link_of(cfg.gpu, cfg.interconnect), nccl_env=_nccl_env(cfg))


def _nccl_env(cfg: ScriptConfig) -> dict[str, str]:
    """The environment the script's NCCL reads (its NCCL_* settings, the launcher's)."""
    return {**os.environ, **cfg.launch.env}


class NcclOnDevices:
    """NCCL's memory on a runtime device as the run goes, for the readings and the
    out-of-memory check in the run (``vc.nccl_bytes_on``): the process's own communicators
    from their first call, and a process group's over NCCL on the rank's device from the
    group's start (DDP, FSDP and every collective connect it before a step runs), each at
    the high end, as the figures after the run count them."""

    def __init__(self, vc: VirtualCuda, cfg: ScriptConfig, local_rank: int) -> None:
        self._vc, self._cfg, self._local_rank = vc, cfg, local_rank
        self._key: tuple[int, int] = (0, 0)
        self._own: dict[int, int] = {}
        self._group_bytes = 0

    def __call__(self, device: int) -> int:
        log, backend = self._vc.parallel.log, self._vc.parallel.backend
        world = log.world_size if log.fake_group and backend == "nccl" else 0
        key = (len(self._vc.rt.nccl_cliques), world)
        if key != self._key:  # a new communicator: figure them again
            self._key = key
            self._own = {d: m.high_bytes for d, m in own_nccl(self._vc, self._cfg).items()}
            self._group_bytes = device_context(
                self._cfg.gpu.compute_capability, False, world_size=max(world, 1),
                link=link_of(self._cfg.gpu, self._cfg.interconnect),
                nccl_env=_nccl_env(self._cfg)).nccl_bytes if world else 0
        group = self._group_bytes if world and device == self._group_device() else 0
        return self._own.get(device, 0) + group

    def _group_device(self) -> int:
        """The GPU of the rank's communicator: its local rank's, as launchers give it (the
        rank's device by convention, whatever it has allocated yet), else where it ran."""
        visible = self._vc.visible
        if self._local_rank < len(visible):
            return visible[self._local_rank]
        return rank_device(self._vc, self._local_rank)


def with_overheads(devices: Sequence[DeviceResult], vc: VirtualCuda, cfg: ScriptConfig,
                   local_rank: int, world_size: int = 1
                   ) -> tuple[tuple[DeviceResult, ...], list[AllocatorLimit], list[str]]:
    """``devices`` with reserved and the CUDA context (a rank's NCCL at the world size, in the
    script's environment, and the process's own communicators') per used device: the
    emulator's one model (:func:`dpprof.emulator.reserved.gpu_overheads`) over the script's
    allocations; the limit of each used device whose memory fraction the script set
    (simulated under it as c10 limits it: the cache released first, then out of memory);
    and the notes on them."""
    ctx = device_context(cfg.gpu.compute_capability, vc.rt.saw_convolution, world_size=world_size,
                         link=link_of(cfg.gpu, cfg.interconnect), nccl_env=_nccl_env(cfg))
    own = own_nccl(vc, cfg)

    def source(d: DeviceResult) -> int:
        if d.rank is None:
            return vc.visible[d.index]
        # a DDP rank: the device that ran it stands for every rank
        return rank_device(vc, local_rank)

    def figures(limits: dict[int, int] | None = None) -> list[GpuOverheads | None]:
        return gpu_overheads(devices, vc.rt.storages.events, ctx, source=source,
                             blas_first=vc.rt.blas_first, blas_side=vc.rt.blas_side,
                             transients=vc.rt.storages.transients,
                             config=vc.memory.allocator_config(), limits=limits,
                             own_nccl_bytes={d: m.high_bytes for d, m in own.items()})

    out = apply_overheads(devices, figures())
    limits = {i: b for i in vc.memory.fractions if (b := vc.memory.limit_bytes(i)) is not None}
    found: list[AllocatorLimit] = []
    if limits:
        for d, f in zip(out, figures(limits), strict=True):
            if f is not None and source(d) in limits:
                fraction, site = vc.memory.fractions[source(d)]
                found.append(AllocatorLimit(d, limits[source(d)], fraction, site,
                                            f.out_of_limit_bytes is not None))
    note = clique_note({vc.logical(d): m for d, m in own.items()})
    notes = [note] if note else []
    if vc.rt.cudnn_benchmarked:
        notes.append(CUDNN_BENCHMARK_NOTE)
    return out, found, notes
