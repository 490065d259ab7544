"""Real ``DistributedDataParallel``: one process per rank, started by dpprof or by torchrun.

The ``ddp`` scenario of the ``cpu`` backend (gloo) and, later, of the ``cuda`` backend
(NCCL) runs here. Interface:

* :class:`RankSpec` — everything a rank needs, picklable: the workload spec (a built-in
  name, ``module:function`` or ``file.py:function``: each process loads it itself), rows
  per rank, seed, warm-up steps, the DDP options, ``backend`` (``"gloo"`` or ``"nccl"``),
  ``device`` (``"cpu"`` or ``"cuda"``: rank r uses ``cuda:LOCAL_RANK``), ``memory``
  (``"profiler"``: torch.profiler allocation records, the CPU way; ``"cuda"``:
  ``torch.cuda.max_memory_allocated/reserved`` with peaks reset before the measured step;
  ``"none"``), ``return_parameters`` (send the parameters after the last step back, for
  equivalence checks) and the timeouts.
* :func:`run_rank(spec, rank, world_size, local_rank)` — the per-rank step, in a process
  whose default process group is already initialised (:func:`init_process_group`):
  builds the model on its device under ``torch.manual_seed(seed)``, wraps it in
  ``DistributedDataParallel`` with the options, takes rank r's shard of the global batch,
  runs ``warmup_steps`` steps and one measured step of the shared
  :func:`dpprof.scenarios.base.train_step`, and returns a :class:`RankResult`.
* :func:`launch(spec, world_size)` — dpprof starts the ranks itself: a free TCP port on
  127.0.0.1, one ``spawn``-ed process per rank, process-group timeout
  ``spec.pg_timeout_s``, a join deadline ``spec.join_timeout_s``; returns the results by
  rank, or raises :class:`DistributedRunError` carrying every failed rank's traceback (the
  other ranks are terminated after ``spec.grace_s``, so nothing hangs).
* :func:`torchrun_main(spec)` — under ``torchrun`` (``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` in the environment): initialises the
  group from the environment, runs :func:`run_rank`, and rank 0 gathers every rank's
  :class:`RankResult` with ``gather_object`` (other ranks return ``None``).

Memory with ``memory="profiler"``: the profiler runs from before the model is built, so
the live bytes at the measured step's start are known: ``peak_requested_bytes`` is the
peak of live requested bytes over the measured ``train_step`` (absolute),
``step_peak_requested_bytes`` the same relative to the step's start, ``step_events`` the
measured step's allocation records (signed sizes, in order).
"""

from __future__ import annotations

import datetime as _dt
import os
import queue as _queue
import socket
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from dpprof.memtrace import Alloc, allocations, peak_of, step_span

STEP_MARK = "dpprof::measured_step"  # record_function around the measured train_step


@dataclass
class RankSpec:
    workload: str  # built-in name, module.path:function or path/file.py:function
    rows: int  # rows of the batch per rank
    seed: int = 0
    warmup_steps: int = 1
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = False
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    backend: str = "gloo"  # "gloo" | "nccl"
    device: str = "cpu"  # "cpu" | "cuda" (cuda:LOCAL_RANK)
    memory: str = "profiler"  # "profiler" | "cuda" | "none"
    return_parameters: bool = False
    dtype: str | None = None  # override the workload's dtype (float32, bfloat16, float16)
    wrap: str = "ddp"  # "ddp" | "none" (the bare model: the single scenario, no group needed)
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
    step_peak_requested_bytes: int | None = None  # relative to the step's start
    step_events: list[tuple[int, str, int]] = field(default_factory=list)  # (size, op, ptr)
    parameters: dict[str, list[Any]] | None = None  # name -> nested list (return_parameters)
    hostname: str = ""


