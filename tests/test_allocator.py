"""The caching-allocator simulation against hand-computed cases from CUDACachingAllocator.cpp."""

from __future__ import annotations

import random
from itertools import pairwise

import pytest

from dpprof.emulator.allocator import CachingAllocatorSim, SimulatedOutOfMemory
from dpprof.emulator.allocator_config import (
    K_LARGE_BUFFER,
    K_SMALL_BUFFER,
    AllocatorConfig,
    block_bytes,
    get_allocation_size,
    round_size,
    roundup_power2_next_division,
)
from dpprof.emulator.allocator_replay import simulate

KiB = 1024
MiB = 1024 * 1024


def allocs(*sizes: int) -> list[tuple[str, int, int]]:
    return [("alloc", i, s) for i, s in enumerate(sizes)]


# ----------------------------------------------------------------------------- size rules


@pytest.mark.parametrize(
    ("request_bytes", "expected"),
    [(1, 512), (100, 512), (511, 512), (512, 512), (513, 1024), (1000, 1024), (MiB + 1, MiB + 512)],
)
def test_round_size_is_512_byte_multiples(request_bytes: int, expected: int) -> None:
    assert round_size(request_bytes) == expected


def test_block_bytes_rounds_as_the_allocator_and_an_empty_storage_holds_none() -> None:
    assert block_bytes(0) == 0  # allocate(0) never reaches malloc; block_bytes(0) would be 512
    assert block_bytes(1) == 512
    assert block_bytes(512) == 512
    assert block_bytes(513) == 1024
    assert block_bytes(4_000_000) == 4_000_256


@pytest.mark.parametrize(
    ("rounded", "segment"),
    [
        (512, K_SMALL_BUFFER),
        (MiB, K_SMALL_BUFFER),  # 1 MiB is still small
        (MiB + 512, K_LARGE_BUFFER),
        (10 * MiB - 512, K_LARGE_BUFFER),
        (10 * MiB, 10 * MiB),  # from kMinLargeAlloc on: rounded up to 2 MiB
        (11 * MiB, 12 * MiB),
        (30 * MiB, 30 * MiB),
    ],
)
def test_get_allocation_size(rounded: int, segment: int) -> None:
    assert get_allocation_size(rounded) == segment


def test_roundup_power2_next_division_matches_the_source_comment() -> None:
    # "if we need to round-up 1200 and number of divisions is 4 ... return 1280"
    assert roundup_power2_next_division(1200, 4) == 1280
    assert roundup_power2_next_division(1024, 4) == 1024  # powers of two stay
    assert roundup_power2_next_division(1281, 4) == 1536


def test_round_size_with_power2_divisions() -> None:
    cfg = AllocatorConfig(roundup_power2_divisions=4)
    # 3 MiB + 1 lies in [2, 4) MiB, quarters are 512 KiB: up to 3.5 MiB
    assert round_size(3 * MiB + 1, cfg) == 3 * MiB + 512 * KiB
    # small sizes (<= 512 * divisions) keep plain rounding
    assert round_size(1200, cfg) == 1536
    assert round_size(3 * MiB + 1) == 3 * MiB + 512  # default: off


def test_divisions_per_power_of_two_interval() -> None:
    # roundup_power2_divisions:[256:1,512:2,>:4] as AllocatorConfig::parseArgs fills it
    cfg = AllocatorConfig(roundup_power2_divisions=(1,) * 9 + (4,) * 7)
    assert cfg.divisions_for(300 * MiB) == 1
    assert cfg.divisions_for(600 * MiB) == 4
    assert AllocatorConfig(roundup_power2_divisions=8).divisions_for(MiB) == 8
    with pytest.raises(ValueError, match="at least 20 MiB"):
        AllocatorConfig(max_split_size=8 * MiB)


def test_large_segment_size_option() -> None:
    cfg = AllocatorConfig(large_segment_size=32 * MiB)
    assert simulate(allocs(5 * MiB), config=cfg).peak_reserved_bytes == 32 * MiB
    assert simulate(allocs(12 * MiB), config=cfg).peak_reserved_bytes == 12 * MiB  # >= 10 MiB
    with pytest.raises(ValueError, match="large_segment_size"):
        AllocatorConfig(large_segment_size=4 * MiB)


