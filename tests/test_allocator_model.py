"""The caching allocator model's rules on hand-built sequences, and the fragmentation a plan's reserve carries.

Each sequence's bytes follow from one rule of torch's ``c10/cuda/CUDACachingAllocator.cpp``, named in a comment by
its function. The last tests plan a small GPT for an H100 on this machine: the reserve holds the planned step's
fragmentation, replayed from the dry run's allocations as the plan changes them, not the unplanned step's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_sac import profile_model, solve_plan
from lightning_sac.demos.models import GPT, GPTConfig
from lightning_sac.dryrun import needed_reserved, replay
from lightning_sac.dryrun.cuda.allocator import AllocatorConfig, CachingAllocatorModel, OutOfMemory, round_size
from lightning_sac.plan import StepFragmentation, device_reserve, planned_trace

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT, EXPANDABLE = AllocatorConfig(), AllocatorConfig(expandable_segments=True)


def model_after(sizes: dict[int, int], frees: tuple[int, ...] = (), config=DEFAULT, capacity=None):
    """Allocate ``sizes`` (key -> bytes) in order, then free ``frees``."""
    model = CachingAllocatorModel(config, capacity)
    for key, nbytes in sizes.items():
        model.malloc(key, nbytes)
    for key in frees:
        model.free(key)
    return model


def test_small_and_large_requests_round_and_reserve_by_pool():
    # round_size: up to a multiple of kMinBlockSize (512 bytes).
    assert [round_size(n) for n in (1, 512, 513, MiB + 1)] == [512, 512, 1024, MiB + 512]
    # get_pool / get_allocation_size: up to kSmallSize (1 MiB) the small pool, packed in kSmallBuffer (2 MiB) segments.
    # 512 bytes and two blocks of 700 KiB share one 2 MiB segment; a third 700 KiB needs another.
    small = model_after({0: 1, 1: 700 * KiB, 2: 700 * KiB, 3: 700 * KiB})
    assert (small.allocated, small.reserved, small.segments) == (512 + 2100 * KiB, 4 * MiB, 2)
    # get_allocation_size: a large request under kMinLargeAlloc (10 MiB) gets a kLargeBuffer (20 MiB) segment that
    # the next ones share; from 10 MiB the request rounded up to kRoundLarge (2 MiB).
    large = model_after({0: MiB + 1, 1: 9 * MiB, 2: 10 * MiB, 3: 12 * MiB + 100 * KiB})
    assert large.reserved == 20 * MiB + 10 * MiB + 14 * MiB and large.segments == 3


def test_a_freed_832_mib_block_is_split_for_a_256_mib_request():
    # get_free_block: best fit takes the cached 832 MiB segment; should_split: large pool, the rest (576 MiB) is more
    # than kSmallSize, so it is split off and serves a 576 MiB request with no new segment.
    model = model_after({0: 832 * MiB}, frees=(0,))
    model.malloc(1, 256 * MiB)
    assert (model.allocated, model.reserved) == (256 * MiB, 832 * MiB)
    model.malloc(2, 576 * MiB)
    assert (model.allocated, model.reserved, model.segments) == (832 * MiB, 832 * MiB, 1)
    # should_split: a rest of kSmallSize or less stays with the block, and allocated counts the whole block
    # (alloc_found_block adds block->size): 20 MiB for a 19.5 MiB request in a freed 3 MiB request's segment.
    whole = model_after({0: 3 * MiB}, frees=(0,))
    whole.malloc(1, 19 * MiB + 512 * KiB)
    assert (whole.allocated, whole.reserved) == (20 * MiB, 20 * MiB)


def test_max_split_size_keeps_oversize_blocks_whole():
    config = AllocatorConfig.from_env("max_split_size_mb:200")
    # get_free_block: a request under max_split_size never takes a block of that size or more; a request of that
    # size or more takes one only when it is less than kLargeBuffer larger (should_split: never split).
    for request, reserved in ((100 * MiB, 932 * MiB), (256 * MiB, 1088 * MiB), (820 * MiB, 832 * MiB)):
        model = model_after({0: 832 * MiB}, frees=(0,), config=config)
        model.malloc(1, request)
        assert model.reserved == reserved
    assert model.allocated == 832 * MiB  # the 820 MiB request holds the whole 832 MiB block


def test_free_and_retry_releases_cached_segments_before_running_out():
    # malloc: alloc_block fails past the capacity; release_cached_blocks gives every free whole segment back and
    # alloc_block is retried: 600 MiB cached, 700 MiB asked, 1 GiB available.
    unbounded = model_after({0: 600 * MiB}, frees=(0,))
    unbounded.malloc(1, 700 * MiB)
    assert unbounded.reserved == 1300 * MiB
    capped = model_after({0: 600 * MiB}, frees=(0,), capacity=GiB)
    capped.malloc(1, 700 * MiB)
    assert (capped.reserved, capped.peak_reserved, capped.releases) == (700 * MiB, 700 * MiB, 1)
    # release_blocks frees only blocks that are a whole segment (no prev, no next): a split one stays, and the
    # request runs out of memory.
    split = model_after({0: 600 * MiB}, frees=(0,), capacity=GiB)
    split.malloc(1, 100 * MiB)
    with pytest.raises(OutOfMemory):
        split.malloc(2, 700 * MiB)
    # release_available_cached_blocks (with max_split_size only) first frees the smallest oversize segment that
    # covers the request: the 832 MiB one for 300 MiB, before anything else is released.
    config = AllocatorConfig.from_env("max_split_size_mb:200")
    oversize = model_after({0: 832 * MiB, 1: 50 * MiB}, frees=(0, 1), capacity=GiB, config=config)
    oversize.malloc(2, 300 * MiB)
    assert (oversize.reserved, oversize.releases) == (50 * MiB + 300 * MiB, 0)


def test_needed_reserved_is_the_least_capacity_the_step_runs_in():
    # 600 MiB freed, then 700 MiB: unbounded the allocator keeps both (1300 MiB); with the retry the step needs 700.
    events, sizes = [0, -1, 1, -2], [600 * MiB, 700 * MiB]
    assert replay(events, sizes).reserved == 1300 * MiB
    needed = needed_reserved(events, sizes)
    assert needed.tensors == 700 * MiB and 700 * MiB <= needed.reserved <= 700 * MiB + 2 * MiB
    with pytest.raises(OutOfMemory):
        replay(events, sizes, capacity=needed.reserved - 2 * MiB - 1)


def test_expandable_segments_map_pages_and_unmap_free_ones_under_pressure():
    # try_allocate_expandable_block: the large pool's segment grows by kLargeBuffer (20 MiB) pages; freed blocks
    # merge across what were two requests, so 60 MiB fits where two cudaMalloc'ed 50 MiB segments would not.
    model = model_after({0: 50 * MiB, 1: 50 * MiB}, frees=(0, 1), config=EXPANDABLE)
    model.malloc(2, 60 * MiB)
    assert (model.reserved, model.allocated) == (100 * MiB, 60 * MiB)
    # A (60 MiB) then B (40) map 100 MiB; A freed; C (70) fits no free block and would map 80 MiB more at the end.
    # release_cached_blocks -> unmap_block gives A's three free pages back, leaving a hole the 70 MiB does not fit
    # (find_expandable_block: B follows it), so C maps at the end: 40 + 80 MiB reserved within a 120 MiB capacity.
    sizes = {0: 60 * MiB, 1: 40 * MiB}
    unbounded = model_after(sizes, frees=(0,), config=EXPANDABLE)
    unbounded.malloc(2, 70 * MiB)
    assert unbounded.reserved == 180 * MiB
    capped = model_after(sizes, frees=(0,), config=EXPANDABLE, capacity=120 * MiB)
    capped.malloc(2, 70 * MiB)
    assert (capped.reserved, capped.peak_reserved, capped.releases) == (120 * MiB, 120 * MiB, 1)
    # find_expandable_block: the lowest unmapped range first, a hole before the end: after empty_cache
    # (release_cached_blocks) a 40 MiB request maps two of the hole's pages, not the end's.
    model = model_after(sizes, frees=(0,), config=EXPANDABLE)
    model.release_cached()
    assert model.reserved == 40 * MiB
    model.malloc(2, 40 * MiB)
    model.malloc(3, 20 * MiB)  # the hole's last page
    assert (model.reserved, model.peak_reserved) == (100 * MiB, 100 * MiB)


def test_the_dry_run_replays_under_the_users_allocator_settings(monkeypatch):
    # torch reads PYTORCH_ALLOC_CONF first, then the older PYTORCH_CUDA_ALLOC_CONF; the trace keeps what it read.
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 4000), nn.ReLU(), nn.Linear(4000, 256))
    profile = profile_model(model, (torch.randn(1500, 256),), optimizer_factory=torch.optim.AdamW, device="H100-SXM")
    trace = profile.allocations
    assert trace.alloc_conf == "expandable_segments:True" and trace.config == EXPANDABLE
    # One growing segment per pool: 102 MiB reserved for 97.5 MiB of tensors, where segments would hold 114 MiB.
    assert profile.reserved_peak_bytes == replay(trace.events, trace.sizes, EXPANDABLE).reserved == 102 * MiB
    assert replay(trace.events, trace.sizes).reserved == 114 * MiB


def _gpt_h100_profile():
    # Small enough to profile in seconds, activation-heavy enough that a plan reaches a quarter of its peak.
    config = GPTConfig(vocab_size=512, block_size=512, n_layer=8, n_head=4, n_embd=128)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (24, 512))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), idx.flatten())

    return profile_model(model, (idx,), loss_fn=loss_fn, optimizer_factory=torch.optim.AdamW, device="H100-SXM")


def test_the_reserve_of_a_plan_carries_the_planned_steps_fragmentation():
    profile = _gpt_h100_profile()
    trace = profile.allocations
    # The profile's own figure is the replay of its trace: the unplanned step's fragmentation.
    plain = replay(trace.events, trace.sizes, trace.config)
    assert (plain.tensors, plain.reserved) == (profile.peak_bytes, profile.reserved_peak_bytes)
    fragmentation = StepFragmentation(profile)
    assert fragmentation({}) == profile.reserved_peak_bytes - profile.peak_bytes
    base = device_reserve(profile, fragmentation_bytes=0).total
    budget = base + profile.peak_bytes // 4  # the tensors get a quarter of the unplanned peak, less fragmentation
    plan = solve_plan(profile, budget / GiB)
    # Without the device's memory running out the allocator keeps its cached segments: the unbounded replay's.
    device_room = int(profile.device.memory_gib * GiB) - base
    own = fragmentation(plan.decisions, device_room - plan.predicted_peak_bytes)
    assert own == fragmentation(plan.decisions)
    assert plan.decisions and plan.reserve["fragmentation_bytes"] == own != fragmentation({})
    assert plan.predicted_peak_bytes + sum(plan.reserve.values()) <= plan.budget_bytes
    # The planned trace frees what the plan discards after each forward and makes it again in backward: its
    # tensors' peak is the solver's prediction to within a few percent (the trace frees at each module's end what
    # the solver's memory model frees there, and its recompute holds what recompute_transient counts).
    events, sizes = planned_trace(profile, plan.decisions)
    assert replay(events, sizes).tensors == pytest.approx(plan.predicted_peak_bytes, rel=0.05)
    assert replay(events, sizes).tensors < profile.peak_bytes / 3
