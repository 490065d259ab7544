"""The shared DDP process layer (:mod:`dpprof.backends.ranks`) over gloo: results gathered on rank 0,
a rank that raises while its peer waits in a collective takes the group down with its
traceback, a rank that dies without a word is reported, and nothing hangs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dpprof.backends.ranks import Group, RankInfo, torchrun_info
from dpprof.backends.ranks_spawn import spawn_ranks


@dataclass
class SumBody:
    """all_reduce of (rank + 1); ``fail_rank`` raises before the collective, ``die_rank``
    exits without a word; the others block in the all_reduce until the group is gone."""

    fail_rank: int | None = None
    die_rank: int | None = None

    def __call__(self, info: RankInfo, device_index: int) -> Any:
        if info.rank == self.die_rank:
            os._exit(3)
        if info.rank == self.fail_rank:
            raise ValueError(f"boom on rank {info.rank}")
        t = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(t)
        return {"rank": info.rank, "sum": float(t.item()), "device": device_index}

    def succeeded(self, value: Any) -> bool:
        return True


def _group() -> Group:
    return Group(backend="gloo", device="cpu", timeout_s=30, grace_s=5, join_timeout_s=120)


def test_every_rank_outcome_is_gathered_on_rank_0() -> None:
    outcomes = spawn_ranks(_group(), SumBody(), 2)
    assert [o.rank for o in outcomes] == [0, 1]
    assert all(o.ok for o in outcomes)
    assert [o.value for o in outcomes] == [
        {"rank": 0, "sum": 3.0, "device": 0}, {"rank": 1, "sum": 3.0, "device": 1}]


def test_a_raising_rank_takes_the_waiting_peer_down_with_its_traceback() -> None:
    outcomes = spawn_ranks(_group(), SumBody(fail_rank=1), 2)
    failed = outcomes[1]
    assert not failed.ok and failed.first_failure
    # the message names the raising line (the user's own, here this file's body)
    assert failed.message.startswith("ValueError: boom on rank 1 (at ")
    assert f"{Path(__file__).name}:" in failed.message and "in __call__" in failed.message
    assert "Traceback" in failed.traceback and "boom on rank 1" in failed.traceback
    # rank 0 was blocked in all_reduce: it failed at once because the peer left the group
    # (not at the 30 s collective timeout), and said so
    assert not outcomes[0].ok and not outcomes[0].first_failure
    # gloo's pair.cc says "Connection closed by peer" when the peer's socket reads EOF,
    # and strerror(errno) ("Connection reset by peer") when it was reset: which one
    # depends on how the raising process's socket went down
    assert ("Connection closed by peer" in outcomes[0].message
            or "Connection reset by peer" in outcomes[0].message), outcomes[0].message


def test_a_rank_that_dies_silently_is_reported() -> None:
    outcomes = spawn_ranks(_group(), SumBody(die_rank=1), 2)
    assert not outcomes[1].ok
    assert outcomes[1].message == "rank 1 exited with code 3 before it reported"
    assert not outcomes[0].ok
    assert outcomes[1].first_failure and not outcomes[0].first_failure  # the cause, not rank 0


def test_group_checks_backend_and_device_and_maps_devices() -> None:
    with pytest.raises(ValueError, match="backend"):
        Group(backend="mpi")
    with pytest.raises(ValueError, match="device"):
        Group(device="xpu")
    info = RankInfo(rank=3, world_size=4, local_rank=1)
    assert Group(devices=(2, 5)).device_index(info) == 5
    assert Group().device_index(info) == 1
    assert torchrun_info({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}) is None


@dataclass
class DiesBeforeJoining(Group):
    """Rank 1 dies (``die=True``) or raises while the group is being set up, the way a rank
    dies in NCCL's communicator init: its peer is then waiting inside init_process_group."""

    die: bool = True

    def device_index(self, info: RankInfo) -> int:
        if info.rank == 1 and self.die:
            os._exit(3)
        if info.rank == 1:
            raise RuntimeError("NCCL error: unhandled system error")
        return super().device_index(info)


@pytest.mark.parametrize("die", [True, False])
def test_a_rank_that_fails_while_the_group_is_set_up_does_not_hang_its_peer(die: bool) -> None:
    # without the watcher during set-up, rank 0 would wait the whole timeout in init and
    # fail with gloo's timeout, not with the message naming rank 1 (checked below)
    group = DiesBeforeJoining(backend="gloo", device="cpu", timeout_s=30, grace_s=5,
                              join_timeout_s=120, die=die)
    outcomes = spawn_ranks(group, SumBody(), 2)
    assert [o.ok for o in outcomes] == [False, False]
    assert outcomes[1].first_failure and not outcomes[0].first_failure
    if die:
        assert outcomes[1].message == "rank 1 exited with code 3 before it reported"
    else:
        assert outcomes[1].message.startswith("RuntimeError: NCCL error: unhandled system error")
    assert "rank 0 stopped waiting in init_process_group: rank 1 failed" in outcomes[0].message
