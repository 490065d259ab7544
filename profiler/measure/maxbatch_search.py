"""The largest global batch each scenario fits on the given GPUs.

What must fit on a device is its total: peak *reserved* memory (the caching allocator's
segments, simulated over the emulated step's allocation events by
:func:`dpprof.emulator.allocator.simulate`) plus the CUDA context and library workspaces
(:func:`dpprof.emulator.reserved.gpu_overheads`, the one model of both, for the target
GPU's compute capability and the workload's cuDNN use).

The search is over multiples of ``multiple_of``. Meta emulation costs the same at any batch,
and each device's peak is close to affine in the batch, so the search first measures two
batches, extrapolates the boundary, then brackets it by galloping and finishes by
bisection: the answer ``B`` fits and ``B + multiple_of`` does not (both emulated). Results
are cached per batch, so no batch is emulated twice.

With ``ladder``, also the largest batch of each rung of the ladder
(:mod:`dpprof.measure.ladder`) on ``ddp`` (one GPU: ``single``): mixed precision,
activation checkpointing, both, and gradient accumulation in
:data:`LADDER_MICRO_BATCHES` micro-batches per step (its largest batch grows with k, so one
k is shown), each an entry named ``"ddp + bf16"``, ``"ddp + 4 micro-batches"``...; on
several GPUs also FSDP2's rungs, named as the rung (``"fsdp2-zero3"``), the global batch
whose per-rank share one emulated rank runs, NCCL's memory counted as on DDP's ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from dpprof.backends.emulated import EmulationConfig, probe_model, run_scenario
from dpprof.emulator.catalog import GpuSpec
from dpprof.emulator.fsdp import emulated_ranks
from dpprof.fixes.policy import LADDER_PREFIX
from dpprof.measure import ladder
from dpprof.measure.ladder_rungs import Rung, accumulation_rung, fsdp_rungs, rungs
from dpprof.measure.maxbatch_limits import DEFAULT_UPPER, LADDER_MICRO_BATCHES
from dpprof.measure.rung_models import repeated_blocks, rung_workload
from dpprof.result import (
    STATUS_ERROR,
    STATUS_OK,
    STATUS_OOM,
    MaxBatch,
    MaxBatchEntry,
)
from dpprof.scenarios.names import SINGLE
from dpprof.scenarios.step import StepConfig
from dpprof.scenarios.workloads import Workload
from dpprof.units import fmt_bytes

COUNTS = ("peak reserved (simulated caching allocator, cuBLAS workspaces included) + the "
          "CUDA context (and NCCL's memory on DDP ranks and DataParallel's GPUs)")


@dataclass
class ProbeResult:
    fits: bool
    worst_device: int | None
    worst_total_bytes: int
    status: str
    message: str


Probe = Callable[[int], ProbeResult]


def probe_emulated(name: str, wl: Workload, base: EmulationConfig,
                   around: Callable[[], AbstractContextManager[object]] | None = None) -> Probe:
    """Emulate ``name`` at a batch; does every used device's total fit the capacity?
    ``around``: the context each emulation runs in (an FSDP2 rung's fake process group)."""
    cfg0 = dataclasses.replace(base, count_reserved=True)

    def probe(batch: int) -> ProbeResult:
        with around() if around is not None else contextlib.nullcontext():
            s = run_scenario(name, wl, cfg0.with_step(batch=batch))
        if s.status == STATUS_ERROR:
            return ProbeResult(False, None, 0, s.status, s.message)
        used = [d for d in s.devices if d.used]
        worst = max(used, key=lambda d: d.total_peak_bytes)
        return ProbeResult(s.status == STATUS_OK, worst.index, worst.total_peak_bytes, s.status,
                      s.message)

    return probe


class _Search:
    """The probes of one search, in units of ``m`` rows (``k`` means ``k * m`` rows), each
    run once; ``lo`` fits, ``hi`` (once known) does not."""

    def __init__(self, probe: Probe, m: int, kmax: int, capacity_bytes: int | None) -> None:
        self.probe, self.m, self.kmax, self.capacity_bytes = probe, m, kmax, capacity_bytes
        self.cache: dict[int, ProbeResult] = {}
        self.lo: int = 1
        self.hi: int | None = None

    def at(self, k: int) -> ProbeResult:
        if k not in self.cache:
            self.cache[k] = self.probe(k * self.m)
        return self.cache[k]

    def rows(self) -> dict[int, ProbeResult]:
        return {k * self.m: v for k, v in self.cache.items()}

    def secant(self, ka: int, kb: int) -> int | None:
        """Where the line through two probes crosses the capacity (regula falsi)."""
        pa, pb = self.cache[ka], self.cache[kb]
        if self.capacity_bytes is None or kb == ka:
            return None
        slope = (pb.worst_total_bytes - pa.worst_total_bytes) / (kb - ka)
        if slope <= 0:
            return None
        return ka + int((self.capacity_bytes - pa.worst_total_bytes) / slope)

    def from_below(self) -> int | None:
        """Extrapolate along the two largest fitting probes of different totals (reserved
        memory grows in segment-sized steps, so equal totals give no slope)."""
        fitting = sorted(j for j, q in self.cache.items() if q.fits)
        lo_total = self.cache[self.lo].worst_total_bytes
        below = [j for j in fitting if self.cache[j].worst_total_bytes < lo_total]
        return self.secant(below[-1], self.lo) if below else None

    def bracket(self) -> bool:
        """Unbracketed: extrapolate (quadruple while the totals are flat); when the
        prediction stops moving up, gallop with small doubling steps. False where ``lo``
        reached the bound with no failure (capped)."""
        k = min(self.kmax, max(2, 64 // self.m))
        step = 0
        extrapolations = 0
        while self.hi is None:
            if not self.at(k).fits:
                self.hi = k
                break
            self.lo = k
            if self.lo >= self.kmax:
                return False
            guess = self.from_below()
            if step == 0 and guess is not None and guess > self.lo and extrapolations < 3:
                k = guess
                extrapolations += 1
            elif guess is None and step == 0 and extrapolations == 0:
                k = self.lo * 4
            else:
                step = max(1, self.lo // 1024) if step == 0 else step * 2
                k = self.lo + step
            k = min(k, self.kmax)
        return True

    def narrow(self, hi: int) -> None:
        """Bracketed: extrapolate from below, else interpolate between the bracket's ends;
        when two probes in a row fail to halve the bracket, bisect once, so the search
        stays logarithmic whatever the shape of the curve."""
        lo = self.lo
        widths = [hi - lo]
        while hi - lo > 1:
            guess = self.from_below()
            if guess is not None and guess <= lo:
                guess = lo + 1  # the boundary is right above lo: check the next step
            if guess is None or not lo < guess < hi:
                guess = self.secant(lo, hi)
            stalled = len(widths) >= 3 and widths[-1] * 2 > widths[-3]
            k = (guess if guess is not None and lo < guess < hi and not stalled
                 else (lo + hi) // 2)
            if self.at(k).fits:
                lo = self.lo = k
            else:
                hi = k
            widths.append(hi - lo)


def search(probe: Probe, multiple_of: int = 1, upper: int = DEFAULT_UPPER,
           capacity_bytes: int | None = None) -> tuple[int | None, dict[int, ProbeResult], bool]:
    """Largest ``k * multiple_of`` (k >= 1) that fits; the probes run (by batch); whether
    the search stopped at ``upper``. ``capacity_bytes`` lets it extrapolate the boundary
    from two probes (otherwise it doubles). Assumes fitting is monotone in the batch.
    """
    s = _Search(probe, multiple_of, max(1, upper // multiple_of), capacity_bytes)
    if not s.at(1).fits:
        return None, s.rows(), False
    if not s.bracket():
        return s.lo * multiple_of, s.rows(), True
    assert s.hi is not None
    s.narrow(s.hi)
    return s.lo * multiple_of, s.rows(), False


def run_maxbatch(
    wl: Workload, scenarios: tuple[str, ...], gpus: int, capacity_bytes: int,
    gpu: GpuSpec | None = None, multiple_of: int = 1, step: StepConfig | None = None,
    upper: int = DEFAULT_UPPER,
    progress: Callable[[str, int, int], None] | None = None,
    emulation: EmulationConfig | None = None, ladder: bool = False,
) -> MaxBatch:
    """The largest batch each scenario fits, with reserved memory and the context counted.

    ``step``: the step's options (seed, warm-up, dtype, autocast, DDP's; the batch is
    searched). ``emulation``: the comparison's emulation options (compute capability, the
    step), used as they are; otherwise those of ``gpu`` (or an A100). ``ladder``: also
    each rung of the ladder (see the module), after the scenarios.
    """
    base = EmulationConfig(gpus=gpus, gpu_memory_bytes=capacity_bytes,
                           step=step or StepConfig())
    if emulation is not None:
        base = dataclasses.replace(emulation, gpus=gpus, compute=False,
                                   gpu_memory_bytes=capacity_bytes)
    elif gpu is not None:  # the emulator models this GPU's workspaces and kernels
        base.compute_capability = gpu.compute_capability
    base = base.with_step(batch=multiple_of)
    out = MaxBatch(capacity_bytes=capacity_bytes, gpu=gpu.key if gpu else "",
                   multiple_of=multiple_of,
                   counts=COUNTS)
    entries: list[MaxBatchEntry] = []
    searches = [(name, probe_emulated(name, wl, base)) for name in scenarios]
    if ladder:
        searches += ladder_probes(wl, base)
    for i, (name, probe) in enumerate(searches):
        if progress:
            progress(name, i, len(searches))
        best, probes, capped = search(probe, multiple_of, upper, capacity_bytes)
        found: dict[str, Any] = {}
        if best is None:
            p = probes[multiple_of]
            found.update(
                errored=p.status not in (STATUS_OK, STATUS_OOM),
                message=(p.message if p.status not in (STATUS_OK, STATUS_OOM)
                         else f"batch {multiple_of} does not fit: needs "
                         f"{fmt_bytes(p.worst_total_bytes)} on cuda:{p.worst_device}"),
                next_needed_bytes=p.worst_total_bytes, limit_device=p.worst_device)
        else:
            found["needed_bytes"] = probes[best].worst_total_bytes
            nxt = probes.get(best + multiple_of)
            if nxt is not None:
                found.update(next_needed_bytes=nxt.worst_total_bytes,
                             limit_device=nxt.worst_device)
            if capped:
                found["message"] = f"fits up to the search bound {upper}"
        entries.append(MaxBatchEntry(scenario=name, max_batch=best, capped=capped,
                                     emulations=len(probes), **found))
    if progress:
        progress("", len(searches), len(searches))
    return dataclasses.replace(out, entries=tuple(entries))


def ladder_probes(wl: Workload, base: EmulationConfig) -> list[tuple[str, Probe]]:
    """Each rung of the ladder as a probe on ``ddp`` (``single`` on one GPU), named
    ``"<floor> + <rung>"``: mixed precision, checkpointing (where the model has repeated
    blocks), both, then FSDP2's rungs on several GPUs (named as the rung, ``"fsdp2-zero3"``:
    they replace DDP; one rank of ``gpus`` over a fake process group, its batch the global
    batch's share, counting NCCL's memory as a DDP rank's does, as compare's ladder does),
    then :data:`LADDER_MICRO_BATCHES` micro-batches."""
    floor = ladder.floor_scenario(base.gpus)
    model = probe_model(wl, base.gpus)
    blocks = bool(repeated_blocks(model))
    tried = rungs(base.compute_capability, blocks)
    if not ladder.in_process_group():  # FSDP2 is emulated over a process group of its own
        tried += fsdp_rungs(base.gpus, blocks, base.compute_capability,
                            offload=ladder.offload_unmeasurable(model) is None)
    if wl.step is None:  # accumulation runs the tutorial loop, not a workload's own step
        tried.append(accumulation_rung(Rung("", "", None, False), LADDER_MICRO_BATCHES))
    out = []
    for rung in tried:
        cfg = base.with_step(amp=rung.amp, micro_batches=rung.micro_batches)
        if rung.reshard_after_forward is not None:
            out.append((rung.name.removeprefix(LADDER_PREFIX), probe_emulated(
                SINGLE, rung_workload(wl, rung),
                dataclasses.replace(cfg, collectives=True, host_model=rung.offload),
                functools.partial(emulated_ranks, base.gpus))))
            continue
        label = (f"{rung.micro_batches} micro-batches" if rung.micro_batches > 1
                 else rung.name.removeprefix(LADDER_PREFIX))
        out.append((f"{floor} + {label}", probe_emulated(floor, rung_workload(wl, rung),
                                                         cfg)))
    return out