EXPANDABLE = AllocatorConfig(expandable_segments=True)


def test_expandable_segments_map_whole_pages_as_requests_need_them() -> None:
    # one 30 MiB request maps two 20 MiB pages of the large pool's segment (default: a 30
    # MiB segment); 30 small 100 KiB requests fill two 2 MiB pages, as two small segments
    assert simulate([("alloc", 0, 30 * MiB)], config=EXPANDABLE).peak_reserved_bytes == 40 * MiB
    assert simulate([("alloc", 0, 30 * MiB)]).peak_reserved_bytes == 30 * MiB
    small = [("alloc", i, 100 * 1024) for i in range(30)]
    assert simulate(small, config=EXPANDABLE).peak_reserved_bytes == 4 * MiB


def test_expandable_segments_merge_what_separate_segments_cannot() -> None:
    # four 12 MiB requests: by default four 12 MiB segments, and the first two freed cannot
    # serve 24 MiB (each is a segment of its own): a fifth segment, 72 MiB. Expandable: one
    # segment, grown a page at a time as a free tail cannot serve (20, 40, 60 MiB mapped);
    # the first two freed merge into 24 MiB, which serves the request: 60 MiB
    events = [*(("alloc", i, 12 * MiB) for i in range(4)), ("free", 0, 0), ("free", 1, 0),
              ("alloc", 9, 24 * MiB)]
    assert simulate(events).peak_reserved_bytes == 72 * MiB
    assert simulate(events, config=EXPANDABLE).peak_reserved_bytes == 60 * MiB


def test_expandable_segments_unmap_free_pages_and_map_the_lowest_room_again() -> None:
    # 30 MiB (two pages, 10 MiB free after it) and 5 MiB (from that free tail); the 30 MiB
    # freed and the cache emptied: its whole first page is unmapped, the rest of it (10 MiB
    # of the second page) stays. 45 MiB: the hole (20 MiB) and the free 10 MiB after it are
    # not enough, so the free 5 MiB at the end grows by two pages: 20 + 40 MiB mapped
    events = [("alloc", 0, 30 * MiB), ("alloc", 1, 5 * MiB), ("free", 0, 0),
              ("empty_cache", None, 0)]
    emptied = simulate(events, config=EXPANDABLE)
    assert (emptied.peak_reserved_bytes, emptied.final_reserved_bytes) == (40 * MiB, 20 * MiB)
    grown = simulate([*events, ("alloc", 2, 45 * MiB)], config=EXPANDABLE)
    assert grown.final_reserved_bytes == 60 * MiB


def test_expandable_segments_unmap_free_pages_when_a_device_is_full() -> None:
    # A 30 MiB and B 8 MiB share two pages (2 MiB free at the end); A freed. C 35 MiB: no
    # free block serves it, so the free 2 MiB at the end grows by two pages (80 MiB), past
    # a 60 MiB device: the retry unmaps A's whole page (20 MiB mapped now) and grows again
    events = [("alloc", 0, 30 * MiB), ("alloc", 1, 8 * MiB), ("free", 0, 0),
              ("alloc", 2, 35 * MiB)]
    s = simulate(events, capacity_bytes=60 * MiB, config=EXPANDABLE)
    assert s.fits and s.num_alloc_retries == 1 and s.final_reserved_bytes == 60 * MiB
    assert simulate(events, capacity_bytes=59 * MiB, config=EXPANDABLE).oom
    assert simulate(events, config=EXPANDABLE).peak_reserved_bytes == 80 * MiB


# ----------------------------------------------------------------------------- small pool


def test_100_bytes_take_512_allocated_and_a_2mib_segment() -> None:
    s = simulate(allocs(100))
    assert s.peak_allocated_bytes == 512
    assert s.peak_requested_bytes == 100
    assert s.peak_reserved_bytes == 2 * MiB
    assert s.num_cudamalloc == 1
    assert s.num_segments == 1


