"""The figures an emulated scenario reports, read off its virtual devices: each device's
peaks and categories (:func:`device_result`, :func:`device_results`, every DDP rank alike:
:func:`ddp_ranks`), its timeline (:func:`timeline_points`, a mirror's:
:func:`shift_timeline`), and the verdict against the GPU's memory (:func:`judge`)."""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from dpprof.backends.emulated_config import EmulationConfig
from dpprof.emulator.allocator_config import AllocatorConfig
from dpprof.emulator.context import ContextModel
from dpprof.emulator.cuda_devices import CudaDevices
from dpprof.emulator.ddp import UNREAPED_BUCKETS
from dpprof.emulator.nccl_memory import NcclRankMemory
from dpprof.emulator.reserved import AllocationEvent, GpuOverheads, gpu_overheads
from dpprof.emulator.stand_in_values import STAND_INS
from dpprof.emulator.virtual_devices import VirtualDevices
from dpprof.result import STATUS_OK, STATUS_OOM, DeviceResult, ScenarioResult, TimelinePoint
from dpprof.scenarios.kind import Scenario
from dpprof.units import fmt_bytes

__all__ = [
    "TIMELINE_POINTS",
    "apply_overheads",
    "ddp_ranks",
    "device_result",
    "device_results",
    "judge",
    "placed_devices",
    "shift_timeline",
    "stand_in_note",
    "timeline_points",
    "transient_note",
    "with_gpu_overheads",
]

TIMELINE_POINTS = 400  # points kept per device and scenario (maxima of equal slices)
# what each kind of transient (StorageLedger.note_transient) is, for the notes
TRANSIENT_WORDS = {
    UNREAPED_BUCKETS: (
        "DDP's first-iteration gradient buckets, replaced by its rebuild but kept by their "
        "NCCL all-reduce until the process group's watchdog reaps it (within ~100 ms: the "
        "early steps of a fast loop)"),
}


def judge(result: ScenarioResult, cfg: EmulationConfig) -> ScenarioResult:
    """``result`` with status "oom" (the first device over the GPU's memory) or "ok"."""
    # total_peak_bytes: allocated, or reserved + context where they were counted.
    over = [d for d in result.devices if d.total_peak_bytes > cfg.gpu_memory_bytes]
    if not over:
        return dataclasses.replace(result, status=STATUS_OK)
    worst = over[0]
    return dataclasses.replace(
        result, status=STATUS_OOM, oom_device=worst.index, oom_bytes=worst.total_peak_bytes,
        message=(
            f"out of memory on cuda:{worst.index}: needs {fmt_bytes(worst.total_peak_bytes)}"
            f" at its peak ({worst.peak_phase}), has {fmt_bytes(cfg.gpu_memory_bytes)}"))


def with_gpu_overheads(devices: Sequence[DeviceResult], events: Iterable[AllocationEvent],
                       ctx: ContextModel,
                       source: Callable[[DeviceResult], int] | None = None,
                       nccl: bool | None = None,
                       blas_first: Mapping[tuple[int, str], int] | None = None,
                       blas_side: Mapping[tuple[int, str, int], tuple[int, int]] | None = None,
                       transients: Mapping[int, tuple[int, str]] | None = None,
                       config: AllocatorConfig | None = None,
                       own_nccl_bytes: Mapping[int, int] | None = None,
                       ) -> tuple[DeviceResult, ...]:
    """``devices`` with the caching allocator's reserve and the context each used one holds
    (:func:`~dpprof.emulator.reserved.gpu_overheads`, with these options); an unused device
    as it was."""
    figures = gpu_overheads(devices, events, ctx, source=source, nccl=nccl,
                            blas_first=blas_first, blas_side=blas_side, transients=transients,
                            config=config, own_nccl_bytes=own_nccl_bytes)
    return apply_overheads(devices, figures)


def apply_overheads(devices: Sequence[DeviceResult], figures: Sequence[GpuOverheads | None]
                    ) -> tuple[DeviceResult, ...]:
    """``devices`` with their :func:`~dpprof.emulator.reserved.gpu_overheads` (in order;
    None: an unused device, as it was)."""
    return tuple(d if f is None else dataclasses.replace(
        d, peak_reserved_bytes=f.peak_reserved_bytes, workspace_bytes=f.workspace_bytes,
        context_bytes=f.context_bytes, context_breakdown_bytes=dict(f.context_breakdown_bytes),
        steady_peak_reserved_bytes=(d.steady_peak_reserved_bytes
                                    if f.steady_peak_reserved_bytes is None
                                    else f.steady_peak_reserved_bytes))
        for d, f in zip(devices, figures, strict=True))


