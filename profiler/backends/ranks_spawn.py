"""Spawn mode of the DDP process layer (:mod:`dpprof.backends.ranks`): dpprof starts the
ranks itself (:func:`spawn_ranks`: ``spawn``, a ``TCPStore`` on a free port of 127.0.0.1
in the parent), waits for rank 0's list of every rank's outcome (bounded), notices a rank
that died without a word (killed, segfault) and speaks for it in the store, and ends every
rank still running; a rank never outlives dpprof, and only dpprof answers Ctrl-C."""

from __future__ import annotations

import contextlib
import datetime as _dt
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
import traceback
from typing import Any

import torch.distributed as dist

from dpprof.backends.ranks import (
    POLL_S,
    Group,
    RankBody,
    RankInfo,
    RankOutcome,
    blame,
    run_in_group,
)
from dpprof.scenarios.measured_loop import error_site

__all__ = ["spawn_ranks"]


def _spawned_rank(group: Group, body: RankBody, rank: int, world: int, port: int,
                  queue: Any) -> None:
    """A process started by :func:`spawn_ranks`."""
    _exit_with_parent()
    # what torchrun would set: workloads may read them
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0")
    try:
        timeout = _dt.timedelta(seconds=group.timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world + 1, False, timeout=timeout)
        watch_store = dist.TCPStore("127.0.0.1", port, world + 1, False, timeout=timeout)
        result = run_in_group(group, body, RankInfo(rank, world, rank), store, watch_store)
        if rank == 0:
            queue.put(("ok", pickle.dumps(result)))
    except BaseException as exc:
        if rank == 0:
            queue.put(("error", f"{type(exc).__name__}: {exc}{error_site(exc)}\n"
                                f"{traceback.format_exc()}"))
        raise


def _exit_with_parent() -> None:
    """End this rank when the process that spawned it is gone (killed with SIGKILL, say):
    a rank never outlives dpprof. SIGTERM (what dpprof sends) ends it at once, silently."""
    parent = os.getppid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="dpprof-parent-watch", daemon=True).start()


@contextlib.contextmanager
def _children_ignore_sigint() -> Any:
    """Start processes with SIGINT ignored (they inherit it): Ctrl-C reaches the whole
    process group, and only dpprof should answer it (one line, then it ends the ranks)."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: nothing to change
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def spawn_ranks(group: Group, body: RankBody, world: int) -> list[RankOutcome]:
    """Start ``world`` ranks, wait for them (bounded), return every rank's outcome."""
    if world < 1:
        raise ValueError("world must be at least 1")
    store = dist.TCPStore(
        "127.0.0.1", 0, world + 1, True, timeout=_dt.timedelta(seconds=group.timeout_s),
        wait_for_workers=False,
    )
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_spawned_rank, args=(group, body, r, world, store.port, queue),
                    name=f"dpprof-ddp-rank{r}", daemon=True)
        for r in range(world)
    ]
    with _children_ignore_sigint():
        for p in procs:
            p.start()
    prefix = f"dpprof/{group.run_id}"
    limit = group.join_timeout_s
    if limit is None:
        limit = 3 * group.timeout_s + 60
    deadline = time.monotonic() + limit
    result: list[RankOutcome] | None = None
    error: str | None = None
    reported_dead: set[int] = set()
    rank0_failure: str | None = None
    interrupted = False
    try:
        result, error, rank0_failure = _wait_for_rank0(
            procs, queue, store, prefix, deadline, limit, reported_dead)
    except BaseException:  # Ctrl-C, SIGTERM: end the ranks now, then unwind
        interrupted = True
        raise
    finally:
        _end_ranks(procs, queue, store, prefix, result is not None, rank0_failure,
                   reported_dead, interrupted)
    if result is not None:
        return blame(result)
    return blame(_outcomes_in_store(store, prefix, world, error, rank0_failure))