def test_small_requests_share_a_2mib_segment_until_it_is_full() -> None:
    sz = 600 * KiB  # 614,400 B, already a multiple of 512
    two = simulate(allocs(sz, sz))
    assert two.peak_reserved_bytes == 2 * MiB  # both fit in one small segment
    assert two.peak_allocated_bytes == 2 * sz
    assert two.num_cudamalloc == 1
    three = simulate(allocs(sz, sz, sz))  # 3 x 600 KiB = 1,843,200 <= 2 MiB
    assert three.peak_reserved_bytes == 2 * MiB
    four = simulate(allocs(sz, sz, sz, sz))  # the fourth needs a second segment
    assert four.peak_reserved_bytes == 4 * MiB
    assert four.num_cudamalloc == 2


def test_small_pool_splits_down_to_a_512_byte_rest() -> None:
    # 1 MiB + (1 MiB - 512) leave exactly 512 B: split off (>= kMinBlockSize), so a 512 B
    # request fits without a second segment
    s = simulate(allocs(MiB, MiB - 512, 512))
    assert s.num_cudamalloc == 1
    assert s.peak_allocated_bytes == 2 * MiB


def test_one_mib_is_small_and_one_mib_plus_512_is_large() -> None:
    assert simulate(allocs(MiB)).peak_reserved_bytes == 2 * MiB
    assert simulate(allocs(MiB + 1)).peak_reserved_bytes == 20 * MiB


def test_pools_do_not_lend_to_each_other() -> None:
    # a freed 20 MiB large segment does not serve a small request
    s = simulate([("alloc", 0, 5 * MiB), ("free", 0, 0), ("alloc", 1, 100)])
    assert s.peak_reserved_bytes == 22 * MiB
    assert s.num_cudamalloc == 2


# ----------------------------------------------------------------------------- large pool


def test_5mib_gets_a_20mib_segment_and_a_second_5mib_reuses_the_remainder() -> None:
    one = simulate(allocs(5 * MiB))
    assert one.peak_reserved_bytes == 20 * MiB
    assert one.peak_allocated_bytes == 5 * MiB  # split: the rest (15 MiB > 1 MiB) stays free
    two = simulate(allocs(5 * MiB, 5 * MiB))
    assert two.peak_reserved_bytes == 20 * MiB
    assert two.peak_allocated_bytes == 10 * MiB
    assert two.num_cudamalloc == 1
    four = simulate(allocs(5 * MiB, 5 * MiB, 5 * MiB, 5 * MiB))  # the last takes the rest whole
    assert four.peak_reserved_bytes == 20 * MiB and four.peak_allocated_bytes == 20 * MiB
    five = simulate(allocs(*[5 * MiB] * 5))
    assert five.peak_reserved_bytes == 40 * MiB and five.num_cudamalloc == 2


def test_30mib_gets_its_own_30mib_segment() -> None:
    s = simulate(allocs(30 * MiB))
    assert s.peak_reserved_bytes == 30 * MiB
    assert s.peak_allocated_bytes == 30 * MiB
    odd = simulate(allocs(29 * MiB + 1))  # rounded up to a 2 MiB multiple
    assert odd.peak_reserved_bytes == 30 * MiB


def test_unsplit_large_block_counts_its_whole_size_as_allocated() -> None:
    # 11 MiB -> 12 MiB segment; the rest, exactly 1 MiB, is not > kSmallSize: no split
    s = simulate(allocs(11 * MiB))
    assert s.peak_reserved_bytes == 12 * MiB
    assert s.peak_allocated_bytes == 12 * MiB
    assert s.peak_requested_bytes == 11 * MiB
    # 31 MiB + 1 B: rounded to 31 MiB + 512, segment 32 MiB, rest 1 MiB - 512: whole block
    t = simulate(allocs(31 * MiB + 1))
    assert t.peak_allocated_bytes == 32 * MiB
    # reusing a cached block: 30 MiB cached, 29.5 MiB asked: rest 0.5 MiB, handed out whole
    u = simulate([("alloc", 0, 30 * MiB), ("free", 0, 0), ("alloc", 1, 29 * MiB + 512 * KiB)])
    assert u.num_cudamalloc == 1
    assert u.final_allocated_bytes == 30 * MiB
    assert u.final_requested_bytes == 29 * MiB + 512 * KiB


