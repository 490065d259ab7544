"""The largest global batch each scenario fits on the given GPUs.

What must fit on a device is its total: peak *reserved* memory (the caching allocator's
segments, simulated over the emulated step's allocation events by
:func:`dpprof.emulator.allocator.simulate`) plus the CUDA context and library workspaces
(:func:`dpprof.emulator.gpus.context_overhead`). :func:`fill_reserved_and_context` computes
both into
each :class:`DeviceResult` when the backend has not (the ``fidelity`` work fills them in the
backend itself; then its numbers are used as they are).

The search is over multiples of ``multiple_of``. Meta emulation costs the same at any batch,
and each device's peak is close to affine in the batch, so the search first measures two
batches, extrapolates the boundary, then brackets it by galloping and finishes by
bisection: the answer ``B`` fits and ``B + multiple_of`` does not (both emulated). Results
are cached per batch, so no batch is emulated twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from dpprof.backends.emulated import EmulationConfig, run_scenario
from dpprof.emulator.allocator import simulate
from dpprof.emulator.gpus import GpuSpec, context_overhead
from dpprof.emulator.vdevice import VirtualDevices
from dpprof.result import (
    STATUS_ERROR,
    STATUS_OK,
    STATUS_OOM,
    MaxBatch,
    MaxBatchEntry,
    ScenarioResult,
)
from dpprof.scenarios.workloads import Workload
from dpprof.units import fmt_bytes

DEFAULT_UPPER = 1 << 22  # rows: a search bound, reported as "capped" when reached
DEFAULT_CC = (8, 0)  # compute capability assumed for the context when only --gpu-memory
CUBLAS_HANDLES = 2  # the forward thread's and the autograd device thread's (gpus.py)

COUNTS = "peak reserved (simulated caching allocator) + CUDA context and workspaces"


def context_bytes_for(gpu: GpuSpec | None) -> int:
    """Bytes per device outside the tensors: context, library code, cuBLAS workspaces."""
    return context_overhead(gpu if gpu is not None else DEFAULT_CC,
                            cublas_handles=CUBLAS_HANDLES).total_bytes


def _events(rt: VirtualDevices, device: int) -> list[tuple[str, int, int]]:
    out = []
    for e in rt.events:
        if e.device != device or (e.requested == 0 and e.allocated == 0):
            continue
        out.append(("alloc" if e.allocated > 0 or e.requested > 0 else "free", e.serial,
                    e.requested))
    return out


def fill_reserved_and_context(
    result: ScenarioResult, rt: VirtualDevices, context_bytes: int
) -> None:
    """Set ``peak_reserved_bytes`` and ``context_bytes`` of each device (where unset).

    The swap point for the lead: once the backend fills these fields itself, this does
    nothing. Reserved memory is the simulated caching allocator's peak over the whole run
    (segments are kept, so the warm-up counts); a DDP rank stands for every rank.
    """
    reserved: dict[int, int] = {}
    for d in result.devices:
        src = 0 if d.rank is not None else d.index  # DDP: rank 0 was emulated for all
        if d.peak_reserved_bytes is None:
            if src not in reserved:
                evs = _events(rt, src)
                reserved[src] = simulate(evs, timeline_points=None).peak_reserved_bytes
            d.peak_reserved_bytes = max(reserved[src], d.peak_allocated_bytes)
        if d.context_bytes is None and d.used:
            d.context_bytes = context_bytes


def reserved_inspector(context_bytes: int) -> Callable[[VirtualDevices, ScenarioResult], None]:
    """An ``EmulationConfig.inspect`` hook that counts reserved memory and the context."""
    def inspect(rt: VirtualDevices, result: ScenarioResult) -> None:
        fill_reserved_and_context(result, rt, context_bytes)
    return inspect


@dataclass
class _Probe:
    fits: bool
    worst_device: int | None
    worst_total_bytes: int
    status: str
    message: str


Probe = Callable[[int], _Probe]


def probe_emulated(
    name: str, wl: Workload, base: EmulationConfig, context_bytes: int
) -> Probe:
    """Emulate ``name`` at a batch; does every used device's total fit the capacity?"""
    cfg0 = dataclasses.replace(base, inspect=reserved_inspector(context_bytes))

    def probe(batch: int) -> _Probe:
        s = run_scenario(name, wl, dataclasses.replace(cfg0, batch=batch))
        if s.status == STATUS_ERROR:
            return _Probe(False, None, 0, s.status, s.message)
        used = [d for d in s.devices if d.used]
        worst = max(used, key=lambda d: d.total_peak_bytes)
        return _Probe(s.status == STATUS_OK, worst.index, worst.total_peak_bytes, s.status,
                      s.message)

    return probe


