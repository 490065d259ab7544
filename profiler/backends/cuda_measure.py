"""One process's measurement of one cuda-backend scenario, shared by the in-process
scenarios (:func:`dpprof.backends.cuda.run_local_scenario`) and each DDP rank
(:func:`dpprof.backends.cuda_ddp.measure_ddp_rank`).

Every scenario runs the one shared loop, :func:`~dpprof.scenarios.measured_loop.training_loop`
(:class:`MeasuringLoop`): ``warmup_steps`` iterations, then ``steps`` measured ones.
Memory is read two ways:

- the caching allocator's view: ``torch.cuda.reset_peak_memory_stats`` at the start of each
  phase (input transfer, zero_grad, forward, loss, backward, optimizer step) of the first
  measured step, ``max_memory_allocated`` / ``max_memory_reserved`` at its end (the device is
  synchronised at both ends; :class:`PhaseRecorder`); the overall peaks cover every measured
  step;
- NVML's view, from :class:`~dpprof.backends.nvml_watch.NvmlWatch` (every 20 ms by default):
  what NVML sees beyond the allocator's reserve (context, NCCL, other processes) is kept as
  ``nvml_unexplained_bytes``.

Step time is the wall clock around each measured step (ended by a synchronise) and, on CUDA,
``torch.cuda.Event`` timing on the first device's current stream; median and max - min
(:func:`finish_result`).

An out-of-memory error is a result (:func:`record_failure`): caught, parsed (device, bytes
asked for), recorded with the phase and the peaks so far.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from dpprof.backends.cuda_host import DeviceOps, host
from dpprof.backends.cuda_oom import find_oom, is_oom, one_line
from dpprof.backends.nvml_watch import NvmlWatch
from dpprof.emulator.emulated_autocast import StepAutocast
from dpprof.nvml import libnvml
from dpprof.nvml.queries import NvmlBackend
from dpprof.result import (
    STATUS_ERROR,
    STATUS_OK,
    STATUS_OOM,
    DeviceResult,
    ScenarioResult,
)
from dpprof.scenarios.measured_loop import StepHooks, UserStep, error_site, training_loop
from dpprof.scenarios.step import Batch, StepConfig, build_model, scenario_batch, step_stream
from dpprof.scenarios.workloads import Workload, make_optimizer, map_tensors
from dpprof.units import fmt_bytes

__all__ = [
    "DEFAULT_NVML_INTERVAL_S",
    "CudaRunConfig",
    "LoopArgs",
    "Measured",
    "MeasuringLoop",
    "PhaseRecorder",
    "StepBatches",
    "finish_result",
    "measure_loop",
    "model_on_device",
    "record_failure",
    "step_closure",
    "watch_for",
]

DEFAULT_NVML_INTERVAL_S = 0.02


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


def model_on_device(wl: Workload, device: torch.device, seed: int) -> tuple[nn.Module, Any]:
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
    model, loss_fn = model_on_device(wl, dev, seed)
    opt = make_optimizer(wl, model, loss_fn)
    model.train()
    batch = [scenario_batch(wl, seed, 0, rows, 1, 0)]

    def move(x: Any, is_target: bool) -> Any:
        return map_tensors(x, lambda t: t.clone() if dev.type == "cpu" else t.to(dev))

    def step() -> None:
        training_loop(model, loss_fn, opt, batch, move, False, step=wl.step)

    return step


class MeasuringLoop:
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


class LoopArgs(NamedTuple):
    """What a scenario hands :meth:`MeasuringLoop.loop`: its model as wrapped, the loss,
    the optimizer, the batches, whether the loss is inside forward, the user's own step."""

    wrapped: Callable[..., Any]
    loss_fn: Any
    opt: torch.optim.Optimizer
    batches: StepBatches
    loss_inside: bool
    wl_step: UserStep | None


def measure_loop(ops: DeviceOps, cfg: CudaRunConfig, logical: Sequence[int],
                 watch: NvmlWatch, out: Measured, setup: Callable[[], LoopArgs]
                 ) -> MeasuringLoop | None:
    """The measured loop of one process's scenario (a DataParallel or single scenario, a
    DDP rank): ``setup`` builds what it runs, inside the loop's frame; a failure (out of
    memory or any error) recorded in ``out``, never raised; the memory given back before
    returning. The loop (None where it never started), for its per-device results."""
    run: MeasuringLoop | None = None

    def body() -> None:  # its frame holds the tensors: gone with the exception
        nonlocal run
        run = MeasuringLoop(ops, cfg, logical, watch)
        args = setup()
        run.loop(*args[:5], out, args.wl_step)
        run.fold_phases()

    try:
        with watch:
            body()
    except Exception as exc:
        record_failure(out, exc, run, cfg)
    ops.release()  # after the except block: the exception, its frames and tensors are gone
    return run


def record_failure(
    out: Measured, exc: BaseException, run: MeasuringLoop | None, cfg: CudaRunConfig
) -> None:
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


def watch_for(
    ops: DeviceOps,
    cfg: CudaRunConfig,
    nvml: NvmlBackend | None,
    cuda_uuids: Sequence[str] | None,
    pids: Sequence[int],
    others: Sequence[int] = (),
) -> NvmlWatch:
    """The (not yet started) :class:`NvmlWatch` over ``ops``' devices: the machine's NVML
    and CUDA UUIDs where the caller gives none and the devices are CUDA's; ``others``:
    dpprof's own other processes, whose memory there is left out (:class:`NvmlWatch`)."""
    if nvml is None and ops.kind == "cuda":
        nvml = libnvml.default_nvml()
    if cuda_uuids is None and ops.kind == "cuda":
        cuda_uuids = host().uuids()
    return NvmlWatch(nvml, cfg.nvml_interval_s, cuda_uuids, pids, others=others)


def finish_result(result: ScenarioResult, out: Measured, cfg: CudaRunConfig,
                  samples_per_step: int) -> ScenarioResult:
    """``result`` with the timing, status and OOM fields of ``out``; throughput is the
    samples one step trains (``single``: its ``ceil(B / N)`` rows; DataParallel and DDP: the
    batch) over the median step time."""
    times = out.step_times_s
    step_time_s = statistics.median(times) if times else result.step_time_s
    return dataclasses.replace(
        result, status=out.status, message=out.message, loss=out.loss,
        oom_device=out.oom_device, oom_bytes=out.oom_bytes, oom_phase=out.oom_phase,
        notes=(*result.notes, *out.notes), step_times_s=tuple(times),
        step_time_s=step_time_s,
        step_time_spread_s=max(times) - min(times) if times else result.step_time_spread_s,
        throughput_samples_per_s=(samples_per_step / step_time_s if times and step_time_s
                                  else result.throughput_samples_per_s),
        event_step_time_s=(statistics.median(out.event_times_s) if out.event_times_s
                           else result.event_step_time_s),
        traceback=(out.traceback if out.traceback and (out.status == STATUS_ERROR or cfg.debug)
                   else result.traceback))