def test_free_then_smaller_realloc_reuses_the_cached_block() -> None:
    s = simulate([("alloc", 0, 30 * MiB), ("free", 0, 0), ("alloc", 1, 25 * MiB)])
    assert s.num_cudamalloc == 1
    assert s.peak_reserved_bytes == 30 * MiB
    assert s.final_allocated_bytes == 25 * MiB  # split: 5 MiB rest > 1 MiB
    small = simulate([("alloc", 0, 1000), ("free", 0, 0), ("alloc", 1, 600)])
    assert small.num_cudamalloc == 1
    assert small.final_allocated_bytes == 1024


def test_a_larger_request_does_not_fit_a_smaller_cached_block() -> None:
    s = simulate([("alloc", 0, 12 * MiB), ("free", 0, 0), ("alloc", 1, 14 * MiB)])
    assert s.num_cudamalloc == 2
    assert s.peak_reserved_bytes == 26 * MiB


def test_best_fit_takes_the_smallest_block_that_fits() -> None:
    sim = CachingAllocatorSim()
    a = sim.malloc(40 * MiB)
    b = sim.malloc(24 * MiB)
    sim.free(a)
    sim.free(b)
    sim.malloc(22 * MiB)  # 24 MiB block is the best fit, the 40 MiB one stays whole
    blocks = {seg["total_size"]: seg["blocks"] for seg in sim.snapshot()}
    assert [x["allocated"] for x in blocks[40 * MiB]] == [False]
    assert [(x["size"], x["allocated"]) for x in blocks[24 * MiB]] == [
        (22 * MiB, True),
        (2 * MiB, False),
    ]


# ----------------------------------------------------------------------------- merging


def test_freed_neighbours_merge_so_a_larger_request_fits_without_cudamalloc() -> None:
    # one 20 MiB segment: [A 4][B 4][C 12]; free A and B -> one free 8 MiB block
    events = [
        ("alloc", "a", 4 * MiB),
        ("alloc", "b", 4 * MiB),
        ("alloc", "c", 12 * MiB),
        ("free", "a", 0),
        ("free", "b", 0),
        ("alloc", "d", 8 * MiB),
    ]
    s = simulate(events)
    assert s.num_cudamalloc == 1
    assert s.peak_reserved_bytes == 20 * MiB
    assert s.final_allocated_bytes == 20 * MiB


def test_without_neighbours_free_fragments_force_a_new_segment() -> None:
    # [A 4][B 4][C 12], free A and C: free 4 MiB and 12 MiB, not adjacent: 14 MiB needs cudaMalloc
    events = [
        ("alloc", "a", 4 * MiB),
        ("alloc", "b", 4 * MiB),
        ("alloc", "c", 12 * MiB),
        ("free", "a", 0),
        ("free", "c", 0),
        ("alloc", "d", 14 * MiB),
    ]
    s = simulate(events)
    assert s.num_cudamalloc == 2
    assert s.peak_reserved_bytes == 20 * MiB + 14 * MiB


def test_merge_with_both_neighbours_restores_the_whole_segment() -> None:
    sim = CachingAllocatorSim()
    a = sim.malloc(4 * MiB)
    b = sim.malloc(4 * MiB)
    c = sim.malloc(4 * MiB)  # rest: 8 MiB free at the end
    sim.free(a)
    sim.free(c)  # merges with the free 8 MiB after it
    seg = sim.snapshot()[0]
    assert [(x["size"], x["allocated"]) for x in seg["blocks"]] == [
        (4 * MiB, False),
        (4 * MiB, True),
        (12 * MiB, False),
    ]
    sim.free(b)  # merges with both
    seg = sim.snapshot()[0]
    assert seg["blocks"] == [{"size": 20 * MiB, "allocated": False, "requested_size": 0}]
    sim.empty_cache()  # now unsplit: released
    assert sim.reserved_bytes == 0
    assert sim.num_device_free == 1


