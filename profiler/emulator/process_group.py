"""A process group for one emulated rank whose collectives complete at once and whose works
carry their tensors, as NCCL's and gloo's do; torch's own ``DistributedDataParallel`` (its C++
reducer, its communication hooks) runs over it.

torch's fake process group (``torch.testing._internal.distributed.fake_pg``, the default
group of an emulated script: FSDP2 and DTensor run over it) completes every collective at
once too, but its works' futures hold ``None`` (``FakeWork::getFuture`` in
``c10d/FakeProcessGroup.hpp``), and DDP's reducer reads the all-reduced bucket from the future
its communication hook returns (``c10d/comm.cpp``: "expected the hook result is either a
Tensor or a TensorList"). :class:`EmulatedRankGroup` is a Python ``ProcessGroup`` (torch's
own trampoline calls it from C++) whose every work is a completed future of the collective's
output tensors.

What each collective does to the tensors is what one rank of ranks that all run the same
program sees: an all-reduce sums ``size`` equal contributions in place (``SUM``: the tensor
times ``size``; ``AVG``, ``MIN``, ``MAX``: unchanged), an all-gather fills every slot with
the rank's own input, a broadcast leaves the tensor as it is. None of them allocates: NCCL and
gloo write into the tensors given, in memory the caching allocator does not see. A collective
not written here stops the run with one line naming dpprof (:class:`NotEmulated`), never an
error that reads as the script's.

A group of backend ``nccl`` keeps what ``ProcessGroupNCCL`` keeps: its ``collective()``
stashes an asynchronous collective's input and output tensors in the work
(``stashed_for_allocator_safety_``, instead of ``recordStream``) until ``wait()`` on the
work, or until the watchdog thread drops the completed work (it wakes every
``kWatchdogThreadSleepMillis``, 100 ms). DDP's reducer never waits on the work (it waits on
its future), so the tensors of its all-reduces outlive the reducer's own references for a
while: the first iteration's buckets stay allocated past the rebuild that replaces them.
Each all-reduce's tensors are kept in :attr:`EmulatedRankGroup.unreaped` until the caller
reaps them (:meth:`EmulatedRankGroup.reap`: the watchdog's round; the emulation has no
clock, so the caller decides when). Gloo's work holds nothing once done, and the fake
group's neither: their tensors are freed at once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from dpprof.emulator import same_program
from dpprof.errors import NotEmulated

__all__ = ["EmulatedRankGroup", "completed_work", "rank_group", "reap_all"]


def completed_work(value: Any) -> Any:
    """A work already complete, its future holding ``value`` (``c10d::Work`` from a future,
    as torch's Python process groups make theirs)."""
    from torch._C._distributed_c10d import (  # type: ignore[attr-defined]
        _create_work_from_future,
    )

    fut: Future[Any] = Future()
    fut.set_result(value)
    return _create_work_from_future(fut)


class EmulatedRankGroup(dist.ProcessGroup):
    """One rank (``rank`` of ``size``) of a group whose ranks all run the same program (see
    the module). ``backend``: the name the script asked for (``nccl``), which torch's logging
    data reports."""

    def __init__(self, rank: int, size: int, backend: str = "nccl") -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._rank = rank
        self._size = size
        self._backend = backend
        # the tensors of the all-reduces whose works the watchdog has not dropped yet
        # (backend nccl only; see the module)
        self.unreaped: list[torch.Tensor] = []

    # ---- what torch asks of a group ----------------------------------------------------

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return self._backend

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return f"dpprof-emulated-{self._rank}-of-{self._size}"

    def __repr__(self) -> str:
        return f"EmulatedRankGroup(rank={self._rank}, size={self._size}, {self._backend})"

    # ---- collectives -------------------------------------------------------------------

    def _reduce(self, tensors: list[torch.Tensor], op: Any) -> None:
        kind = int(getattr(op, "op", op))  # a ReduceOp, or its RedOpType
        with torch.no_grad():
            for t in tensors:
                same_program.reduce_(t, kind, self._size)

    def allreduce(  # type: ignore[override]
            self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        self._reduce(tensors, opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        if self._backend == "nccl":  # in place: the input and output tensors are the same
            self.unreaped.extend(tensors)
        return completed_work(tensors)

    def reap(self) -> list[torch.Tensor]:
        """The watchdog drops the completed works: the tensors they held, handed to the
        caller (what it keeps of them lives on; the rest is freed once it lets go)."""
        reaped, self.unreaped = self.unreaped, []
        return reaped

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def broadcast(  # type: ignore[override]
            self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return completed_work(tensors)

    def allgather(  # type: ignore[override]
            self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
            opts: Any = None) -> Any:
        with torch.no_grad():
            for slots, given in zip(outputs, inputs, strict=True):
                for slot in slots:
                    slot.copy_(given)
        return completed_work(outputs)

    def _allgather_base(self, output: torch.Tensor, given: torch.Tensor,
                        opts: Any = None) -> Any:
        with torch.no_grad():
            for chunk in output.chunk(self._size):
                chunk.copy_(given)
        return completed_work([output])

    def barrier(self, opts: Any = None) -> Any:
        return completed_work([])


def _not_written(name: str) -> Any:
    def missing(self: EmulatedRankGroup, *args: Any, **kwargs: Any) -> Any:
        raise NotEmulated(
            f"dpprof: the emulated process group of torch's DistributedDataParallel has no "
            f"{name}() (DDP's reducer and its communication hooks use all-reduce, broadcast "
            "and all-gather, which it has)")
    missing.__name__ = name
    return missing


# the collectives not written here: one line naming dpprof where the script or a library
# first reaches for one (the base class's would look for a C++ backend this group has not)
for _name in ("reduce", "reduce_scatter", "_reduce_scatter_base",
              "reduce_scatter_tensor_coalesced", "allgather_coalesced",
              "allgather_into_tensor_coalesced", "alltoall", "alltoall_base", "gather",
              "scatter", "send", "recv", "recv_anysource", "monitored_barrier"):
    setattr(EmulatedRankGroup, _name, _not_written(_name))


_GROUPS: dict[tuple[int, int, str], EmulatedRankGroup] = {}


def reap_all() -> None:
    """Every group's works dropped (a run's end: what a run's works held dies with it)."""
    for group in _GROUPS.values():
        group.reap()


def rank_group(like: Any, backend: str = "nccl") -> EmulatedRankGroup:
    """The emulated group of the rank and size of the process group ``like`` (one per
    rank, size and backend: a reducer's group lives as long as its DDP)."""
    key = (int(like.rank()), int(like.size()), backend)
    group = _GROUPS.get(key)
    if group is None:
        group = _GROUPS[key] = EmulatedRankGroup(*key)
    return group
