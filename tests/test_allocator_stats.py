"""``torch.cuda.memory_stats()`` on virtual GPUs: every key torch's dict has, c10's
statistics kept over the simulated caching allocator, and torch's own ``memory_summary``
printing them."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from dpprof.emulator.allocator import CachingAllocatorSim
from dpprof.emulator.allocator_config import DEFAULT_CONFIG, K_SMALL_SIZE, block_bytes
from dpprof.emulator.allocator_stats import POOLED, memory_stats
from dpprof.emulator.virtual_cuda import VirtualCuda

MiB = 2**20
KiB = 1024


@pytest.fixture(autouse=True)
def _no_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_the_keys_are_torchs() -> None:
    """torch's memory_stats names (its docstring lists them): each pooled statistic per
    pool and metric, the oversize ones, the counts."""
    stats = memory_stats([], DEFAULT_CONFIG)
    for name in POOLED:
        for pool in ("all", "large_pool", "small_pool"):
            for metric in ("current", "peak", "allocated", "freed"):
                assert f"{name}.{pool}.{metric}" in stats
    for name in ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                 "num_device_free", "max_split_size", "oversize_allocations.current",
                 "oversize_segments.peak"):
        assert name in stats
    assert stats["max_split_size"] == -1  # unlimited, as torch gives it
    for name in torch.cuda.memory.memory_stats.__doc__.split():  # type: ignore[union-attr]
        # (reserved_bytes_by_private_pools: a CUDA graph's or MemPool's, not given)
        if (name.startswith('``"') and name.endswith('"``:') and "{" not in name
                and "private_pools" not in name):
            assert name[3:-4] in stats, name


def test_a_split_segment_and_its_inactive_rest_worked_by_hand() -> None:
    # 3 MiB: a 20 MiB segment of the large pool, split, the 17 MiB rest inactive; 1 KiB: a
    # 2 MiB segment of the small pool, the rest inactive; the 3 MiB freed merges back
    events = [("alloc", 1, 3 * MiB), ("alloc", 2, KiB)]
    s = memory_stats(events, DEFAULT_CONFIG)
    assert s["allocation.all.current"] == 2 and s["active.large_pool.current"] == 1
    assert s["allocated_bytes.large_pool.current"] == 3 * MiB
    assert s["allocated_bytes.small_pool.current"] == KiB
    assert s["segment.large_pool.current"] == s["segment.small_pool.current"] == 1
    assert s["reserved_bytes.all.current"] == 22 * MiB
    assert (s["inactive_split.large_pool.current"],
            s["inactive_split_bytes.large_pool.current"]) == (1, 17 * MiB)
    assert s["inactive_split_bytes.small_pool.current"] == 2 * MiB - KiB
    s = memory_stats([*events, ("free", 1, 0)], DEFAULT_CONFIG)
    assert s["inactive_split.large_pool.current"] == 0
    assert s["inactive_split_bytes.large_pool.freed"] == 17 * MiB
    assert s["allocated_bytes.large_pool.freed"] == 3 * MiB
    assert s["allocated_bytes.all.peak"] == 3 * MiB + KiB
    assert s["reserved_bytes.all.current"] == 22 * MiB  # cached
    s = memory_stats([*events, ("free", 1, 0), ("empty_cache",)], DEFAULT_CONFIG)
    assert s["reserved_bytes.large_pool.current"] == 0 and s["num_device_free"] == 1
    assert s["num_sync_all_streams"] == 1


def _inactive_split(segments: list[dict[str, Any]], large: bool) -> tuple[int, int]:
    free = [b for seg in segments if seg["is_large"] == large and len(seg["blocks"]) > 1
            for b in seg["blocks"] if not b["allocated"]]
    return len(free), sum(b["size"] for b in free)


@pytest.mark.parametrize("seed", range(6))
def test_random_programs_keep_the_stats_equal_to_the_segments_they_leave(seed: int) -> None:
    """Random allocations and frees (small and large, on two streams): after each, the
    statistics equal what the simulated allocator's segments hold, counted from them apart
    (reserved and segments per pool, the free blocks of split segments, the live tensors)."""
    rng = random.Random(seed)
    events: list[tuple[Any, ...]] = []
    live: dict[int, int] = {}
    sizes = [200, 4 * KiB, 600 * KiB, 2 * MiB, 7 * MiB, 12 * MiB, 33 * MiB]
    for serial in range(300):
        if live and rng.random() < 0.45:
            gone = rng.choice(sorted(live))
            del live[gone]
            events.append(("free", gone, 0))
        else:
            live[serial] = rng.choice(sizes) + rng.randrange(0, 4096)
            events.append(("alloc", serial, live[serial], rng.choice((0, 0, 7))))
        if serial % 37 == 0:
            events.append(("empty_cache",))
        if serial % 25:
            continue
        s = memory_stats(events, DEFAULT_CONFIG)
        sim = CachingAllocatorSim()
        blocks = {}
        for ev in events:
            if ev[0] == "alloc":
                blocks[ev[1]] = sim.malloc(ev[2], ev[3])
            elif ev[0] == "free":
                sim.free(blocks.pop(ev[1]))
            else:
                sim.empty_cache()
        segments = sim.snapshot()
        for large, pool in ((True, "large_pool"), (False, "small_pool")):
            mine = [seg for seg in segments if seg["is_large"] == large]
            assert s[f"segment.{pool}.current"] == len(mine)
            assert s[f"reserved_bytes.{pool}.current"] == sum(x["total_size"] for x in mine)
            assert (s[f"inactive_split.{pool}.current"],
                    s[f"inactive_split_bytes.{pool}.current"]) == _inactive_split(segments, large)
            tensors = [block_bytes(n) for n in live.values()
                       if (block_bytes(n) > K_SMALL_SIZE) == large]
            assert s[f"allocated_bytes.{pool}.current"] == sum(tensors)
            assert s[f"allocation.{pool}.current"] == len(tensors)
        assert s["requested_bytes.all.current"] == sum(live.values())


def test_torchs_memory_summary_prints_the_emulated_statistics() -> None:
    with VirtualCuda(1):
        x = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
        stats = torch.cuda.memory_stats()
        assert stats["allocated_bytes.all.current"] == torch.cuda.memory_allocated()
        assert stats["reserved_bytes.all.current"] == torch.cuda.memory_reserved()
        summary = torch.cuda.memory_summary()
        assert "PyTorch CUDA memory summary" in summary
        assert "GPU reserved memory" in summary and "Non-releasable memory" in summary
        assert "20480 KiB" in summary  # the 20 MiB segment, as torch formats it
        assert torch.cuda.memory.memory_summary(abbreviated=True)
        del x


def test_accumulated_statistics_restart_where_they_are_reset() -> None:
    with VirtualCuda(1):
        x = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
        del x
        torch.cuda.reset_accumulated_memory_stats()
        assert torch.cuda.memory_stats()["allocated_bytes.all.allocated"] == 0
        y = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
        stats = torch.cuda.memory_stats()
        assert stats["allocated_bytes.all.allocated"] == 2 * MiB
        assert stats["num_device_alloc"] == 0  # served from the cached 20 MiB segment
        del y
