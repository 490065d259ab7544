"""The one multi-process layer for ``DistributedDataParallel`` ranks (gloo on CPU, NCCL on GPUs).

Both backends' ``ddp`` scenario runs through here; only the per-rank body differs (the
``cpu`` backend's profiler-measured :class:`dpprof.backends.gloo.CpuRanks`, the ``cuda``
backend's CUDA/NVML-measured :class:`dpprof.backends.cuda_ddp.DdpJob`). Interface:

- :class:`Group`: how the ranks talk: ``backend`` (``"gloo"`` | ``"nccl"``), ``device``
  (``"cpu"`` | ``"cuda"``), ``devices`` (the CUDA index of each local rank; default the
  local rank), ``timeout_s`` (the collective timeout and the bound on every wait),
  ``grace_s`` (after a failure, how long rank 0 waits for the others' outcomes; default
  ``timeout_s``), ``join_timeout_s`` (spawn mode: the whole run; default
  ``3 * timeout_s + 60``), ``run_id`` (the store keys' prefix: the same on every rank);
- :class:`RankBody`: a picklable callable ``body(info, device_index) -> value`` run in a
  process whose default process group is initialised; ``body.succeeded(value)`` says whether
  a returned value is a failure (an OOM is a value, not an exception);
- :func:`run_in_group` ``(group, body, info, store=None)``: one rank: ``set_device`` first
  (cuda), ``init_process_group`` (the given store, or ``env://`` under torchrun), the body,
  and on rank 0 every rank's :class:`RankOutcome` in rank order (None elsewhere): through
  ``gather_object`` when every rank succeeded, through the c10d store otherwise;
- :func:`dpprof.backends.ranks_spawn.spawn_ranks` ``(group, body, world)``: dpprof starts
  the ranks itself (``spawn``, a ``TCPStore`` on a free port of 127.0.0.1 in the parent)
  and returns rank 0's list;
- :func:`torchrun_info`, :func:`torchrun_run_id`: the rank torchrun started this process
  as; :func:`free_port`.

Both bodies wrap their model with :meth:`dpprof.scenarios.step.DdpOptions.wrap` and take
the step's options (batch, seed, warm-up, dtype, autocast) as one
:class:`dpprof.scenarios.step.StepConfig`.

Failure handling (nothing hangs): a rank whose body raises or returns a failure records its
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
import os
import pickle
import socket
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dpprof.scenarios.measured_loop import error_site

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "POLL_S",
    "Group",
    "RankBody",
    "RankInfo",
    "RankOutcome",
    "StoreWatcher",
    "blame",
    "free_port",
    "is_peer_error",
    "run_in_group",
    "torchrun_info",
    "torchrun_run_id",
]

DEFAULT_TIMEOUT_S = 300.0
POLL_S = 0.1  # seconds between two looks at the store or the ranks


@dataclass(frozen=True)
class RankInfo:
    """Where one rank sits: global rank, world, rank on its node, node number, host."""

    rank: int
    world_size: int
    local_rank: int
    node_rank: int = 0
    hostname: str = field(default_factory=socket.gethostname)


@dataclass
class Group:
    """How the ranks talk; picklable (it travels to spawned processes)."""

    backend: str = "nccl"  # "nccl" | "gloo"
    device: str = "cuda"  # "cuda" | "cpu"
    devices: tuple[int, ...] | None = None  # CUDA index per local rank (default: local rank)
    timeout_s: float = DEFAULT_TIMEOUT_S  # collective timeout, and the bound on every wait
    grace_s: float | None = None  # after a failure: the wait for the others (timeout_s)
    join_timeout_s: float | None = None  # spawn mode, the whole run (3 * timeout_s + 60)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def __post_init__(self) -> None:
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be nccl or gloo, not {self.backend!r}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be cuda or cpu, not {self.device!r}")

    def device_index(self, info: RankInfo) -> int:
        """The CUDA index of this rank: ``devices`` by local rank, else the local rank."""
        if self.devices and info.local_rank < len(self.devices):
            return self.devices[info.local_rank]
        return info.local_rank


@dataclass
class RankOutcome:
    """One rank's result: the body's value, or why there is none."""

    rank: int
    ok: bool
    value: Any = None  # what the body returned (also a failure it reported, e.g. an OOM)
    message: str = ""  # one line, when the body raised or the rank did not report
    traceback: str = ""  # when the body raised
    first_failure: bool = False  # this rank caused the failure (see :func:`blame`)
    reported_first: bool = False  # this rank's failure reached the store before any other


class RankBody(Protocol):
    """The per-rank work: picklable; the process group is initialised when it is called."""

    def __call__(self, info: RankInfo, device_index: int) -> Any: ...

    def succeeded(self, value: Any) -> bool: ...


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def torchrun_run_id() -> str:
    """A run id every rank of one torchrun job agrees on (its store keys' prefix)."""
    return "torchrun-" + os.environ.get("TORCHELASTIC_RUN_ID", "none")


class StoreWatcher:
    """Aborts this rank's NCCL process group when another rank reports a failure.

    Started before ``init_process_group`` (spawn mode, where the store exists first): a peer
    that dies while the others wait in the group's set-up (NCCL's ``ncclCommInitRank`` waits
    for every rank, gloo for every rank's address, up to the timeout) has no process group to
    abort yet, so until :meth:`joined` the watcher leaves this rank's outcome in the store
    and ends the process instead (``before_init``: this rank's number and the store prefix).
    """

    def __init__(self, store: Any, key: str, backend: str,
                 before_init: tuple[int, str] | None = None) -> None:
        self.store, self.key, self.backend = store, key, backend
        self.done = threading.Event()
        self.fired = False
        self.before_init = before_init
        self.in_init = before_init is not None
        self.thread = threading.Thread(target=self._run, name="dpprof-ddp-watch", daemon=True)

    def joined(self) -> None:
        """The process group is up: from now on a peer's failure aborts it."""
        self.in_init = False

    def start(self) -> StoreWatcher:
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.done.wait(POLL_S):
            try:
                failed = self.store.check([self.key])
            except Exception:
                return
            if failed and not self.done.is_set():
                self.fired = True
                if self.in_init and self.before_init is not None:
                    self._leave_init()
                if self.backend == "nccl":
                    _abort()
                return

    def _leave_init(self) -> None:
        rank, prefix = self.before_init or (0, "")
        with contextlib.suppress(Exception):
            peer = self.store.get(self.key).decode()
            outcome = RankOutcome(rank=rank, ok=False, message=(
                f"rank {rank} stopped waiting in init_process_group: rank {peer} failed"))
            self.store.set(f"{prefix}/outcome/{rank}", pickle.dumps(outcome))
            self.store.set(f"{prefix}/status/{rank}", "error")
        os._exit(1)  # blocked inside the group's C++ set-up: nothing else unblocks it

    def stop(self) -> None:
        """Stop and join the thread: a daemon thread still inside a c10d store call when the
        interpreter finalizes is ended by pthread_exit while in C++ frames, and the process
        dies of SIGABRT ("terminate called without an active exception")."""
        self.done.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=POLL_S * 50)