class DistributedRunError(RuntimeError):
    """One or more ranks failed; ``failures`` maps rank -> traceback (or reason)."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = dict(sorted(failures.items()))
        first = next(iter(self.failures.items()))
        lines = first[1].strip().splitlines()
        summary = lines[-1] if lines else "failed"
        super().__init__(
            f"{len(self.failures)} rank(s) failed: rank {first[0]}: {summary}"
        )

    def details(self) -> str:
        return "\n".join(f"--- rank {r} ---\n{tb.rstrip()}" for r, tb in self.failures.items())


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_process_group(spec: RankSpec, rank: int, world_size: int,
                       init_method: str | None = None) -> None:
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if spec.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    dist.init_process_group(
        spec.backend, init_method=init_method or "env://", rank=rank, world_size=world_size,
        timeout=_dt.timedelta(seconds=spec.pg_timeout_s), **kwargs,
    )


def _shard(x: Any, rank: int, rows: int) -> Any:
    if isinstance(x, torch.Tensor):
        return x.narrow(0, rank * rows, rows).clone() if x.dim() else x
    if isinstance(x, dict):
        return type(x)((k, _shard(v, rank, rows)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return type(x)(_shard(v, rank, rows) for v in x)
    return x


def _to(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return type(x)((k, _to(v, device)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device) for v in x)
    return x


def run_rank(spec: RankSpec, rank: int, world_size: int,
             local_rank: int | None = None) -> RankResult:
    """One rank's DDP training: build, wrap, warm up, measure (see the module docstring)."""
    import copy
    import warnings

    from torch.nn.parallel import DistributedDataParallel

    from dpprof.scenarios.base import train_step
    from dpprof.scenarios.workloads import load_workload

    wl = load_workload(spec.workload)
    if spec.dtype is not None:
        import dataclasses

        wl = dataclasses.replace(wl, dtype=getattr(torch, spec.dtype))
    device = torch.device("cpu") if spec.device == "cpu" else torch.device(
        "cuda", rank if local_rank is None else local_rank)
    result = RankResult(rank=rank, world_size=world_size, hostname=socket.gethostname())
    prof = None
    if spec.memory == "profiler":
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        prof.__enter__()
    try:
        torch.manual_seed(spec.seed)
        # As the emulator: the model built on the host, then moved to the rank's device.
        model = wl.model().to(device)
        if wl.dtype != torch.float32:
            model.to(wl.dtype)
        loss_fn = wl.loss
        if isinstance(loss_fn, torch.nn.Module):
            loss_fn = copy.deepcopy(loss_fn).to(device)
            if wl.dtype != torch.float32:
                loss_fn.to(wl.dtype)
        kwargs: dict[str, Any] = {}
        if spec.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = spec.bucket_cap_mb
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # broadcast_buffers is deprecated
            ddp = model if spec.wrap == "none" else DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None,
                gradient_as_bucket_view=spec.gradient_as_bucket_view,
                find_unused_parameters=spec.find_unused_parameters,
                broadcast_buffers=spec.broadcast_buffers, **kwargs,
            )
        params = list(model.parameters())
        if isinstance(loss_fn, torch.nn.Module):
            params += list(loss_fn.parameters())
        opt = wl.optimizer(params)
        for group in opt.param_groups:
            if group.get("foreach") is None and not group.get("fused"):
                group["foreach"] = True  # as on CUDA, and as the emulator
        model.train()
        for step in range(spec.warmup_steps + 1):
            # Every rank makes the same global batch and takes its shard (equal shards).
            gen_state = torch.random.get_rng_state()
            torch.manual_seed(spec.seed + 1000 + step)
            inputs, targets = wl.batch(spec.rows * world_size, torch.device("cpu"))
            torch.random.set_rng_state(gen_state)
            inputs = _to(_shard(inputs, rank, spec.rows), device)
            targets = _to(_shard(targets, rank, spec.rows), device)
            if wl.dtype != torch.float32:
                inputs = _cast(inputs, wl.dtype)
            if step == spec.warmup_steps:
                if spec.memory == "cuda":
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                t0 = time.perf_counter()
                with torch.profiler.record_function(STEP_MARK):
                    loss = train_step(ddp, loss_fn, opt, inputs, targets, False)
                if spec.device == "cuda":
                    torch.cuda.synchronize(device)
                result.step_time_s = time.perf_counter() - t0
            else:
                loss = train_step(ddp, loss_fn, opt, inputs, targets, False)
            del inputs, targets
            result.loss = float(loss)
            del loss  # as the emulator: the step's loss dies before the next step
        if spec.memory == "cuda":
            result.peak_allocated_bytes = int(torch.cuda.max_memory_allocated(device))
            result.peak_reserved_bytes = int(torch.cuda.max_memory_reserved(device))
        if spec.return_parameters:
            result.parameters = {n: p.detach().cpu().tolist()
                                 for n, p in model.named_parameters()}
    finally:
        if prof is not None:
            prof.__exit__(None, None, None)
    if prof is not None and result.step_time_s is not None:
        span = step_span(prof, STEP_MARK)
        if span is not None:
            _profiler_figures(result, allocations(prof), *span)
    return result


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, dict):
        return type(x)((k, _cast(v, dtype)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(v, dtype) for v in x)
    return x


def _profiler_figures(result: RankResult, events: list[Alloc], t0: int, t1: int) -> None:
    before = [e for e in events if e.t_ns < t0]
    step = [e for e in events if t0 <= e.t_ns <= t1]
    start = sum(e.size for e in before)
    result.start_requested_bytes = start
    result.step_peak_requested_bytes = peak_of(step)
    result.peak_requested_bytes = start + result.step_peak_requested_bytes
    result.peak_allocated_bytes = peak_of(before + step, rounded=True) if step else None
    result.step_events = [(e.size, e.op, e.ptr) for e in step]


# ---- dpprof starts the ranks -------------------------------------------------------------


def _worker(specs: list[RankSpec], rank: int, world_size: int, port: int,
            results: Any) -> None:
    try:
        init_process_group(specs[0], rank, world_size, f"tcp://127.0.0.1:{port}")
        try:
            res = [run_rank(spec, rank, world_size, local_rank=rank) for spec in specs]
        finally:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        results.put((rank, "ok", res))
    except BaseException:  # every failure goes back with its traceback
        results.put((rank, "error", traceback.format_exc()))


def launch(spec: RankSpec, world_size: int) -> list[RankResult]:
    """Start ``world_size`` processes, run :func:`run_rank` in each, return by rank."""
    return [r[0] for r in launch_many([spec], world_size)]


def launch_many(specs: list[RankSpec], world_size: int) -> list[list[RankResult]]:
    """As :func:`launch` for several specs run one after another in the same processes and
    process group (start-up paid once); results by rank, then by spec. The first spec's
    backend, device and timeouts apply to the group."""
    import multiprocessing as mp

    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    if not specs:
        return [[] for _ in range(world_size)]
    spec = specs[0]
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(specs, r, world_size, port, results),
                         name=f"dpprof-rank{r}", daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    done: dict[int, list[RankResult]] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + spec.join_timeout_s
    try:
        while len(done) + len(failures) < world_size:
            now = time.monotonic()
            if now > deadline:
                for r in range(world_size):
                    if r not in done and r not in failures:
                        failures[r] = (f"no result within the join timeout of "
                                       f"{spec.join_timeout_s:.0f} s: terminated")
                break
            try:
                rank, status, payload = results.get(timeout=0.2)
            except _queue.Empty:
                for r, p in enumerate(procs):
                    if r in done or r in failures or p.is_alive():
                        continue
                    # A process that died without a word (killed, segfault, os._exit).
                    try:
                        rank, status, payload = results.get(timeout=1.0)
                    except _queue.Empty:
                        failures[r] = f"process exited with code {p.exitcode} and no result"
                        break
                    else:
                        _file(rank, status, payload, done, failures)
                        break
                if failures:
                    deadline = min(deadline, time.monotonic() + spec.grace_s)
                continue
            _file(rank, status, payload, done, failures)
            if failures:
                deadline = min(deadline, time.monotonic() + spec.grace_s)
    finally:
        for p in procs:
            p.join(timeout=0.5 if failures else 5.0)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    if failures:
        raise DistributedRunError(failures)
    return [done[r] for r in range(world_size)]


def _file(rank: int, status: str, payload: Any, done: dict[int, list[RankResult]],
          failures: dict[int, str]) -> None:
    if status == "ok":
        done[rank] = payload
    else:
        failures[rank] = payload


# ---- torchrun starts the ranks -----------------------------------------------------------


def torchrun_main(spec: RankSpec) -> list[RankResult] | None:
    """Under torchrun: run this rank, gather every result on rank 0 (others get None)."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    init_process_group(spec, rank, world_size)
    try:
        res = run_rank(spec, rank, world_size, local_rank=local_rank)
        gathered: list[Any] | None = [None] * world_size if rank == 0 else None
        dist.gather_object(res, gathered, dst=0)
        return [g for g in gathered if g is not None] if gathered is not None else None
    finally:
        dist.destroy_process_group()


__all__ = [
    "DistributedRunError",
    "RankResult",
    "RankSpec",
    "free_port",
    "init_process_group",
    "launch",
    "launch_many",
    "run_rank",
    "torchrun_main",
]
