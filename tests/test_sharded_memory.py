"""The sharded memory model (issue "FSDP"): FSDP units read from the model, and one rank's bytes by hand.

The units come from a real ``fully_shard`` over a fake process group of 4 ranks (torch's ``fake`` backend: no
other process, no communication), so their shard sizes are FSDP's own, padding included. The step's timeline is
written by hand, so every expected byte count below is arithmetic on the numbers in this file.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from conftest import fake_ranks
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from lightning_sac.devices import get_device_spec
from lightning_sac.dryrun.data import ModelProfile, TimelineEvent
from lightning_sac.sharding import FSDPUnit, ShardedLayout, sharded_layout
from lightning_sac.solver.sharded_memory import ShardedStep

F32 = 4


@pytest.fixture
def four_ranks() -> Iterator[None]:
    with fake_ranks(4):
        yield


def two_units() -> nn.Module:
    """``a = Linear(6, 5)`` and ``b = Linear(5, 3)``, each its own FSDP unit (no root unit: no other params)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))


def test_units_are_read_from_fully_shard_with_fsdp_padding(four_ranks: None) -> None:
    model = two_units()
    fully_shard(model[0])
    fully_shard(model[1])
    layout = sharded_layout(model)
    assert layout is not None and layout.kind == "fsdp2" and layout.world_size == 4
    a, b = layout.units
    # a: weight 5x6 and bias 5 shard dim 0 over 4 ranks in chunks of ceil(5/4) = 2 rows, padded to 4 x 2 = 8 rows.
    assert (a.fqn, a.shard_bytes, a.param_bytes, a.gathered_bytes) == ("0", (2 * 6 + 2) * F32, 35 * F32, 35 * F32)
    assert a.buffer_bytes == 4 * (2 * 6 + 2) * F32  # the all-gather output: every rank's padded shard
    assert (a.grad_bytes, a.grad_shard_bytes) == (35 * F32, (2 * 6 + 2) * F32)
    # b: weight 3x5 and bias 3: chunks of 1 row.
    assert (b.fqn, b.shard_bytes, b.param_bytes, b.buffer_bytes) == ("1", (5 + 1) * F32, 18 * F32, 4 * 6 * F32)
    # Two sibling units are each a root of their own forward (FSDP2 makes the first unit called a root): a root
    # keeps its parameters gathered from forward to backward.
    assert not a.reshard_after_forward and not b.reshard_after_forward
    assert a.backward_prefetch is None and a.forward_prefetch == []  # FSDP2's defaults


def test_a_model_sharded_under_a_root_and_explicit_prefetch(four_ranks: None) -> None:
    model = nn.Sequential(two_units(), nn.Linear(3, 2))
    fully_shard(model[0][0])
    fully_shard(model[0][1])
    fully_shard(model)
    model[0][0].set_modules_to_forward_prefetch([model[0][1]])
    layout = sharded_layout(model)
    assert layout is not None
    by_fqn = {u.fqn: u for u in layout.units}
    assert list(by_fqn) == ["", "0.0", "0.1"]
    assert not by_fqn[""].reshard_after_forward  # the root
    assert by_fqn["0.0"].reshard_after_forward and by_fqn["0.1"].reshard_after_forward
    assert by_fqn["0.0"].forward_prefetch == ["0.1"]
    assert by_fqn[""].shard_bytes == (1 * 3 + 1) * F32  # Linear(3, 2): 2 rows in chunks of 1


# A hand-written step of the two units a ("0") and b ("1"): (kind, name, bytes by category at the event).
A = FSDPUnit("0", 56, 140, 224, 140, 56, 140, reshard_after_forward=True)
B = FSDPUnit("1", 24, 72, 96, 72, 24, 72, reshard_after_forward=True)
P, OPT = 140 + 72, 2 * (140 + 72)  # parameters and AdamW's two states, unsharded
EVENTS = [
    ("phase", "forward", {"parameter": P, "gradient": P, "optimizer_state": OPT}),  # 0
    ("fwd_pre", "0", {"parameter": P, "gradient": P, "optimizer_state": OPT}),  # 1
    ("fwd_post", "0", {"parameter": P, "gradient": P, "optimizer_state": OPT, "activation": 100}),  # 2
    ("fwd_pre", "1", {"parameter": P, "gradient": P, "optimizer_state": OPT, "activation": 100}),  # 3
    ("fwd_post", "1", {"parameter": P, "gradient": P, "optimizer_state": OPT, "activation": 150}),  # 4
    ("phase", "backward", {"parameter": P, "optimizer_state": OPT, "activation": 150}),  # 5
    ("bwd_pre", "1", {"parameter": P, "optimizer_state": OPT, "activation": 150}),  # 6
    ("bwd_post", "1", {"parameter": P, "gradient": 72, "optimizer_state": OPT, "activation": 120}),  # 7
    ("bwd_pre", "0", {"parameter": P, "gradient": 72, "optimizer_state": OPT, "activation": 100}),  # 8
    ("bwd_post", "0", {"parameter": P, "gradient": P, "optimizer_state": OPT}),  # 9
    ("phase", "optimizer", {"parameter": P, "gradient": P, "optimizer_state": OPT}),  # 10
]


