"""DDP processes for the ``ddp`` scenario: one per device, spawned by dpprof or by torchrun.

The interface (shared by the NCCL/cuda path and the gloo/CPU path; only ``backend`` and
``device`` differ):

- :class:`DdpJob`: what every rank needs (workload spec, :class:`CudaRunConfig`, ``backend``
  ``"nccl"`` | ``"gloo"``, ``device`` ``"cuda"`` | ``"cpu"``, collective timeout);
- :func:`rank_entry` ``(job, info, store=None)``: the body of one rank. It calls
  ``torch.cuda.set_device`` first (cuda), then ``init_process_group`` (``env://`` under
  torchrun, or the given store), measures its device (:func:`dpprof.cuda_backend.
  measure_ddp_rank`) and returns every rank's :class:`Measured` on rank 0 (None elsewhere):
  through ``gather_object`` when every rank succeeded, through the c10d store otherwise;
- :func:`spawn_ddp` ``(job, world)``: dpprof starts the ranks itself (``spawn``), with a
  ``TCPStore`` in the parent, and returns rank 0's list;
- :func:`torchrun_info`: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``GROUP_RANK`` from the
  environment torchrun sets, or None outside torchrun.

Failure handling (nothing hangs): a rank whose step raises (an OOM included) records its
traceback, marks the run failed in the store and leaves the process group (gloo: its
sockets close, so peers blocked in a collective fail at once; NCCL: it aborts its
communicator). Every rank runs a watcher thread that aborts its NCCL process group when the
store says another rank failed. The collective timeout bounds the rest; in spawn mode the
parent also notices a rank that died without a word (killed, segfault) and stops the others.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import inspect
import multiprocessing as mp
import os
import pickle
import socket
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dpprof.cuda_backend import CudaRunConfig, Measured, measure_ddp_rank
from dpprof.result import STATUS_ERROR, STATUS_OK

__all__ = ["DdpJob", "RankInfo", "rank_entry", "spawn_ddp", "torchrun_info"]

DEFAULT_TIMEOUT_S = 300.0
_POLL_S = 0.1


@dataclass
class DdpJob:
    """What every rank needs; picklable (it travels to spawned processes)."""

    workload: str  # a workload spec (built-in name, module:function, file.py:function)
    cfg: CudaRunConfig
    backend: str = "nccl"  # "nccl" | "gloo"
    device: str = "cuda"  # "cuda" | "cpu"
    timeout_s: float = DEFAULT_TIMEOUT_S  # collective timeout, and the bound on every wait
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def __post_init__(self) -> None:
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be nccl or gloo, not {self.backend!r}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be cuda or cpu, not {self.device!r}")


@dataclass(frozen=True)
class RankInfo:
    """Where one rank sits: global rank, world, rank on its node, node number, host."""

    rank: int
    world_size: int
    local_rank: int
    node_rank: int = 0
    hostname: str = field(default_factory=socket.gethostname)


def torchrun_info(environ: dict[str, str] | os._Environ[str] | None = None) -> RankInfo | None:
    """The rank torchrun started this process as, or None outside torchrun."""
    env = os.environ if environ is None else environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None
    try:
        return RankInfo(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env["LOCAL_RANK"]),
            node_rank=int(env.get("GROUP_RANK", env.get("NODE_RANK", "0"))),
        )
    except ValueError:
        return None


def local_device(job: DdpJob, info: RankInfo) -> int:
    """The CUDA index of this rank: ``--devices`` by local rank, else the local rank."""
    devices = job.cfg.devices
    if devices and info.local_rank < len(devices):
        return devices[info.local_rank]
    return info.local_rank


class _Watcher:
    """Aborts this rank's NCCL process group when another rank reports a failure."""

    def __init__(self, store: Any, key: str, backend: str) -> None:
        self.store, self.key, self.backend = store, key, backend
        self.done = threading.Event()
        self.fired = False
        self.thread = threading.Thread(target=self._run, name="dpprof-ddp-watch", daemon=True)

    def start(self) -> _Watcher:
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.done.wait(_POLL_S):
            try:
                failed = self.store.check([self.key])
            except Exception:
                return
            if failed and not self.done.is_set():
                self.fired = True
                if self.backend == "nccl":
                    _abort()
                return

    def stop(self) -> None:
        self.done.set()