def clique_note(memory: Mapping[int, NcclRankMemory]) -> str | None:
    """The report's words on the NCCL memory of a process's own communicators
    (:func:`dpprof.emulator.context.clique_nccl_memory`; None: no communicator)."""
    if not memory:
        return None
    first = memory[min(memory)]
    devices = ", ".join(f"cuda:{d}" for d in sorted(memory))
    settings = [n for n in first.notes if n.startswith("NCCL setting")]
    return (f"NCCL's communicators on {devices} (torch.cuda.comm's broadcast and reduce, "
            "DataParallel's: one a GPU, the ring's connections alone) hold "
            f"{fmt_bytes(first.low_bytes)}-{fmt_bytes(first.high_bytes)} a GPU outside the "
            "allocator, the high end counted (modelled from NCCL's source)"
            + "".join(f"; {n}" for n in settings))


def transient_note(d: DeviceResult, who: str | None = None) -> str | None:
    """What a device's peak counts beyond the steady state, and the steady state's peaks
    (None: nothing); ``who``: the device's words (default ``cuda:N``)."""
    if not d.transient_bytes:
        return None
    what = "; ".join(f"{fmt_bytes(b)} of {TRANSIENT_WORDS.get(k, k.replace('_', ' '))}"
                     for k, b in sorted(d.transient_bytes.items()))
    steady = [f"{fmt_bytes(v)} {name}" for v, name in
              ((d.steady_peak_allocated_bytes, "allocated"),
               (d.steady_peak_reserved_bytes, "reserved")) if v is not None]
    return (f"{who or f'cuda:{d.index}'}'s peak is the worst case a real run reaches: it "
            f"counts {what}. "
            + (f"Once they are gone (the steady state): {', '.join(steady)}." if steady
               else ""))


def placed_devices(rt: VirtualDevices) -> list[int]:
    """The devices the model used: cuda:0, and any other it placed layers on itself."""
    return [0] + [i for i in range(1, rt.num_devices) if rt.storages.counters[i].peak_allocated > 0]


def stand_in_note(rt: CudaDevices) -> str:
    """The values read from emulated tensors (``.item()`` & co.) and where."""
    st = rt.stand_ins
    kinds = ", ".join(f"{k} x{v}" for k, v in sorted(st.counts.items()))
    sites = "; ".join(f"{s} x{c}" for s, c in list(st.sites.items())[:3])
    return (f"{st.total} value(s) read from emulated tensors answered with stand-ins "
            f"({kinds}: {STAND_INS}): {sites}")


def device_result(rt: VirtualDevices, i: int, index: int, capacity_bytes: int, used: bool,
                  batch_rows: int, timeline: Sequence[TimelinePoint],
                  start: int = 0) -> DeviceResult:
    """Virtual device ``i``'s figures (its peaks, the categories at its peak moment, the
    phase of the peak), reported as ``index``; where transients are alive at the peak
    (``rt.storages.note_transient``), the peak once they are gone (from event ``start`` on)."""
    c = rt.storages.counters[i]
    snap = rt.storages.peak_snapshot(i)
    steady = rt.storages.steady_peak(i, start)
    return DeviceResult(
        index=index,
        peak_allocated_bytes=c.peak_allocated,
        peak_requested_bytes=c.peak_requested,
        capacity_bytes=capacity_bytes,
        breakdown_bytes={k: v for k, v in sorted(snap.by_category.items()) if v},
        peak_phase=c.peak_phase,
        used=used,
        batch_rows=batch_rows,
        timeline=tuple(timeline),
        transient_bytes=steady.transient_bytes if steady else {},
        steady_peak_allocated_bytes=steady.allocated_bytes if steady else None,
    )


def ddp_ranks(template: DeviceResult, world: int) -> list[DeviceResult]:
    """Every DDP rank runs the same program on as many rows: ``template`` (rank 0's device)
    stands for all ``world`` ranks."""
    return [DeviceResult(**{**template.__dict__, "index": r, "rank": r, "used": True,
                            "timeline": tuple(template.timeline)})
            for r in range(world)]