def _wait_for_rank0(
    procs: list[Any], queue: Any, store: Any, prefix: str, deadline: float, limit: float,
    reported_dead: set[int],
) -> tuple[list[RankOutcome] | None, str | None, str | None]:
    """Wait until rank 0 sends every rank's outcome, fails outside its body, exits without
    a result, or ``deadline`` passes; a rank that dies before it reports meanwhile is
    reported dead in the store (and added to ``reported_dead``). Returns the outcomes (or
    None), the error, and rank 0's failure (its traceback) where it failed."""
    from queue import Empty

    while time.monotonic() < deadline:
        try:
            kind, payload = queue.get(timeout=POLL_S * 2)
        except Empty:
            pass
        else:
            if kind == "ok":
                return pickle.loads(payload), None, None
            # rank 0 raised outside its body (setting up the group, say)
            return None, str(payload), str(payload)
        for r, p in enumerate(procs):
            if (p.exitcode is not None and r not in reported_dead
                    and not store.check([f"{prefix}/status/{r}"])):
                reported_dead.add(r)  # died, or exited, before it reported
                _report_dead(store, prefix, r, p.exitcode)
        if procs[0].exitcode is not None and queue.empty():
            time.sleep(0.5)  # rank 0's last message may still be in the pipe
            if queue.empty():
                return None, f"rank 0 exited with code {procs[0].exitcode} without a result", None
    return None, f"the DDP ranks did not finish within {limit:.0f} s", None


def _end_ranks(
    procs: list[Any], queue: Any, store: Any, prefix: str, have_result: bool,
    rank0_failure: str | None, reported_dead: set[int], interrupted: bool,
) -> None:
    """Join the ranks (briefly), report those that died unreported, then end every rank
    still running at once and close the queue."""
    if not interrupted:  # one wait for all of them: a rank stuck in its teardown costs it once
        deadline = time.monotonic() + (10 if have_result else 2)
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.0))
    if not have_result and not interrupted:  # a rank that died is the news, before we
        for r, p in enumerate(procs):        # end the ones still running
            if (p.exitcode is not None and r not in reported_dead
                    and not store.check([f"{prefix}/status/{r}"])
                    and not (r == 0 and rank0_failure)):
                reported_dead.add(r)
                _report_dead(store, prefix, r, p.exitcode)
    # every rank ended at once: one left running while another is joined would see
    # its peer gone, and gloo would print its connect errors on the user's terminal
    running = [p for p in procs if p.is_alive()]
    for p in running:
        p.terminate()
    for p in running:
        p.join(5)
        if p.is_alive():  # pragma: no cover - a rank that ignores SIGTERM
            p.kill()
            p.join(5)
    queue.close()


def _outcomes_in_store(store: Any, prefix: str, world: int, error: str | None,
                       rank0_failure: str | None) -> list[RankOutcome]:
    """Every rank's outcome when rank 0 sent none: what each rank left in the store, else
    why it has none."""
    outcomes = []
    why = (error or "no result").strip().splitlines()[0]
    for r in range(world):
        key = f"{prefix}/outcome/{r}"
        if store.check([key]):
            outcomes.append(pickle.loads(store.get(key)))
        elif r == 0 and rank0_failure:
            outcomes.append(RankOutcome(rank=0, ok=False, message=why, traceback=rank0_failure))
        elif rank0_failure:
            outcomes.append(RankOutcome(rank=r, ok=False, message=(
                f"rank {r} did not report (rank 0 failed: {why[:200]})")))
        else:
            outcomes.append(RankOutcome(rank=r, ok=False, message=why))
    return outcomes


def _report_dead(store: Any, prefix: str, rank: int, code: int | None) -> None:
    """Speak for a rank that died silently, so the others stop waiting for it."""
    if store.check([f"{prefix}/outcome/{rank}"]):
        return
    if code is not None and code < 0:
        try:
            how = f"died of {signal.Signals(-code).name}"
        except ValueError:
            how = f"died of signal {-code}"
    else:
        how = f"exited with code {code} before it reported"
    dead = RankOutcome(rank=rank, ok=False, message=f"rank {rank} {how}")
    store.set(f"{prefix}/outcome/{rank}", pickle.dumps(dead))
    store.set(f"{prefix}/status/{rank}", "error")
    store.add(f"{prefix}/nfailed", 1)
    store.set(f"{prefix}/failed", str(rank))