def _abort() -> None:
    """Abort every process group (NCCL: ncclCommAbort unblocks pending collectives)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    with contextlib.suppress(Exception):
        if abort is not None:
            abort()
        else:  # pragma: no cover - older torch
            dist.destroy_process_group()


def _init(job: DdpJob, info: RankInfo, store: Any) -> Any:
    timeout = _dt.timedelta(seconds=job.timeout_s)
    kwargs: dict[str, Any] = {"backend": job.backend, "timeout": timeout}
    if store is not None:
        kwargs.update(store=store, rank=info.rank, world_size=info.world_size)
    else:
        kwargs.update(init_method="env://", rank=info.rank, world_size=info.world_size)
    params = inspect.signature(dist.init_process_group).parameters
    if job.device == "cuda" and "device_id" in params:
        # binds the NCCL communicator to this rank's GPU (torch >= 2.3): no stray context
        kwargs["device_id"] = torch.device("cuda", local_device(job, info))
    dist.init_process_group(**kwargs)
    return store if store is not None else dist.distributed_c10d._get_default_store()


def rank_entry(job: DdpJob, info: RankInfo, store: Any = None) -> list[Measured] | None:
    """The body of one DDP rank; on rank 0, every rank's :class:`Measured` in rank order."""
    from dpprof.scenarios.workloads import load_workload

    dev = local_device(job, info)
    if job.device == "cuda":
        torch.cuda.set_device(dev)  # first, before anything touches CUDA
    prefix = f"dpprof/{job.run_id}"
    store = _init(job, info, store)
    watcher = _Watcher(store, f"{prefix}/failed", job.backend).start()
    try:
        wl = load_workload(job.workload)
        measured = measure_ddp_rank(
            wl, job.cfg, info.rank, info.world_size, dev, job.device
        )
    except Exception as exc:  # loading the workload, or a bug: still a result
        measured = Measured(
            status=STATUS_ERROR, message=f"{type(exc).__name__}: {exc}", rank=info.rank,
            traceback=traceback.format_exc(),
        )
    watcher.stop()
    for d in measured.devices:
        d.node = info.hostname
        d.node_rank = info.node_rank
        d.local_rank = info.local_rank
    if measured.status != STATUS_OK:
        if int(store.add(f"{prefix}/nfailed", 1)) == 1:
            measured.notes.insert(0, f"rank {info.rank} failed first")
            measured.first_failure = True
        store.set(f"{prefix}/failed", str(info.rank))
    store.set(f"{prefix}/status/{info.rank}", measured.status)
    all_ok = _all_ok(store, prefix, info.world_size, job.timeout_s)
    if all_ok:
        gathered: list[Any] | None = [None] * info.world_size if info.rank == 0 else None
        dist.gather_object(measured, gathered, dst=0)
        dist.destroy_process_group()
        return [g for g in gathered if g is not None] if gathered is not None else None
    # a failure: no more collectives; every rank leaves its outcome in the store
    store.set(f"{prefix}/outcome/{info.rank}", pickle.dumps(measured))
    if job.backend == "nccl":
        _abort()
    else:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    if info.rank != 0:
        return None
    return _collect(store, prefix, info.world_size, job.timeout_s)


def _all_ok(store: Any, prefix: str, world: int, timeout_s: float) -> bool:
    """Wait (bounded) until every rank reported; True when all succeeded."""
    keys = [f"{prefix}/status/{r}" for r in range(world)]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if store.check([f"{prefix}/failed"]):
            return False
        if store.check(keys):
            return all(store.get(k).decode() == STATUS_OK for k in keys)
        time.sleep(_POLL_S)
    return False


