"""The ``cpu`` backend's ``ddp`` ranks: the per-rank body over :mod:`dpprof.backends.ranks`.

The processes (spawn or torchrun), the process group, the timeouts, the failure reporting
and the gather on rank 0 are :mod:`dpprof.backends.ranks`, shared with the ``cuda`` backend
(:mod:`dpprof.backends.cuda_ddp`: NCCL, CUDA/NVML measurements). Here (gloo by default):

* :class:`RankSpec` — everything a rank needs, picklable: the workload spec (a built-in
  name, ``module:function`` or ``file.py:function``: each process loads it itself), the
  step's options as they are (``step``: :class:`dpprof.scenarios.step.StepConfig`: the
  global batch, seed, warm-up steps, dtype, autocast, DDP's options), ``backend``
  (``"gloo"`` or ``"nccl"``), ``device`` (``"cpu"`` or ``"cuda"``:
  rank r uses ``cuda:LOCAL_RANK``), ``memory`` (``"profiler"``: torch.profiler allocation
  records, the CPU way; ``"cuda"``: ``torch.cuda.max_memory_allocated/reserved`` with peaks
  reset before the measured step; ``"none"``), ``return_parameters`` (send the parameters
  after the last step back, for equivalence checks) and the timeouts (``pg_timeout_s``: the
  collective timeout and the bound on every wait; ``grace_s``: after a failure, how long
  rank 0 waits for the others' outcomes; ``join_timeout_s``: the whole spawned run).
* :func:`run_rank(spec, rank, world_size, local_rank)` — the per-rank step, in a process
  whose default process group is already initialised: builds the model on its device
  and takes rank r's shard of each step's global batch by the one seed rule
  (:mod:`dpprof.scenarios.step`), wraps it in ``DistributedDataParallel`` with the
  options, runs ``warmup_steps`` steps and one measured iteration of the shared
  :func:`dpprof.scenarios.measured_loop.training_loop`, and returns a :class:`RankResult`.
* :class:`CpuRanks` — the picklable body :mod:`dpprof.backends.ranks` runs in each rank:
  :func:`run_rank` for each spec in turn.
* :func:`launch(spec, world_size)` / :func:`launch_many(specs, world_size)` — dpprof starts
  the ranks itself (:func:`dpprof.backends.ranks_spawn.spawn_ranks`); returns the results
  by rank, or raises :class:`DistributedRunError` carrying every failed rank's traceback.
* :func:`torchrun_main(spec)` — under ``torchrun``: :func:`dpprof.backends.ranks.run_in_group`
  from the environment; rank 0 returns every rank's :class:`RankResult` (or raises
  :class:`DistributedRunError`), other ranks return ``None``.
* :func:`free_port` — from :mod:`dpprof.backends.ranks`.

Memory with ``memory="profiler"``: the profiler runs from before the model is built, so
the live bytes at the measured step's start are known: ``peak_requested_bytes`` is the
peak of live requested bytes over the measured iteration (absolute),
``step_peak_requested_bytes`` the same relative to the step's start, ``step_events`` the
measured step's allocation records (signed sizes, in order).
"""

from __future__ import annotations

import contextlib
import gc
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from dpprof.backends.memtrace import (
    SCALAR_BYTES,
    Alloc,
    allocations,
    peak_of,
    start_profiler,
    step_span,
    stop_profiler,
)
from dpprof.backends.ranks import (
    Group,
    RankInfo,
    RankOutcome,
    free_port,
    run_in_group,
    torchrun_info,
    torchrun_run_id,
)
from dpprof.backends.ranks_spawn import spawn_ranks
from dpprof.emulator.emulated_autocast import CudaAutocastNames, StepAutocast
from dpprof.scenarios.measured_loop import StepHooks, training_loop
from dpprof.scenarios.step import StepConfig, build_model, scenario_batch, step_stream
from dpprof.scenarios.workloads import Workload, load_workload, map_tensors