def test_empty_cache_keeps_split_segments_and_frees_unsplit_ones() -> None:
    events = [
        ("alloc", "keep", 5 * MiB),  # 20 MiB segment, split, stays
        ("alloc", "tmp", 30 * MiB),  # 30 MiB segment
        ("free", "tmp", 0),
        ("empty_cache", None, 0),
    ]
    s = simulate(events)
    assert s.peak_reserved_bytes == 50 * MiB
    assert s.final_reserved_bytes == 20 * MiB
    assert s.num_cudafree == 1


# ----------------------------------------------------------------------------- streams


def test_a_block_freed_on_one_stream_is_not_reused_by_another() -> None:
    # get_free_block searches (stream, size): the default stream's 5 MiB request finds no
    # block of its own and cudaMallocs while the side stream's 20 MiB segment lies free
    same = simulate([("alloc", 0, 5 * MiB, 7), ("free", 0, 0), ("alloc", 1, 5 * MiB, 7)])
    apart = simulate([("alloc", 0, 5 * MiB, 7), ("free", 0, 0), ("alloc", 1, 5 * MiB)])
    assert (same.num_cudamalloc, same.peak_reserved_bytes) == (1, 20 * MiB)
    assert (apart.num_cudamalloc, apart.peak_reserved_bytes) == (2, 40 * MiB)


def test_a_side_stream_splits_and_merges_within_its_own_segments() -> None:
    sim = CachingAllocatorSim()
    a = sim.malloc(4 * MiB, stream=3)
    b = sim.malloc(4 * MiB, stream=3)  # the rest of a's segment: a split keeps the stream
    c = sim.malloc(4 * MiB)  # the default stream: a segment of its own
    assert sim.num_device_alloc == 2
    sim.free(a)
    sim.free(b)  # merges with a into the whole free segment, back in stream 3's pool
    sim.free(c)
    d = sim.malloc(20 * MiB, stream=3)
    assert sim.num_device_alloc == 2 and d is not None
    by_stream = {seg["stream"]: seg["allocated_size"] for seg in sim.snapshot()}
    assert by_stream == {3: 20 * MiB, 0: 0}


def test_empty_cache_releases_every_streams_cached_segments() -> None:
    s = simulate([("alloc", 0, 5 * MiB, 2), ("alloc", 1, MiB, 2), ("alloc", 2, 30 * MiB),
                  ("free", 0, 0), ("free", 1, 0), ("free", 2, 0), ("empty_cache", None, 0)])
    assert s.peak_reserved_bytes == 20 * MiB + 2 * MiB + 30 * MiB
    assert (s.final_reserved_bytes, s.num_cudafree) == (0, 3)


def test_out_of_memory_frees_other_streams_cached_segments_before_failing() -> None:
    # release_cached_blocks runs over the whole pool, every stream's blocks in it
    s = simulate([("alloc", 0, 30 * MiB, 5), ("free", 0, 0), ("alloc", 1, 30 * MiB)],
                 capacity_bytes=40 * MiB)
    assert s.fits and s.num_alloc_retries == 1 and s.final_reserved_bytes == 30 * MiB


# ----------------------------------------------------------------------------- OOM path


def test_oom_when_the_new_segment_exceeds_capacity() -> None:
    # 20 MiB capacity: 5 MiB fits (20 MiB segment); 16 MiB needs a second segment; the first
    # is split (5 MiB live), so releasing the cache frees nothing: one retry, then OOM
    events = [("alloc", 0, 5 * MiB), ("alloc", 1, 16 * MiB), ("alloc", 2, 100)]
    s = simulate(events, capacity_bytes=20 * MiB)
    assert s.oom
    assert not s.fits
    assert s.oom_event_index == 1
    assert s.oom_requested_bytes == 16 * MiB
    assert s.oom_alloc_bytes == 16 * MiB
    assert s.num_alloc_retries == 1
    assert s.num_events == 2  # stopped at the failing event
    assert s.peak_reserved_bytes == 20 * MiB
    assert simulate(events, capacity_bytes=36 * MiB + 2 * MiB).fits