def _collect(store: Any, prefix: str, world: int, timeout_s: float) -> list[Measured]:
    out: list[Measured] = []
    deadline = time.monotonic() + timeout_s
    for r in range(world):
        key = f"{prefix}/outcome/{r}"
        while not store.check([key]) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        if store.check([key]):
            out.append(pickle.loads(store.get(key)))
        else:
            out.append(
                Measured(status=STATUS_ERROR, rank=r, message=f"rank {r} did not report")
            )
    return out


# --------------------------------------------------------------------------- spawn mode


def _spawned_rank(job: DdpJob, rank: int, world: int, port: int, queue: Any) -> None:
    """A process started by :func:`spawn_ddp`."""
    # what torchrun would set: workloads may read them
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0")
    try:
        store = dist.TCPStore("127.0.0.1", port, world + 1, False, timeout=_dt.timedelta(
            seconds=job.timeout_s))
        result = rank_entry(job, RankInfo(rank, world, rank), store)
        if rank == 0:
            queue.put(("ok", pickle.dumps(result)))
    except BaseException as exc:
        if rank == 0:
            queue.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise


def spawn_ddp(job: DdpJob, world: int) -> list[Measured]:
    """Start ``world`` ranks, wait for them (bounded), return every rank's outcome."""
    from queue import Empty

    store = dist.TCPStore(
        "127.0.0.1", 0, world + 1, True, timeout=_dt.timedelta(seconds=job.timeout_s),
        wait_for_workers=False,
    )
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_spawned_rank, args=(job, r, world, store.port, queue),
                    name=f"dpprof-ddp-rank{r}", daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    prefix = f"dpprof/{job.run_id}"
    deadline = time.monotonic() + 3 * job.timeout_s + 60
    result: list[Measured] | None = None
    error: str | None = None
    reported_dead: set[int] = set()
    try:
        while time.monotonic() < deadline:
            try:
                kind, payload = queue.get(timeout=_POLL_S * 2)
            except Empty:
                pass
            else:
                if kind == "ok":
                    result = pickle.loads(payload)
                else:
                    error = str(payload)
                break
            for r, p in enumerate(procs):
                if p.exitcode not in (None, 0) and r not in reported_dead:
                    reported_dead.add(r)
                    _report_dead(store, prefix, r, p.exitcode)
            if procs[0].exitcode is not None and queue.empty():
                time.sleep(0.5)  # rank 0's last message may still be in the pipe
                if queue.empty():
                    error = f"rank 0 exited with code {procs[0].exitcode} without a result"
                    break
        else:
            error = f"the DDP ranks did not finish within {deadline:.0f} s"
    finally:
        for p in procs:
            p.join(timeout=10 if result is not None else 2)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():  # pragma: no cover - a rank that ignores SIGTERM
                p.kill()
                p.join(5)
    if result is not None:
        return result
    outcomes = []
    for r in range(world):
        key = f"{prefix}/outcome/{r}"
        if store.check([key]):
            outcomes.append(pickle.loads(store.get(key)))
        else:
            outcomes.append(Measured(status=STATUS_ERROR, rank=r, message=error or "no result"))
    return outcomes


def _report_dead(store: Any, prefix: str, rank: int, code: int | None) -> None:
    """Speak for a rank that died silently, so the others stop waiting for it."""
    if store.check([f"{prefix}/outcome/{rank}"]):
        return
    how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    dead = Measured(status=STATUS_ERROR, rank=rank, message=f"rank {rank} died ({how})")
    store.set(f"{prefix}/outcome/{rank}", pickle.dumps(dead))
    store.set(f"{prefix}/status/{rank}", STATUS_ERROR)
    store.add(f"{prefix}/nfailed", 1)
    store.set(f"{prefix}/failed", str(rank))