STEP_MARK = "dpprof::measured_step"  # record_function around the measured iteration


@dataclass
class RankSpec:
    workload: str  # built-in name, module.path:function or path/file.py:function
    # the step's options as they are: every rank takes ceil(batch / world) rows
    step: StepConfig = field(default_factory=StepConfig)
    backend: str = "gloo"  # "gloo" | "nccl"
    device: str = "cpu"  # "cpu" | "cuda" (cuda:LOCAL_RANK)
    memory: str = "profiler"  # "profiler" | "cuda" | "none"
    return_parameters: bool = False
    wrap: str = "ddp"  # "ddp" | "none" (the bare model: the single scenario, no group needed)
    # --amp on a CPU rank: "emulated" (the GPU's op lists, as the emulated scenarios beside
    # it) or "native" (torch.autocast("cpu"): what the checks compare the emulator with)
    autocast: str = "emulated"
    pg_timeout_s: float = 120.0  # process-group (collective) timeout
    join_timeout_s: float = 600.0  # the whole run, from start to the last result
    grace_s: float = 10.0  # after one rank fails, how long the others may take to fail



@dataclass
class RankResult:
    rank: int
    world_size: int
    loss: float | None = None
    step_time_s: float | None = None  # the measured step, wall clock
    peak_requested_bytes: int | None = None  # absolute, over the measured step
    peak_allocated_bytes: int | None = None  # same, each block rounded to 512 B / cuda
    peak_reserved_bytes: int | None = None  # cuda only
    start_requested_bytes: int | None = None  # live at the measured step's start
    # the same, of blocks larger than memtrace.SCALAR_BYTES (what the fidelity checks compare)
    start_large_requested_bytes: int | None = None
    step_peak_requested_bytes: int | None = None  # relative to the step's start
    step_events: list[tuple[int, str, int]] = field(default_factory=list)  # (size, op, ptr)
    parameters: dict[str, list[Any]] | None = None  # name -> nested list (return_parameters)
    hostname: str = ""


class DistributedRunError(RuntimeError):
    """One or more ranks failed; ``failures`` maps rank -> traceback (or reason), the rank
    that caused it (``culprit``, :func:`dpprof.backends.ranks.blame`) first."""

    def __init__(self, failures: dict[int, str], culprit: int | None = None,
                 messages: dict[int, str] | None = None) -> None:
        ordered = sorted(failures.items(), key=lambda kv: (kv[0] != culprit, kv[0]))
        self.failures = dict(ordered)
        self.culprit = ordered[0][0]
        self.messages = messages or {}
        lines = ordered[0][1].strip().splitlines()
        summary = self.messages.get(self.culprit) or (lines[-1] if lines else "failed")
        others = len(self.failures) - 1
        then = f" (then {others} other rank(s) failed after it)" if others else ""
        super().__init__(f"rank {self.culprit} failed: {summary}{then}")

    def culprit_traceback(self) -> str:
        """The failing rank's own traceback (or why there is none)."""
        return self.failures[self.culprit]

    def others(self) -> str:
        """One line: how the other ranks failed after the culprit."""
        return "; ".join(f"rank {r}: {self.messages.get(r) or tb.strip().splitlines()[-1]}"
                         for r, tb in self.failures.items() if r != self.culprit and tb.strip())

    def details(self) -> str:
        return "\n".join(f"--- rank {r} ---\n{tb.rstrip()}" for r, tb in self.failures.items())