def step(*units: FSDPUnit) -> ShardedStep:
    timeline = [TimelineEvent(kind=kind, name=name, at=dict(at), peak_after=dict(at)) for kind, name, at in EVENTS]
    profile = ModelProfile(device=get_device_spec("cpu"), estimate="roofline", modules={}, timeline=timeline)
    return ShardedStep(profile, ShardedLayout("fsdp2", 4, list(units)))


def at(model: ShardedStep, k: int, moment: bool = False) -> int:
    return model.bytes_at(k, dict(EVENTS[k][2]), moment=moment)


SHARDS = 56 + 24
OPT_SHARDS = round(OPT * SHARDS / P)  # AdamW's state is created from the shards: 2 x 80 = 160


def test_bytes_at_each_moment_with_fsdp2_default_backward_prefetch() -> None:
    fsdp = step(A, B)
    assert OPT_SHARDS == 160
    # a and b are sibling units, each the root of its own forward. FSDP2 keeps a unit's flat all-gather buffer (a:
    # 224, b: 96) after copying its parameters out in forward, until the next unit's copy-out or the end of a
    # root's forward (FSDPState._post_forward); in backward it frees it at the copy-out. At the moment of a gather
    # the previous buffer may still be alive beside the new one.
    # Forward, in a's forward: a gathered (140), every gradient shard of the last step (56 + 24), a's buffer.
    assert at(fsdp, 1) == at(fsdp, 1, moment=True) == SHARDS + 140 + OPT_SHARDS + 80 + 224
    assert at(fsdp, 2) == 100 + SHARDS + 140 + OPT_SHARDS + 80  # a's forward ends: a root's, so its buffer goes
    # b's forward: a resharded, b gathered with its buffer; nothing of a's is left at the moment b is gathered.
    assert at(fsdp, 3) == at(fsdp, 3, moment=True) == 100 + SHARDS + 72 + OPT_SHARDS + 80 + 96
    # Backward begins with gradients set to None. b's backward starts: b gathered, and a's all-gather issued with
    # it (default prefetch: the unit whose forward ended just before b's), whose parameters are copied out only
    # when a's own backward begins. No gradient exists yet at this event: each is made as backward reaches it.
    assert at(fsdp, 6) == 150 + SHARDS + 72 + OPT_SHARDS + 224  # the larger of the two buffers issued here
    assert at(fsdp, 6, moment=True) == 150 + SHARDS + 72 + OPT_SHARDS + 96 + 224  # both gathers
    # b's backward ends: its gradients (72) and the reduce-scatter's input (72); a not copied out yet.
    assert at(fsdp, 7) == 120 + SHARDS + 72 + OPT_SHARDS + 2 * 72 + 224
    # a's backward: a copied out (140), b's gradient shard (24); a's own gradients come as its backward runs.
    assert at(fsdp, 8) == 100 + SHARDS + 140 + OPT_SHARDS + 24 + 224
    # The optimizer step: every gradient shard, nothing gathered, the last buffer freed.
    assert at(fsdp, 10) == SHARDS + OPT_SHARDS + 80


def test_bytes_at_each_moment_without_backward_prefetch() -> None:
    fsdp = step(
        FSDPUnit(**{**A.__dict__, "backward_prefetch": []}), FSDPUnit(**{**B.__dict__, "backward_prefetch": []})
    )
    # b's backward gathers b alone; a is gathered when its own backward begins.
    assert at(fsdp, 6) == at(fsdp, 6, moment=True) == 150 + SHARDS + 72 + OPT_SHARDS + 96
    assert at(fsdp, 7) == 120 + SHARDS + 72 + OPT_SHARDS + 2 * 72 + 96
    assert at(fsdp, 8, moment=True) == 100 + SHARDS + 140 + OPT_SHARDS + 24 + 224 + 96