def search(probe: Probe, multiple_of: int = 1, upper: int = DEFAULT_UPPER,
           capacity_bytes: int | None = None) -> tuple[int | None, dict[int, _Probe], bool]:
    """Largest ``k * multiple_of`` (k >= 1) that fits; the probes run (by batch); whether
    the search stopped at ``upper``. ``capacity_bytes`` lets it extrapolate the boundary
    from two probes (otherwise it doubles). Assumes fitting is monotone in the batch.
    """
    m = multiple_of
    kmax = max(1, upper // m)
    cache: dict[int, _Probe] = {}

    def at(k: int) -> _Probe:
        if k not in cache:
            cache[k] = probe(k * m)
        return cache[k]

    def rows(cache_: dict[int, _Probe]) -> dict[int, _Probe]:
        return {k * m: v for k, v in cache_.items()}

    first = at(1)
    if not first.fits:
        return None, rows(cache), False
    lo, hi = 1, None  # lo fits; hi (once known) does not

    def secant(ka: int, kb: int) -> int | None:
        """Where the line through two probes crosses the capacity (regula falsi)."""
        pa, pb = cache[ka], cache[kb]
        if capacity_bytes is None or kb == ka:
            return None
        slope = (pb.worst_total_bytes - pa.worst_total_bytes) / (kb - ka)
        if slope <= 0:
            return None
        return ka + int((capacity_bytes - pa.worst_total_bytes) / slope)

    def from_below() -> int | None:
        """Extrapolate along the two largest fitting probes of different totals (reserved
        memory grows in segment-sized steps, so equal totals give no slope)."""
        fitting = sorted(j for j, q in cache.items() if q.fits)
        below = [j for j in fitting if cache[j].worst_total_bytes < cache[lo].worst_total_bytes]
        return secant(below[-1], lo) if below else None

    # Unbracketed: extrapolate (quadruple while the totals are flat); when the prediction
    # stops moving up, gallop with small doubling steps.
    k = min(kmax, max(2, 64 // m))
    step = 0
    extrapolations = 0
    while hi is None:
        p = at(k)
        if not p.fits:
            hi = k
            break
        lo = k
        if lo >= kmax:
            return lo * m, rows(cache), True
        guess = from_below()
        if step == 0 and guess is not None and guess > lo and extrapolations < 3:
            k = guess
            extrapolations += 1
        elif guess is None and step == 0 and extrapolations == 0:
            k = lo * 4
        else:
            step = max(1, lo // 1024) if step == 0 else step * 2
            k = lo + step
        k = min(k, kmax)
    # Bracketed: extrapolate from below, else interpolate between the bracket's ends; when
    # two probes in a row fail to halve the bracket, bisect once, so the search stays
    # logarithmic whatever the shape of the curve.
    widths = [hi - lo]
    while hi - lo > 1:
        guess = from_below()
        if guess is not None and guess <= lo:
            guess = lo + 1  # the boundary is right above lo: check the next step
        if guess is None or not lo < guess < hi:
            guess = secant(lo, hi)
        stalled = len(widths) >= 3 and widths[-1] * 2 > widths[-3]
        k = guess if guess is not None and lo < guess < hi and not stalled else (lo + hi) // 2
        if at(k).fits:
            lo = k
        else:
            hi = k
        widths.append(hi - lo)
    return lo * m, rows(cache), False


def run_maxbatch(
    wl: Workload, scenarios: tuple[str, ...], gpus: int, capacity_bytes: int,
    gpu: GpuSpec | None = None, multiple_of: int = 1, seed: int = 0,
    upper: int = DEFAULT_UPPER, warmup_steps: int = 1,
    progress: Callable[[str, int, int], None] | None = None,
) -> MaxBatch:
    """The largest batch each scenario fits, with reserved memory and the context counted."""
    ctx = context_bytes_for(gpu)
    base = EmulationConfig(batch=multiple_of, gpus=gpus, gpu_memory_bytes=capacity_bytes,
                           seed=seed, warmup_steps=warmup_steps)
    if gpu is not None:  # the emulator models this GPU's workspaces and kernels
        base.compute_capability = gpu.compute_capability
    # Over meta tensors the emulator fills reserved (cuBLAS workspaces included) and the
    # context itself; ``ctx`` only serves runs where it does not.
    out = MaxBatch(capacity_bytes=capacity_bytes, gpu=gpu.key if gpu else "",
                   multiple_of=multiple_of,
                   counts="peak reserved (simulated caching allocator, cuBLAS workspaces "
                   "included) + the CUDA context")
    for i, name in enumerate(scenarios):
        if progress:
            progress(name, i, len(scenarios))
        best, probes, capped = search(probe_emulated(name, wl, base, ctx), multiple_of, upper,
                                       capacity_bytes)
        entry = MaxBatchEntry(scenario=name, max_batch=best, capped=capped,
                              emulations=len(probes))
        if best is None:
            p = probes[multiple_of]
            entry.errored = p.status not in (STATUS_OK, STATUS_OOM)
            entry.message = (p.message if p.status not in (STATUS_OK, STATUS_OOM)
                             else f"batch {multiple_of} does not fit: needs "
                             f"{fmt_bytes(p.worst_total_bytes)} on cuda:{p.worst_device}")
            entry.next_needed_bytes = p.worst_total_bytes
            entry.limit_device = p.worst_device
        else:
            entry.needed_bytes = probes[best].worst_total_bytes
            nxt = probes.get(best + multiple_of)
            if nxt is not None:
                entry.next_needed_bytes = nxt.worst_total_bytes
                entry.limit_device = nxt.worst_device
            if capped:
                entry.message = f"fits up to the search bound {upper}"
        out.entries.append(entry)
    if progress:
        progress("", len(scenarios), len(scenarios))
    return out