def test_oom_retry_releases_cached_segments_and_succeeds() -> None:
    # 30 MiB cached and free; 40 MiB cannot use it; 30 + 40 > 50: release_cached_blocks frees
    # the 30 MiB segment, the retry gets 40 MiB
    events = [("alloc", 0, 30 * MiB), ("free", 0, 0), ("alloc", 1, 40 * MiB)]
    s = simulate(events, capacity_bytes=50 * MiB)
    assert s.fits
    assert s.num_alloc_retries == 1
    assert s.num_cudamalloc == 2
    assert s.num_cudafree == 1
    assert s.peak_reserved_bytes == 40 * MiB
    unlimited = simulate(events)
    assert unlimited.peak_reserved_bytes == 70 * MiB and unlimited.num_alloc_retries == 0


def test_oom_retry_also_releases_cached_small_segments() -> None:
    events = [("alloc", 0, 100), ("free", 0, 0), ("alloc", 1, 19 * MiB + 1)]
    s = simulate(events, capacity_bytes=21 * MiB)
    assert s.fits
    assert s.num_alloc_retries == 1
    assert s.final_reserved_bytes == 20 * MiB


def test_continue_after_oom_skips_the_failed_allocation() -> None:
    events = [
        ("alloc", 0, 5 * MiB),  # 20 MiB segment: [5 live][15 free]
        ("alloc", 1, 30 * MiB),  # 20 + 30 > 32 MiB, and the split segment cannot be released
        ("free", 1, 0),  # ignored: it never got memory
        ("alloc", 2, 5 * MiB),  # fits the 20 MiB segment's remainder
        ("alloc", 3, 40 * MiB),  # a second OOM
    ]
    s = simulate(events, capacity_bytes=32 * MiB, stop_on_oom=False)
    assert s.oom and s.oom_event_index == 1 and s.oom_requested_bytes == 30 * MiB
    assert s.num_ooms == 2
    assert s.num_events == len(events)
    assert s.final_allocated_bytes == 10 * MiB
    assert s.final_reserved_bytes == 20 * MiB


def test_allocator_raises_simulated_oom() -> None:
    sim = CachingAllocatorSim(capacity_bytes=10 * MiB)
    with pytest.raises(SimulatedOutOfMemory) as err:
        sim.malloc(12 * MiB)
    assert err.value.alloc_bytes == 12 * MiB
    assert sim.num_ooms == 1


# ----------------------------------------------------------------------------- max_split_size


def test_max_split_size_keeps_oversize_blocks_from_small_requests() -> None:
    events = [("alloc", 0, 40 * MiB), ("free", 0, 0), ("alloc", 1, 10 * MiB)]
    default = simulate(events)
    assert default.num_cudamalloc == 1  # the 40 MiB block is split
    limited = simulate(events, config=AllocatorConfig(max_split_size=32 * MiB))
    assert limited.num_cudamalloc == 2
    assert limited.peak_reserved_bytes == 50 * MiB


def test_max_split_size_oversize_blocks_serve_requests_within_the_rounding_limit() -> None:
    cfg = AllocatorConfig(max_split_size=32 * MiB)
    near = simulate([("alloc", 0, 56 * MiB), ("free", 0, 0), ("alloc", 1, 40 * MiB)], config=cfg)
    assert near.num_cudamalloc == 1
    assert near.final_allocated_bytes == 56 * MiB  # not split: size >= max_split_size
    far = simulate([("alloc", 0, 64 * MiB), ("free", 0, 0), ("alloc", 1, 40 * MiB)], config=cfg)
    assert far.num_cudamalloc == 2  # 64 >= 40 + 20 MiB: not used


def test_release_available_cached_blocks_frees_an_oversize_segment_before_retrying() -> None:
    cfg = AllocatorConfig(max_split_size=32 * MiB)
    events = [("alloc", 0, 40 * MiB), ("free", 0, 0), ("alloc", 1, 10 * MiB)]
    s = simulate(events, capacity_bytes=45 * MiB, config=cfg)
    assert s.fits
    assert s.num_cudafree == 1
    assert s.num_alloc_retries == 0  # freed by release_available_cached_blocks, not a retry
    assert s.final_reserved_bytes == 10 * MiB