def test_explicit_forward_prefetch_gathers_the_next_unit_early() -> None:
    fsdp = step(FSDPUnit(**{**A.__dict__, "forward_prefetch": ["1"]}), B)
    # a's forward issues b's all-gather too (both buffers at event 1); b's parameters are copied out at b's forward.
    assert at(fsdp, 1) == SHARDS + 140 + OPT_SHARDS + 80 + 224
    assert at(fsdp, 1, moment=True) == SHARDS + 140 + OPT_SHARDS + 80 + 224 + 96
    # a's forward ends (a root's): b's issued buffer stays, its group holds it until b copies out.
    assert at(fsdp, 2) == 100 + SHARDS + 140 + OPT_SHARDS + 80 + 96
    assert at(fsdp, 3, moment=True) == at(fsdp, 3) == 100 + SHARDS + 72 + OPT_SHARDS + 80 + 96  # no gather at b


def test_a_checkpoint_containing_units_keeps_them_gathered_after_its_recompute() -> None:
    # A checkpoint of the whole model ("") recomputes a and b when its backward begins, before b's: FSDP does not
    # reshard after a recompute, so each stays gathered until its own backward ends.
    events = [TimelineEvent(kind=k, name=n, at=dict(a), peak_after=dict(a)) for k, n, a in EVENTS]
    events.insert(6, TimelineEvent(kind="bwd_pre", name="", at=dict(EVENTS[5][2]), peak_after=dict(EVENTS[5][2])))
    # Now: 6 the root's backward begins, 7 b's, 8 b's ends, 9 a's begins, 10 a's ends.
    profile = ModelProfile(device=get_device_spec("cpu"), estimate="roofline", modules={}, timeline=events)
    fsdp = ShardedStep(profile, ShardedLayout("fsdp2", 4, [A, B]))
    assert fsdp.recompute_gathers("", 5) == 0  # before its backward
    assert fsdp.recompute_gathers("", 6) == 140 + 72  # FSDP gathers neither yet; the recompute gathers both
    # b's backward gathers b and issues a's all-gather, but a's parameters come out of it only at a's backward:
    # until then the recompute holds a gathered beyond the plain step.
    assert fsdp.recompute_gathers("", 7) == 140
    unprefetched = ShardedStep(
        profile, ShardedLayout("fsdp2", 4, [FSDPUnit(**{**u.__dict__, "backward_prefetch": []}) for u in (A, B)])
    )
    assert unprefetched.recompute_gathers("", 7) == unprefetched.recompute_gathers("", 8) == 140  # a, early
    assert unprefetched.recompute_gathers("", 9) == 0  # a's own backward gathers it
    assert unprefetched.recompute_gathers("1", 7) == 0  # a unit's own recompute gathers nothing more


def test_offloaded_units_are_read_from_the_offload_policy(four_ranks: None) -> None:
    model = two_units()
    fully_shard(model[0], offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model[1])
    layout = sharded_layout(model)
    assert layout is not None
    assert [u.offload for u in layout.units] == [True, False]


def test_fsdp1_offload_is_read_from_its_cpu_offload(four_ranks: None) -> None:
    from torch.distributed.fsdp import CPUOffload
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = two_units()
    wrapped = FSDP(model, cpu_offload=CPUOffload(offload_params=True), device_id=torch.device("cpu"))
    layout = sharded_layout(model, wrapper=wrapped)
    assert layout is not None and layout.kind == "fsdp1"
    # One flat parameter of 35 + 18 = 53 elements, padded to 56 and sharded over 4 ranks: 14 floats on each.
    assert [(u.fqn, u.offload, u.shard_bytes) for u in layout.units] == [("", True, 14 * F32)]


def offloaded(unit: FSDPUnit) -> FSDPUnit:
    return FSDPUnit(**{**unit.__dict__, "offload": True})