def run_rank(spec: RankSpec, rank: int, world_size: int,
             local_rank: int | None = None) -> RankResult:
    """One rank's DDP training: build, wrap, warm up, measure (see the module docstring)."""
    step = spec.step
    wl = step.workload(load_workload(spec.workload))
    device = torch.device("cpu") if spec.device == "cpu" else torch.device(
        "cuda", rank if local_rank is None else local_rank)
    result = RankResult(rank=rank, world_size=world_size, hostname=socket.gethostname())
    prof = None
    # What an earlier run in this process left in reference cycles (an FSDP2 model's
    # modules and hooks) is collected now, not by a collection the profiled run happens
    # to trigger: its frees, of blocks allocated before profiling, would count as this
    # run's (an FSDP2 rank's start 3.7 MB low after another model's run)
    gc.collect()
    if spec.memory == "profiler":
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        start_profiler(prof)  # without libkineto's start/stop lines on stderr
    try:
        model, loss_fn = _model_on_device(wl, device, step.seed)
        ddp = model if spec.wrap == "none" else step.ddp.wrap(
            model, [device.index] if device.type == "cuda" else None)
        opt = _foreach_optimizer(wl, model, loss_fn)
        model.train()
        # --amp: forward and loss
        amp = StepAutocast(step.amp, device.type, native=spec.autocast == "native")
        # The loader's host batches, one per iteration, made before the loop: every rank
        # makes the same global batch and takes its shard (the one seed rule).
        batches = [scenario_batch(wl, step.seed, k, step.batch, world_size, rank)
                   for k in range(step.warmup_steps("cpu") + 1)]

        def move(x: Any, is_target: bool) -> Any:
            # On the CPU the host-to-device copy a GPU run makes is a copy too.
            return map_tensors(x, lambda t: t.clone() if device.type == "cpu" else t.to(device))

        iteration = _timed_iteration(spec, device, result)
        # the workload's own torch.autocast("cuda"), as the emulated scenarios run it
        names = CudaAutocastNames() if device.type != "cuda" else contextlib.nullcontext()
        with amp, names, step_stream(step.seed):
            loss = training_loop(
                ddp, loss_fn, opt, batches, move, False,
                StepHooks(iteration=iteration,
                          phase=amp.phase(lambda name: contextlib.nullcontext())),
                step=wl.step, micro_batches=step.micro_batches)
        del batches
        result.loss = None if loss is None else float(loss)
        del loss
        if spec.memory == "cuda":
            result.peak_allocated_bytes = int(torch.cuda.max_memory_allocated(device))
            result.peak_reserved_bytes = int(torch.cuda.max_memory_reserved(device))
        if spec.return_parameters:
            result.parameters = {n: p.detach().cpu().tolist()
                                 for n, p in model.named_parameters()}
    finally:
        if prof is not None:
            stop_profiler(prof)
    if prof is not None and result.step_time_s is not None:
        span = step_span(prof, STEP_MARK)
        if span is not None:
            _profiler_figures(result, allocations(prof), *span)
    return result


def _model_on_device(wl: Workload, device: torch.device,
                     seed: int) -> tuple[torch.nn.Module, Any]:
    """As the emulator: the model built on the host, then moved to the rank's device (and
    the loss module, if the loss is one), in the workload's dtype."""
    import copy

    model = build_model(wl, seed).to(device)
    if wl.dtype != torch.float32:
        model.to(wl.dtype)
    loss_fn = wl.loss
    if isinstance(loss_fn, torch.nn.Module):
        loss_fn = copy.deepcopy(loss_fn).to(device)
        if wl.dtype != torch.float32:
            loss_fn.to(wl.dtype)
    return model, loss_fn


def _foreach_optimizer(wl: Workload, model: torch.nn.Module,
                       loss_fn: Any) -> torch.optim.Optimizer:
    """The workload's optimizer over the model's (and the loss module's) parameters, with
    the foreach implementation, as on CUDA and as the emulator."""
    params = list(model.parameters())
    if isinstance(loss_fn, torch.nn.Module):
        params += list(loss_fn.parameters())
    opt = wl.optimizer(params)
    for group in opt.param_groups:
        if group.get("foreach") is None and not group.get("fused"):
            group["foreach"] = True  # as on CUDA, and as the emulator
    return opt


