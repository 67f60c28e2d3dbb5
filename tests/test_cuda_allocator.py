"""The caching-allocator model against hand-computed bytes (torch's c10/cuda/CUDACachingAllocator.cpp rules)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from lightning_sac.dryrun.cuda.allocator import AllocatorConfig, CachingAllocatorModel, round_size, segment_bytes
from lightning_sac.dryrun.cuda.trace import AllocatorPeak, simulate

KiB, MiB = 1 << 10, 1 << 20
DEFAULT, EXPANDABLE = AllocatorConfig(), AllocatorConfig(expandable_segments=True)


def replay(sizes: Sequence[int], frees: Sequence[int] = (), config: AllocatorConfig = DEFAULT):
    """Allocate ``sizes`` under keys 0, 1, ... then free the keys in ``frees``."""
    model = CachingAllocatorModel(config)
    for key, nbytes in enumerate(sizes):
        model.malloc(key, nbytes)
    for key in frees:
        model.free(key)
    return model


def test_requests_round_up_to_512_bytes_and_zero_allocates_nothing():
    assert [round_size(n) for n in (0, 1, 511, 512, 513, 1024, 1025)] == [0, 512, 512, 512, 1024, 1024, 1536]
    model = replay([1, 513, 0])
    assert (model.allocated, model.reserved, model.segments) == (512 + 1024, 2 * MiB, 1)
    model.free(2)  # the zero-byte "allocation" frees without touching the counts
    assert model.allocated == 1536


def test_segment_sizes_by_pool():
    # small pool: 2 MiB; large under 10 MiB: 20 MiB; from 10 MiB: rounded up to 2 MiB
    sizes = [1, 100 * KiB, MiB, MiB + 1, 10 * MiB - 512, 10 * MiB, 12 * MiB + 100 * KiB, 50 * MiB + 1]
    expected = [2, 2, 2, 20, 20, 10, 14, 52]
    assert [segment_bytes(n) for n in sizes] == [e * MiB for e in expected]
    assert segment_bytes(0) == 0
    # with expandable segments: pages of 2 MiB (small pool) and 20 MiB (large pool)
    assert [segment_bytes(n, EXPANDABLE) for n in (100 * KiB, 3 * MiB, 12 * MiB, 50 * MiB)] == [
        2 * MiB,
        20 * MiB,
        20 * MiB,
        60 * MiB,
    ]


def test_small_requests_share_a_2_mib_segment():
    model = replay([100 * KiB])
    assert (model.allocated, model.reserved) == (100 * KiB, 2 * MiB)
    model.malloc(1, 100 * KiB)
    assert (model.allocated, model.reserved, model.segments) == (200 * KiB, 2 * MiB, 1)
    # 6 blocks of 300 KiB fill 1 843 200 of 2 097 152 bytes; the 7th needs a second segment
    model = replay([300 * KiB] * 7)
    assert (model.reserved, model.segments) == (4 * MiB, 2)


def test_a_3_mib_request_reserves_20_mib_and_the_next_5_mib_share_it():
    model = replay([3 * MiB])
    assert (model.allocated, model.reserved) == (3 * MiB, 20 * MiB)
    model.malloc(1, 5 * MiB)
    assert (model.allocated, model.reserved, model.segments) == (8 * MiB, 20 * MiB, 1)


def test_large_requests_get_a_segment_rounded_to_2_mib():
    model = replay([12 * MiB + 100 * KiB])  # 1 994 752 bytes remain: more than 1 MiB, so the block is split
    assert (model.allocated, model.reserved) == (12 * MiB + 100 * KiB, 14 * MiB)
    model.malloc(1, MiB + 512)  # the remainder serves the next large request
    assert model.reserved == 14 * MiB


def test_an_unsplit_block_counts_whole_in_allocated():
    # 13.5 MiB in a 14 MiB segment leaves 0.5 MiB, not more than 1 MiB: the whole 14 MiB block is handed out
    model = replay([13 * MiB + 512 * KiB])
    assert (model.allocated, model.reserved) == (14 * MiB, 14 * MiB)
    model.free(0)
    assert model.allocated == 0 and model.peak_allocated == 14 * MiB


def test_best_fit_takes_the_smallest_free_block_that_holds_the_request():
    # one 20 MiB segment: a[0,4) s[4,6) b[6,9) t[9,11), free tail [11,20); free a and b -> free blocks of 4, 3, 9 MiB
    model = replay([4 * MiB, 2 * MiB, 3 * MiB, 2 * MiB], frees=[0, 2])
    assert (model.allocated, model.reserved) == (4 * MiB, 20 * MiB)
    # 2.5 MiB: best fit is b's 3 MiB block, whose 0.5 MiB rest is not split off -> allocated grows by 3 MiB
    # (the 4 MiB or 9 MiB block would have been split, growing allocated by 2.5 MiB)
    model.malloc(10, 2 * MiB + 512 * KiB)
    assert model.allocated == 7 * MiB
    model.malloc(11, 9 * MiB)  # the tail is still whole
    assert (model.allocated, model.reserved) == (16 * MiB, 20 * MiB)


def test_freed_neighbours_merge_so_a_larger_request_reuses_them():
    model = replay([5 * MiB] * 4)  # fills one 20 MiB segment exactly
    assert (model.allocated, model.reserved) == (20 * MiB, 20 * MiB)
    model.free(2)
    model.free(1)  # merges with its free right neighbour into 10 MiB
    model.malloc(10, 10 * MiB)  # a fresh 10 MiB request would reserve a 10 MiB segment
    assert (model.allocated, model.reserved, model.segments) == (20 * MiB, 20 * MiB, 1)
    for key in (0, 10, 3):  # left, middle, right: all three merge into the whole segment again
        model.free(key)
    model.malloc(11, 20 * MiB)
    assert (model.allocated, model.reserved, model.segments) == (20 * MiB, 20 * MiB, 1)


def test_fragmentation_makes_reserved_exceed_allocated():
    # A B A B of 5 MiB fill a 20 MiB segment; freeing the A's leaves 10 MiB free in two 5 MiB holes,
    # so an 8 MiB request needs a new 20 MiB segment
    model = replay([5 * MiB] * 4, frees=[0, 2])
    model.malloc(10, 8 * MiB)
    assert (model.allocated, model.reserved, model.segments) == (18 * MiB, 40 * MiB, 2)
    assert (model.peak_allocated, model.peak_reserved) == (20 * MiB, 40 * MiB)


def test_expandable_segments_map_pages_for_the_address_high_water_mark():
    # 50, 50, free both, 60 MiB: separate segments cannot merge -> 50 + 50 + 60 reserved
    events = [("malloc", 0, 50 * MiB), ("malloc", 1, 50 * MiB), ("free", 0, 0), ("free", 1, 0), ("malloc", 2, 60 * MiB)]
    assert simulate(events) == AllocatorPeak(allocated=100 * MiB, reserved=160 * MiB)
    # one growing segment: 60 MiB mapped for the first, 40 more for the second, and the 60 MiB fit in the 100 freed
    assert simulate(events, EXPANDABLE) == AllocatorPeak(allocated=100 * MiB, reserved=100 * MiB)
    # small pool, 2 MiB pages: 13 x 300 KiB = 3 993 600 bytes -> 2 pages, where 2 MiB segments hold 6 each -> 3
    assert replay([300 * KiB] * 13).reserved == 6 * MiB
    assert replay([300 * KiB] * 13, config=EXPANDABLE).reserved == 4 * MiB


def test_expandable_segments_keep_holes():
    # A B A B of 5 MiB in the first 20 MiB page; the 8 MiB request fits neither 5 MiB hole and maps a second page
    model = replay([5 * MiB] * 4, frees=[0, 2], config=EXPANDABLE)
    model.malloc(10, 8 * MiB)
    assert (model.allocated, model.reserved, model.segments) == (18 * MiB, 40 * MiB, 1)
    # the rest of the second page, [28, 40) MiB, serves 12 MiB without mapping more
    model.malloc(11, 12 * MiB)
    assert (model.allocated, model.reserved) == (30 * MiB, 40 * MiB)


def test_expandable_best_fit_takes_the_block_bordering_unmapped_space_last():
    # x[0,4) y[4,14) z[14,16), free end [16,20); freeing y leaves a 10 MiB hole and the 4 MiB end block
    model = replay([4 * MiB, 10 * MiB, 2 * MiB], frees=[1], config=EXPANDABLE)
    # 3 MiB fits the 4 MiB end block best by size, but torch ranks it by what it could grow to: the hole is taken
    model.malloc(10, 3 * MiB)
    assert model.reserved == 20 * MiB
    # the hole has 7 MiB left, the end block 4 MiB: 7.5 MiB grows the end block by a 20 MiB page
    model.malloc(11, 7 * MiB + 512 * KiB)
    assert (model.allocated, model.reserved) == (16 * MiB + 512 * KiB, 40 * MiB)


def test_max_split_size_keeps_large_blocks_whole():
    config = AllocatorConfig.from_env("max_split_size_mb:40")
    assert config.max_split_size == 40 * MiB
    # a 12 MiB request may not take a cached 50 MiB block (>= 40 MiB): a new 12 MiB segment
    assert replay([50 * MiB], frees=[0]).reserved == 50 * MiB
    model = replay([50 * MiB], frees=[0], config=config)
    model.malloc(1, 12 * MiB)
    assert (model.allocated, model.reserved) == (12 * MiB, 62 * MiB)
    # a request of 40 MiB or more takes a block less than 20 MiB larger, whole (not split)
    model = replay([70 * MiB], frees=[0], config=config)
    model.malloc(1, 60 * MiB)
    assert (model.allocated, model.reserved) == (70 * MiB, 70 * MiB)
    model.free(1)
    model.malloc(2, 45 * MiB)  # 70 >= 45 + 20: refused, a new 46 MiB segment
    assert (model.allocated, model.reserved) == (46 * MiB, 116 * MiB)


def test_roundup_power2_divisions():
    four = AllocatorConfig.from_env("roundup_power2_divisions:4")
    assert round_size(5 * MiB + 1, four) == 6 * MiB  # between 4 and 8 MiB in steps of 1 MiB
    assert round_size(4 * MiB, four) == 4 * MiB
    assert round_size(1200, four) == 1536  # not above 512 * 4 bytes: plain 512-byte rounding
    table = AllocatorConfig.from_env("roundup_power2_divisions:[64:8,>:2]")
    assert table.roundup_power2_divisions == (8,) * 7 + (2,) * 9
    assert round_size(100 * MiB, table) == 104 * MiB  # [64, 128) MiB in 8 steps of 8 MiB
    assert round_size(200 * MiB, table) == 256 * MiB  # [128, 256) MiB in 2 steps of 64 MiB
    assert round_size(3 * MiB + 1, table) == 3 * MiB + 256 * KiB  # [2, 4) MiB in 8 steps of 256 KiB


def test_from_env_parses_what_torch_accepts():
    assert AllocatorConfig.from_env(None) == AllocatorConfig() == AllocatorConfig.from_env("")
    value = " expandable_segments : True, max_split_size_mb:64,pinned_use_background_threads:True,"
    config = AllocatorConfig.from_env(value)  # whitespace and a trailing comma are accepted, as by torch
    assert config == AllocatorConfig(expandable_segments=True, max_split_size=64 * MiB)
    assert AllocatorConfig.from_env("expandable_segments:False,garbage_collection_threshold:0.6,foo:bar") == (
        AllocatorConfig()
    )
    assert AllocatorConfig.from_env("max_non_split_rounding_mb:30").max_non_split_rounding == 30 * MiB
    assert AllocatorConfig.from_env("backend:cudaMallocAsync").backend == "cudaMallocAsync"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("expandable_segments:yes", "expandable_segments expects True or False, got 'yes'"),
        ("max_split_size_mb:10", "max_split_size_mb expects a whole number of MB >= 20, got '10'"),
        ("max_split_size_mb:1.5", "max_split_size_mb expects a whole number of MB >= 20, got '1.5'"),
        ("roundup_power2_divisions:3", "roundup_power2_divisions expects a power of 2"),
        ("roundup_power2_divisions:[64:3]", "divisions that are 0 or a power of 2, got '3'"),
        ("expandable_segments", "expected 'key:value' options separated by commas"),
        ("expandable_segments:True;max_split_size_mb:64", "expected 'key:value' options separated by commas"),
    ],
)
def test_from_env_errors_say_what_was_expected(value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(".", r"\.")):
        AllocatorConfig.from_env(value)


def test_misuse_is_refused():
    with pytest.raises(ValueError, match="models torch's native allocator, got backend:cudaMallocAsync"):
        CachingAllocatorModel(AllocatorConfig(backend="cudaMallocAsync"))
    model = replay([MiB])
    with pytest.raises(ValueError, match="key 0 is still allocated"):
        model.malloc(0, MiB)
    model.free(0)
    with pytest.raises(KeyError, match="key 0 is not allocated"):
        model.free(0)
    with pytest.raises(ValueError, match="expected an event 'malloc' or 'free', got 'alloc'"):
        simulate([("alloc", 0, 1)])