def test_an_offloaded_unit_holds_on_the_device_only_what_it_gathers() -> None:
    fsdp = step(offloaded(A), B)
    # a's shards (56 of parameters, 56 of gradients) and their AdamW state (2 x 56) are on the host; b's (24, 24,
    # 2 x 24) stay. Each figure below is its test_bytes_at_each_moment_with_fsdp2_default_backward_prefetch twin
    # less a's 56 + 112 (and a's gradient shard where one exists).
    plain = step(A, B)
    b_opt = round(OPT * 24 / P)
    assert b_opt == 48
    # a's forward: a gathered and its buffer, b's shard, b's gradient shard and state. At the moment of a's
    # all-gather, its shard copied to the device (56) is alive too.
    assert at(fsdp, 1) == 24 + 140 + b_opt + 24 + 224 == at(plain, 1) - 56 - 112 - 56
    assert at(fsdp, 1, moment=True) == at(fsdp, 1) + 56
    assert at(fsdp, 3) == 100 + 24 + 72 + b_opt + 24 + 96  # b's own gather: no copy of an offloaded shard
    assert at(fsdp, 3, moment=True) == at(fsdp, 3)
    # b's backward issues a's gather too (prefetch): a's shard copy at that moment, beside both buffers.
    assert at(fsdp, 6, moment=True) == 150 + 24 + 72 + b_opt + 96 + 224 + 56
    # a's backward ends: its gradients, the reduce-scatter's input, and its new gradient shard (56), on the device
    # until it is copied to the host (the plain step counts a's gradient shard only after its backward).
    assert at(fsdp, 9) == at(plain, 9) - 56 - 112 + 56
    # The optimizer step: b's shard, state and gradient shard alone.
    assert at(fsdp, 10) == 24 + b_opt + 24 == at(plain, 10) - 56 - 112 - 56


def test_the_optimizer_steps_the_shards_where_they_are() -> None:
    # The optimizer's temporaries (here 212 bytes in the unsharded profile, as a foreach step makes one per
    # parameter) are made for the shards it steps: 80 of the 212 parameter bytes on this rank, none on the device
    # when every unit is offloaded to the host.
    snapshot = {**EVENTS[10][2], "temporary": 212}
    assert step(A, B).bytes_at(10, snapshot) == SHARDS + OPT_SHARDS + 80 + 80
    assert step(offloaded(A), offloaded(B)).bytes_at(10, snapshot) == 0
    assert step(offloaded(A), B).bytes_at(10, snapshot) == 24 + round(OPT * 24 / P) + 24 + 24


def test_offload_moves_nothing_on_a_cpu_device(four_ranks: None) -> None:
    # Why the strategy matrix has no measured offload cell: on a CPU device, FSDP2's copy of an offloaded shard to
    # the device (FSDPParam.all_gather_inputs, ``.to(device)``) is the shard itself, so a CPU run holds the same
    # bytes with offload as without, and cannot measure what offload takes off a GPU.
    model = two_units()
    fully_shard(model[0], offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model)
    model(torch.randn(2, 6)).sum().backward()
    params = model[0]._get_fsdp_state()._fsdp_param_group.fsdp_params
    assert params and all(p.offload_to_cpu for p in params)
    for p in params:
        assert p.all_gather_inputs[0].untyped_storage().data_ptr() == p._sharded_param_data.untyped_storage().data_ptr()


def test_reshard_after_forward_to_fewer_ranks_keeps_a_share(four_ranks: None) -> None:
    model = nn.Sequential(two_units(), nn.Linear(3, 2))
    fully_shard(model[0][0], reshard_after_forward=2)
    fully_shard(model[0][1], reshard_after_forward=4)  # the whole shard group: the same as True
    fully_shard(model)
    by_fqn = {u.fqn: u for u in sharded_layout(model).units}
    # a's all-gather output (4 ranks x 14 padded elements x 4 bytes = 224) resharded over 2 ranks: 112 kept.
    assert by_fqn["0.0"].reshard_after_forward and by_fqn["0.0"].post_forward_bytes == 224 // 2
    assert by_fqn["0.1"].reshard_after_forward and by_fqn["0.1"].post_forward_bytes == 0
    model(torch.randn(2, 6))  # FSDP's own post-forward shards, against the layout's figure
    kept = model[0][0]._get_fsdp_state()._fsdp_param_group.fsdp_params
    assert sum(p._sharded_post_forward_param_data.nbytes for p in kept) == 112


def test_a_unit_resharded_over_fewer_ranks_holds_its_share_until_its_backward() -> None:
    fsdp, plain = step(FSDPUnit(**{**A.__dict__, "post_forward_bytes": 112}), B), step(A, B)
    # a's forward ends at event 2 (still gathered there); its backward copies its parameters out at event 8.
    assert at(fsdp, 2) == at(plain, 2)
    assert [at(fsdp, k) - at(plain, k) for k in range(3, 8)] == [112] * 5
    assert at(fsdp, 8) == at(plain, 8)