def _abort() -> None:
    """Abort every process group (NCCL: ncclCommAbort unblocks pending collectives)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    with contextlib.suppress(Exception):
        if abort is not None:
            abort()
        else:  # pragma: no cover - older torch
            dist.destroy_process_group()


def _init(group: Group, info: RankInfo, store: Any) -> Any:
    # ``torch.distributed.nn.functional`` binds ``group.WORLD`` as its functions' default
    # arguments when it is first imported. Imported while a group is up (the optimizer's
    # first step imports torch._dynamo, which imports it), it keeps the default group alive
    # after ``destroy_process_group``: gloo's worker threads then outlive the interpreter, and
    # one that drops its last work's Python-owned tensors during finalization cannot take the
    # GIL, is pthread_exit-ed inside a noexcept destructor, and the rank dies of SIGABRT
    # ("terminate called without an active exception") after its results were gathered.
    # Imported first (about 3 ms), the defaults are None and the group is freed on destroy.
    import torch.distributed.nn

    timeout = _dt.timedelta(seconds=group.timeout_s)
    kwargs: dict[str, Any] = {"backend": group.backend, "timeout": timeout}
    if store is not None:
        kwargs.update(store=store, rank=info.rank, world_size=info.world_size)
    else:
        kwargs.update(init_method="env://", rank=info.rank, world_size=info.world_size)
    params = inspect.signature(dist.init_process_group).parameters
    if group.device == "cuda" and "device_id" in params:
        # binds the NCCL communicator to this rank's GPU (torch >= 2.3): no stray context
        kwargs["device_id"] = torch.device("cuda", group.device_index(info))
    dist.init_process_group(**kwargs)
    return store if store is not None else dist.distributed_c10d._get_default_store()


def run_in_group(group: Group, body: RankBody, info: RankInfo,
                 store: Any = None, watch_store: Any = None) -> list[RankOutcome] | None:
    """One rank (see the module docstring); on rank 0, every rank's outcome in rank order.

    ``watch_store``: a second client of ``store`` for the watcher thread: a c10d store client
    serves one request at a time, and during set-up the main thread blocks in one (waiting
    for the peers' addresses), so a watcher on the same client would wait behind it.
    """
    prefix = f"dpprof/{group.run_id}"
    watcher: StoreWatcher | None = None
    if watch_store is not None:  # spawn mode: watch the peers while the group is set up
        watcher = StoreWatcher(watch_store, f"{prefix}/failed", group.backend,
                               before_init=(info.rank, prefix)).start()
    try:
        dev = group.device_index(info)
        if group.device == "cuda":
            torch.cuda.set_device(dev)  # first, before anything touches CUDA
        store = _init(group, info, store)
    except Exception as exc:
        if watcher is not None:
            watcher.stop()
            _failed_in_init(store, prefix, info.rank, exc)
        raise
    store.add(f"{prefix}/joined", 1)
    if watcher is None:
        watcher = StoreWatcher(store, f"{prefix}/failed", group.backend).start()
    watcher.joined()
    try:
        value = body(info, dev)
        outcome = RankOutcome(rank=info.rank, ok=bool(body.succeeded(value)), value=value)
    except Exception as exc:  # loading the workload, or a bug: still an outcome
        # the message names the user's own line, as the emulated scenarios do
        outcome = RankOutcome(rank=info.rank, ok=False,
                              message=f"{type(exc).__name__}: {exc}".strip() + error_site(exc),
                              traceback=traceback.format_exc())
    except SystemExit as exc:  # the workload called sys.exit(): a failure, not a success
        outcome = RankOutcome(
            rank=info.rank, ok=False,
            message=f"the workload called sys.exit({exc.code!r}) in rank {info.rank}",
            traceback=traceback.format_exc())
    finally:
        watcher.stop()
    status = "ok" if outcome.ok else "error"
    if not outcome.ok:
        if int(store.add(f"{prefix}/nfailed", 1)) == 1:
            outcome.reported_first = outcome.first_failure = True
        store.set(f"{prefix}/failed", str(info.rank))
    store.set(f"{prefix}/status/{info.rank}", status)
    if _all_ok(store, prefix, info.world_size, group.timeout_s):
        gathered: list[Any] | None = [None] * info.world_size if info.rank == 0 else None
        dist.gather_object(outcome, gathered, dst=0)
        dist.destroy_process_group()
        return [g for g in gathered if g is not None] if gathered is not None else None
    # a failure: no more collectives; every rank leaves its outcome in the store
    store.set(f"{prefix}/outcome/{info.rank}", pickle.dumps(outcome))
    grace = group.timeout_s if group.grace_s is None else group.grace_s
    # gloo's init returns on one rank while a peer may still be connecting its pairs: tearing
    # the group down now would kill that peer inside init ("Connection closed by peer")
    # before it reaches, and reports, its own error
    _wait_joined(store, prefix, info.world_size, grace)
    if group.backend == "nccl":
        _abort()
    else:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    if info.rank != 0:
        return None
    return _collect(store, prefix, info.world_size, grace)


def _failed_in_init(store: Any, prefix: str, rank: int, exc: BaseException) -> None:
    """Tell the peers at once that this rank's set-up failed (they wait in theirs)."""
    with contextlib.suppress(Exception):
        outcome = RankOutcome(
            rank=rank, ok=False, traceback=traceback.format_exc(),
            message=f"{type(exc).__name__}: {exc}".strip().splitlines()[0] + error_site(exc))
        if int(store.add(f"{prefix}/nfailed", 1)) == 1:
            outcome.reported_first = outcome.first_failure = True
        store.set(f"{prefix}/outcome/{rank}", pickle.dumps(outcome))
        store.set(f"{prefix}/status/{rank}", "error")
        store.set(f"{prefix}/failed", str(rank))


def _wait_joined(store: Any, prefix: str, world: int, timeout_s: float) -> None:
    """Wait (bounded) until every rank has finished joining the process group."""
    deadline = time.monotonic() + timeout_s
    while int(store.add(f"{prefix}/joined", 0)) < world and time.monotonic() < deadline:
        time.sleep(POLL_S)


def _all_ok(store: Any, prefix: str, world: int, timeout_s: float) -> bool:
    """Wait (bounded) until every rank reported; True when all succeeded."""
    keys = [f"{prefix}/status/{r}" for r in range(world)]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if store.check([f"{prefix}/failed"]):
            return False
        if store.check(keys):
            return all(store.get(k).decode() == "ok" for k in keys)
        time.sleep(POLL_S)
    return False


def _collect(store: Any, prefix: str, world: int, timeout_s: float) -> list[RankOutcome]:
    out: list[RankOutcome] = []
    deadline = time.monotonic() + timeout_s
    for r in range(world):
        key = f"{prefix}/outcome/{r}"
        while not store.check([key]) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if store.check([key]):
            out.append(pickle.loads(store.get(key)))
        else:
            out.append(RankOutcome(rank=r, ok=False, message=(
                f"rank {r} did not report within {timeout_s:g} s of the first failure "
                "(hung, or died without a word)")))
    return blame(out)


# What a rank says when another rank failed under it: never the cause.
_PEER_ERRORS = (
    "connection closed by peer", "connection reset by peer", "broken pipe", "timed out",
    "timeout", "socket closed", "was aborted", "aborted", "connection refused",
    "read error", "write error", "unexpected end of stream", "did not finish within",
    "stopped waiting in init_process_group",
)


def is_peer_error(message: str) -> bool:
    """Whether ``message`` is what a collective says when *another* rank went away (gloo's
    "Connection closed by peer", a timeout, an NCCL abort): a symptom, not the cause."""
    low = message.lower()
    return any(p in low for p in _PEER_ERRORS)


def blame(outcomes: list[RankOutcome]) -> list[RankOutcome]:
    """Mark the one rank that caused a failed run (``first_failure``) and return the list.

    In order: a rank that failed with its own error (not a peer error), the earliest to
    report first; else a rank that died, exited or never reported (it hung: the others' only
    timed out waiting for it); else the first to fail."""
    failed = [o for o in outcomes if not o.ok]
    for o in outcomes:
        o.first_failure = False
    if not failed:
        return outcomes
    own = [o for o in failed if o.value is not None or (
        o.traceback and not is_peer_error(o.message) and not is_peer_error(
            o.traceback.strip().splitlines()[-1] if o.traceback.strip() else ""))]
    silent = [o for o in failed
              if not o.traceback and o.value is None and not is_peer_error(o.message)]
    first = [o for o in failed if o.reported_first]
    pick = (next((o for o in own if o.reported_first), None) or (own[0] if own else None)
            or (silent[0] if silent else None) or (first[0] if first else failed[0]))
    pick.first_failure = True
    return outcomes