# ----------------------------------------------------------------------------- replay mechanics


def test_zero_byte_allocations_take_no_block() -> None:
    s = simulate([("alloc", 0, 0), ("free", 0, 0), ("alloc", 1, 0)])
    assert s.peak_reserved_bytes == 0 and s.num_cudamalloc == 0


def test_bad_events_are_reported_with_their_index() -> None:
    with pytest.raises(ValueError, match="event 1: free of unknown block"):
        simulate([("alloc", 0, 10), ("free", 9, 0)])
    with pytest.raises(ValueError, match="event 1: block 0 allocated again"):
        simulate([("alloc", 0, 10), ("alloc", 0, 10)])
    with pytest.raises(ValueError, match="unknown kind"):
        simulate([("malloc", 0, 10)])


def test_reset_peak_and_extra_event_fields() -> None:
    events = [
        ("alloc", 0, 30 * MiB, "activations"),
        ("free", 0, 0, "activations"),
        ("empty_cache", None, 0),
        ("reset_peak", None, 0),
        ("alloc", 1, 4 * MiB, "parameters"),
    ]
    s = simulate(events)
    assert s.peak_reserved_bytes == 20 * MiB
    assert s.peak_allocated_bytes == 4 * MiB


def test_timeline_is_capped_and_keeps_the_peak() -> None:
    events = []
    for i in range(1000):
        events.append(("alloc", i, (i % 7 + 1) * MiB))
        if i % 3 == 0:
            events.append(("free", i, 0))
    s = simulate(events, timeline_points=50)
    assert 0 < len(s.timeline) <= 50
    assert max(p[2] for p in s.timeline) == s.peak_reserved_bytes
    assert max(p[1] for p in s.timeline) == s.peak_allocated_bytes
    assert s.timeline[-1][0] == len(events) - 1
    assert simulate(events, timeline_points=None).timeline == []


def test_generator_input_and_to_dict() -> None:
    s = simulate(("alloc", i, 1000) for i in range(3))
    d = s.to_dict()
    assert d["peak_allocated_bytes"] == 3 * 1024
    assert d["oom"] is False


def test_statistics_stay_consistent_on_a_random_trace() -> None:
    rng = random.Random(7)
    sim = CachingAllocatorSim()
    live = {}
    for i in range(5000):
        if live and rng.random() < 0.45:
            sim.free(live.pop(rng.choice(list(live))))
        else:
            live[i] = sim.malloc(rng.choice([rng.randint(1, 8192), rng.randint(1, 40 * MiB)]))
        segs = sim.snapshot() if i % 500 == 0 else None
        if segs is not None:
            assert sum(x["total_size"] for x in segs) == sim.reserved_bytes
            assert sum(x["allocated_size"] for x in segs) == sim.allocated_bytes
            for seg in segs:  # no two free neighbours survive a merge
                flags = [b["allocated"] for b in seg["blocks"]]
                assert all(a or b for a, b in pairwise(flags))
    for block in list(live.values()):
        sim.free(block)
    assert sim.allocated_bytes == 0 and sim.requested_bytes == 0
    sim.empty_cache()
    assert sim.reserved_bytes == 0 and sim.segments == 0