def device_results(
    rt: VirtualDevices, cfg: EmulationConfig, kind: Scenario | None, shards: list[int],
    used: list[int], measure_start: int, sources: dict[int, int],
) -> list[DeviceResult]:
    """Each device's figures; a mirror's (:meth:`ReplicaMirrors.mirror_shift`) are its
    device's and every DDP rank's are rank 0's, noted in ``sources`` (the device shown ->
    the one whose event sequence it is)."""
    assert kind is not None
    # DDP: rank 0's device stands for every rank; single: the GPUs a model-parallel model
    # placed itself on, else one; DataParallel: every GPU
    shown = kind.shown_devices(rt.num_devices, used)
    out: list[DeviceResult] = []
    for i in range(shown):
        rows = kind.rows_of(shards, i)
        of = rt.mirrors.mirrored_device(i)
        shift = None if of is None or of > i else rt.mirrors.mirror_shift(i, of)
        if shift is not None:  # a mirror: its device's figures, the timeline shifted
            assert of is not None
            sources[i] = of
            src = out[of]
            out.append(DeviceResult(**{
                **src.__dict__, "index": i, "used": i in used, "batch_rows": rows,
                "timeline": shift_timeline(rt, src.timeline, shift, measure_start)}))
            continue
        out.append(device_result(rt, i, i, cfg.gpu_memory_bytes, i in used, rows,
                                 [] if cfg.peaks_only else timeline_points(rt, i, measure_start),
                                 measure_start))
    if kind.ranks_alike:
        sources.update(dict.fromkeys(range(cfg.gpus), 0))
        return ddp_ranks(out[0], cfg.gpus)
    return out



def shift_timeline(rt: VirtualDevices, points: Sequence[TimelinePoint], shift: int,
                   start: int) -> tuple[TimelinePoint, ...]:
    """A mirror's timeline from its device's (:meth:`ReplicaMirrors.mirror_shift`): every
    point but the window's first ``shift`` events later, each labelled with its own
    phase (a phase may begin between an event and its mirror's)."""
    marks = [(m.event_index, m.name) for m in rt.storages.phases if m.event_index >= start]
    firsts = [idx for idx, _ in marks]
    names = ["", *(name for _, name in marks)]
    out = list(points[:1])
    for p in points[1:]:
        t = p.t + shift
        out.append(TimelinePoint(t, p.allocated_bytes,
                                 names[bisect.bisect_right(firsts, start + int(t))],
                                 p.used_bytes))
    return tuple(out)


def timeline_points(rt: VirtualDevices, index: int, start: int, *,
                    phase_before_start: bool = False) -> list[TimelinePoint]:
    """Device ``index``'s live bytes from event ``start`` on, each point labelled with its
    phase, kept to at most :data:`TIMELINE_POINTS` (the maximum of each equal slice).

    ``phase_before_start``: a point before the window's first phase mark carries the phase
    begun before the window (``dpprof run``, whose window starts mid-phase); otherwise it
    is unlabelled (``compare``, whose window starts at a phase mark).
    """
    at, live = rt.storages.timeline_arrays(index, start)
    marks = [(m.event_index, m.name) for m in rt.storages.phases
             if phase_before_start or m.event_index >= start]

    def phase_at(ev: int) -> str:
        name = ""
        for idx, p in marks:
            if idx <= ev:
                name = p
            else:
                break
        return name

    if len(at) > TIMELINE_POINTS:
        # the maximum of each equal slice (its first point where several reach it)
        step = len(at) / TIMELINE_POINTS
        bounds = [(int(k * step), int((k + 1) * step) or len(at))
                  for k in range(TIMELINE_POINTS)]
        bounds = [(a, b) for a, b in bounds if b > a]
        starts = np.array([a for a, _ in bounds])
        ends = np.array([b for _, b in bounds])
        used = live[: ends[-1]]  # the slices follow each other from 0 to the last's end
        slice_of = np.repeat(np.arange(len(bounds)), ends - starts)
        hit = np.flatnonzero(used == np.maximum.reduceat(used, starts)[slice_of])
        first = hit[np.unique(slice_of[hit], return_index=True)[1]]
        at, live = at[first], live[first]
    return [TimelinePoint(float(ev - start), b, phase_at(ev))
            for ev, b in zip(at.tolist(), live.tolist(), strict=True)]