def _timed_iteration(spec: RankSpec, device: torch.device, result: RankResult
                     ) -> Callable[[int, bool], contextlib.AbstractContextManager[None]]:
    """The loop's ``iteration`` hook: the measured step timed (and marked for the
    profiler), the allocator's peaks reset at its start where they are read."""

    @contextlib.contextmanager
    def iteration(k: int, measured: bool) -> Iterator[None]:
        if not measured:
            yield
            return
        if spec.memory == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        with torch.profiler.record_function(STEP_MARK):
            yield
        if spec.device == "cuda":
            torch.cuda.synchronize(device)
        result.step_time_s = time.perf_counter() - t0

    return iteration


def _profiler_figures(result: RankResult, events: list[Alloc], t0: int, t1: int) -> None:
    before = [e for e in events if e.t_ns < t0]
    step = [e for e in events if t0 <= e.t_ns <= t1]
    start = sum(e.size for e in before)
    result.start_requested_bytes = start
    result.start_large_requested_bytes = sum(e.size for e in before if abs(e.size) > SCALAR_BYTES)
    result.step_peak_requested_bytes = peak_of(step)
    result.peak_requested_bytes = start + result.step_peak_requested_bytes
    result.peak_allocated_bytes = peak_of(before + step, rounded=True) if step else None
    result.step_events = [(e.size, e.op, e.ptr) for e in step]


# ---- the ranks: the shared layer (dpprof.backends.ranks) runs this body --------------------


@dataclass
class CpuRanks:
    """The per-rank body: :func:`run_rank` for each spec in turn; picklable."""

    specs: list[RankSpec]

    def group(self, run_id: str | None = None) -> Group:
        spec = self.specs[0]
        kwargs: dict[str, Any] = {} if run_id is None else {"run_id": run_id}
        return Group(backend=spec.backend, device=spec.device, timeout_s=spec.pg_timeout_s,
                     grace_s=spec.grace_s, join_timeout_s=spec.join_timeout_s, **kwargs)

    def __call__(self, info: RankInfo, device_index: int) -> list[RankResult]:
        return [run_rank(spec, info.rank, info.world_size, local_rank=device_index)
                for spec in self.specs]

    def succeeded(self, value: Any) -> bool:
        return True  # a failure raises


def _results(outcomes: list[RankOutcome]) -> list[list[RankResult]]:
    failures = {o.rank: o.traceback or o.message for o in outcomes if not o.ok}
    if failures:
        culprit = next((o.rank for o in outcomes if o.first_failure), None)
        raise DistributedRunError(failures, culprit,
                                  {o.rank: o.message for o in outcomes if not o.ok})
    return [o.value for o in sorted(outcomes, key=lambda o: o.rank)]


def launch(spec: RankSpec, world_size: int) -> list[RankResult]:
    """Start ``world_size`` processes, run :func:`run_rank` in each, return by rank."""
    return [r[0] for r in launch_many([spec], world_size)]


def launch_many(specs: list[RankSpec], world_size: int) -> list[list[RankResult]]:
    """As :func:`launch` for several specs run one after another in the same processes and
    process group (start-up paid once); results by rank, then by spec. The first spec's
    backend, device and timeouts apply to the group."""
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    if not specs:
        return [[] for _ in range(world_size)]
    body = CpuRanks(list(specs))
    return _results(spawn_ranks(body.group(), body, world_size))


# ---- torchrun starts the ranks -----------------------------------------------------------


def torchrun_main(spec: RankSpec) -> list[RankResult] | None:
    """Under torchrun: run this rank, gather every result on rank 0 (others get None)."""
    info = torchrun_info()
    if info is None:
        raise RuntimeError("torchrun_main needs RANK, WORLD_SIZE and LOCAL_RANK (torchrun)")
    body = CpuRanks([spec])
    outcomes = run_in_group(body.group(torchrun_run_id()), body, info)
    return None if outcomes is None else [r[0] for r in _results(outcomes)]


__all__ = [
    "CpuRanks",
    "DistributedRunError",
    "RankResult",
    "RankSpec",
    "free_port",
    "launch",
    "launch_many",
    "run_rank",
    "torchrun_main",
]