def random_events(n: int, seed: int = 0) -> list[tuple[str, int, int]]:
    """``n`` allocator events: allocations of small and large blocks, each freed at random
    or at the end (benchmarks/bench_allocator.py times their replay)."""
    rng = random.Random(seed)
    events: list[tuple[str, int, int]] = []
    live: list[int] = []
    for i in range(n * 6 // 10):
        if live and rng.random() < 0.5:
            events.append(("free", live.pop(rng.randrange(len(live))), 0))
        else:
            events.append(
                ("alloc", i, rng.choice([rng.randint(1, 4096), rng.randint(1, 64 * MiB)]))
            )
            live.append(i)
    events.extend(("free", b, 0) for b in live)
    return events[:n]


def test_random_events_leave_what_they_did_not_free() -> None:
    events = random_events(100_000)
    s = simulate(events)
    assert s.num_events == len(events) and not s.oom
    # the requests the events leave live are what stays requested (nothing lost or doubled
    # over the events), and the allocator's rounding only adds to them
    sizes = {e[1]: e[2] for e in events if e[0] == "alloc"}
    live = set(sizes) - {e[1] for e in events if e[0] == "free"}
    assert s.final_requested_bytes == sum(sizes[b] for b in live)
    assert s.final_allocated_bytes >= s.final_requested_bytes


def test_the_allocator_settings_are_read_as_c10_reads_them() -> None:
    """c10's own cases (c10/test/core/AllocatorConfig_test.cpp), and the settings left as
    notes: what it refuses, and what the simulation does not model."""
    from dpprof.emulator.allocator_config import allocator_setting, config_from_setting

    # torch reads PYTORCH_ALLOC_CONF first, then the older name
    assert allocator_setting({"PYTORCH_CUDA_ALLOC_CONF": "a:1", "PYTORCH_ALLOC_CONF": "b:2"}) \
        == ("PYTORCH_ALLOC_CONF", "b:2")
    assert allocator_setting({"PYTORCH_CUDA_ALLOC_CONF": "a:1"}) == ("PYTORCH_CUDA_ALLOC_CONF",
                                                                    "a:1")
    assert allocator_setting({}) is None
    c, left = config_from_setting(
        "max_split_size_mb:40,max_non_split_rounding_mb:30,garbage_collection_threshold:0.5,"
        "roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1],"
        "expandable_segments:True,pinned_use_background_threads:True")
    assert left == []  # without a memory fraction the collection never runs
    assert (c.large_segment_size, c.max_split_size, c.max_non_split_rounding_size) == (
        20 * MiB, 40 * MiB, 30 * MiB)
    assert c.expandable_segments
    assert [c.divisions_for(mb * MiB) for mb in (32, 64, 128, 256, 512, 1024, 2048, 4096,
                                                   8192)] == [8, 8, 2, 4, 2, 4, 1, 1, 1]
    c, left = config_from_setting("large_segment_size_mb:15,max_split_size_mb:20,"
                                  "max_non_split_rounding_mb:40,garbage_collection_threshold:0.8",
                                  fraction_set=True)
    assert (c.large_segment_size, c.max_split_size, c.max_non_split_rounding_size) == (
        15 * MiB, 20 * MiB, 40 * MiB)
    assert left == ["garbage_collection_threshold:0.8"]
    c, _ = config_from_setting("roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]")
    assert [c.divisions_for(mb * MiB) for mb in (64, 128, 256, 512, 1024, 2048, 4096)] == [
        8, 8, 16, 1, 0, 8, 2]
    c, _ = config_from_setting("roundup_power2_divisions:4")
    assert [c.divisions_for(mb * MiB) for mb in (64, 256, 2048)] == [4, 4, 4]
    c, left = config_from_setting("max_split_size_mb:20,large_segment_size_mb:25")
    assert c.max_split_size is None and c.large_segment_size == 25 * MiB
    assert left == ["max_split_size_mb:20 (torch refuses it: it must be at least 25)"]
    assert config_from_setting("backend:cudaMallocAsync")[1] == ["backend:cudaMallocAsync"]
    assert config_from_setting("expandable_segments:False,backend:native") == (
        config_from_setting(None)[0], [])


def test_power_of_two_divisions_round_the_blocks_the_allocator_reserves() -> None:
    from dpprof.emulator.allocator_config import config_from_setting

    # 33 MiB with 4 divisions: the next of 32, 40, 48, 56 MiB (c10's
    # roundup_power2_next_division); plain rounding: 33 MiB's own segment, 34 MiB (2 MiB steps)
    events = [("alloc", k, 33 * MiB) for k in range(4)]
    plain = simulate(events)
    rounded = simulate(events, config=config_from_setting("roundup_power2_divisions:4")[0])
    assert plain.peak_reserved_bytes == 4 * 34 * MiB
    assert rounded.peak_reserved_bytes == 4 * 40 * MiB
    assert rounded.peak_allocated_bytes == 4 * 40 * MiB
