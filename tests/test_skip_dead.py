"""A SAC recompute skips the matrix products whose values nothing needs (:mod:`lightning_sac.apply.skip_dead`).

On a CPU, dropout draws its noise into ``empty_like(x)``: a GPT MLP's last matrix product is rerun by a plain
``torch.utils.checkpoint`` only for the noise's shape. Checked on Hugging Face GPT-2 with FLOPs counted by
torch's ``FlopCounterMode`` (exact, analytic), gradients and losses bit-equal to the plain model.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from conftest import adamw
from torch.utils.flop_counter import FlopCounterMode
from zoo import gpt2

from lightning_sac import profile_model, solve_plan
from lightning_sac.apply import apply_plan
from lightning_sac.apply.skip_dead import SkipDeadOps
from lightning_sac.dryrun.step import default_loss
from lightning_sac.plan.decisions import ModuleDecision, Plan
from lightning_sac.solver.recompute import recompute_costs, recompute_ms, recomputed_ops, skipped_ops

GIB = 2**30


@pytest.fixture(scope="module")
def family_and_profile():  # noqa: ANN201
    family = gpt2()  # dropout 0.1 in every block: F.dropout's empty_like + bernoulli_ on a CPU
    family.model.config.use_cache = False
    profile = profile_model(family.model, family.batch, optimizer_factory=adamw, device="cpu")
    return family, profile


def _blocks(profile):  # noqa: ANN001, ANN202
    return [f for f in profile.modules if f.count(".") == 2 and f.startswith("transformer.h.")]


def _whole_plan(profile, skip: bool) -> Plan:  # noqa: ANN001
    decisions = {}
    for f in _blocks(profile):
        stats = profile.modules[f].op_stats
        policy = [0] * len(stats.func_names)
        decisions[f] = ModuleDecision(
            discard_ratio=1.0,
            op_policy=policy,
            recompute_ms=0.0,
            freed_bytes=0,
            op_names=list(stats.func_names),
            skipped_ops=skipped_ops(stats, policy) if skip else [],
        )
    return Plan(decisions=decisions, budget_bytes=0)


def _step(model, batch) -> tuple[torch.Tensor, int]:  # noqa: ANN001
    """One forward and backward; the loss and the backward's FLOPs."""
    torch.manual_seed(3)  # the same dropout noise in every model
    loss = default_loss(model(**batch))
    with FlopCounterMode(display=False) as flops:
        loss.backward()
    return loss.detach(), flops.get_total_flops()


def test_a_full_recompute_of_a_gpt2_block_skips_the_mlp_projection_only_dropout_reads_the_shape_of(
    family_and_profile,
):
    family, profile = family_and_profile
    blocks = _blocks(profile)
    for f in blocks:
        stats = profile.modules[f].op_stats
        skipped = skipped_ops(stats, None)
        # One op per block: the MLP's c_proj (Conv1D: addmm). The attention's c_proj feeds the residual stream,
        # which ln_2 saves: needed.
        assert [stats.func_names[i] for i in skipped] == ["aten.addmm.default"]
        assert recompute_costs(stats)[skipped[0]] == 0.0
        assert recompute_costs(stats, "graph")[skipped[0]] == stats.runtimes[skipped[0]]
        policy = [0] * len(stats.func_names)
        assert skipped[0] not in recomputed_ops(stats, policy, "sac")
        assert recompute_ms(stats, policy, "sac") == pytest.approx(
            recompute_ms(stats, policy, "graph") - stats.runtimes[skipped[0]]
        )
    plain = copy.deepcopy(family.model)
    with_skip, without = copy.deepcopy(family.model), copy.deepcopy(family.model)
    handles = [apply_plan(with_skip, _whole_plan(profile, True)), apply_plan(without, _whole_plan(profile, False))]
    batch, config = family.batch, family.model.config
    tokens = batch["input_ids"].numel()
    # What c_proj's forward costs: (tokens x 4d) @ (4d x d), 2 FLOPs a multiply-add, per block.
    projection = 2 * tokens * (4 * config.n_embd) * config.n_embd
    for call in range(2):  # the first call of its kind runs under the policy, the second plainly
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loss, plain_flops = _step(plain, batch)
            loss_skip, flops_skip = _step(with_skip, batch)
            loss_without, flops_without = _step(without, batch)
        assert torch.equal(loss_skip, loss) and torch.equal(loss_without, loss)
        assert flops_without - flops_skip == len(blocks) * projection, call
        assert flops_skip > plain_flops  # everything else is still recomputed
        for p, q in zip(plain.parameters(), with_skip.parameters(), strict=True):
            assert torch.equal(q.grad, p.grad)
            p.grad = q.grad = None
        for m in (without,):
            m.zero_grad(set_to_none=True)
        assert all(w.last_skipper.skips == 1 for w in handles[0].wrappers.values())
        assert all(w.last_skipper is None for w in handles[1].wrappers.values())
        assert all(w.whole and w.mismatched_calls == 0 for w in handles[0].wrappers.values())


def test_selective_plans_skip_what_they_name_and_train_as_the_plain_model(family_and_profile):
    family, profile = family_and_profile
    plan = solve_plan(profile, 0.8 * profile.peak_bytes / GIB)
    selective = [f for f, d in plan.decisions.items() if any(d.op_policy) and d.skipped_ops]
    assert selective  # the plan has a selective module whose recompute skips something
    plain, planned = copy.deepcopy(family.model), copy.deepcopy(family.model)
    handle = apply_plan(planned, plan)
    for _ in range(2):
        loss, _ = _step(plain, family.batch)
        planned_loss, _ = _step(planned, family.batch)
        assert torch.equal(planned_loss, loss)
        for p, q in zip(plain.parameters(), planned.parameters(), strict=True):
            assert torch.equal(q.grad, p.grad)
            p.grad = q.grad = None
    for f, d in plan.decisions.items():
        wrapper = handle.wrappers[f]
        assert wrapper.mismatched_calls == 0
        if d.skipped_ops:
            assert wrapper.last_skipper.skips == len(d.skipped_ops), f


def test_a_skipped_op_gives_nan_so_a_wrong_skip_cannot_pass_and_another_code_path_skips_nothing():
    a, b, bias = torch.randn(3, 4), torch.randn(4, 5), torch.randn(5)
    names = ["aten.addmm.default", "aten.mm.default"]
    with SkipDeadOps(names, [0, 1], [0, 1]) as mode:
        skipped = torch.addmm(bias, a, b)
        also = a @ b
    assert skipped.shape == (3, 5) and skipped.stride() == (5, 1) and bool(skipped.isnan().all())
    assert bool(also.isnan().all()) and mode.skips == 2
    # The profile said mm first: the call diverged at its first op, so nothing is skipped from there on.
    with SkipDeadOps(list(reversed(names)), [0, 1], [0, 1]) as mode:
        ran = torch.addmm(bias, a, b)
        also = a @ b
    assert torch.equal(ran, torch.addmm(bias, a, b)) and torch.equal(also, a @ b)
    assert mode.diverged and mode.skips == 0


def test_a_plan_saved_before_skipping_existed_loads_and_skips_nothing(family_and_profile):
    family, profile = family_and_profile
    saved = json.loads(_whole_plan(profile, True).to_json())
    for d in saved["decisions"].values():
        del d["skipped_ops"]
    plan = Plan.from_json(json.dumps(saved))
    assert all(d.skipped_ops == [] for d in plan.decisions.values())
    model = copy.deepcopy(family.model)
    handle = apply_plan(model, plan)
    for _ in range(2):
        _step(model, family.batch)
    assert all(w.last_skipper is None for w in handle.wrappers.values())


def test_a_llama_layer_has_nothing_to_skip_and_its_recompute_is_torchs_early_stop():
    # Without dropout nothing reads a dead op's shape: the MLP's down_proj, whose output only the residual add
    # reads, comes after the layer's last saved tensor (its own input), where torch's checkpoint stops its
    # recompute. Our plain checkpoint of the layer runs exactly the recompute torch's does: FLOPs counted.
    from torch.utils.checkpoint import checkpoint
    from zoo import llama

    family = llama()
    model, batch, config = family.model, family.batch, family.model.config
    config.use_cache = False
    profile = profile_model(model, batch, optimizer_factory=adamw, device="cpu")
    layers = [f"model.layers.{i}" for i in range(config.num_hidden_layers)]
    decisions = {}
    for f in layers:
        stats = profile.modules[f].op_stats
        policy = [0] * len(stats.func_names)
        assert skipped_ops(stats, policy) == []
        decisions[f] = ModuleDecision(
            discard_ratio=1.0, op_policy=policy, recompute_ms=0.0, freed_bytes=0, op_names=list(stats.func_names)
        )
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    handle = apply_plan(ours, Plan(decisions=decisions, budget_bytes=0))
    for layer in theirs.model.layers:
        forward = layer.forward
        layer.forward = lambda *a, _f=forward, **k: checkpoint(_f, *a, use_reentrant=False, **k)
    with FlopCounterMode(display=False) as counted:
        default_loss(model(**batch))
    tokens, d, vocab = batch["input_ids"].numel(), config.hidden_size, config.vocab_size
    layer_forward = (counted.get_total_flops() - 2 * tokens * d * vocab) // len(layers)  # less the LM head
    down_proj = 2 * tokens * config.intermediate_size * d
    _, plain_flops = _step(model, batch)
    for call in range(2):  # the first call of its kind runs under the policy, the second plainly
        loss_ours, ours_flops = _step(ours, batch)
        loss_theirs, theirs_flops = _step(theirs, batch)
        assert torch.equal(loss_ours, loss_theirs), call
        assert ours_flops == theirs_flops == plain_flops + len(layers) * (layer_forward - down_proj), call
        ours.zero_grad(set_to_none=True)
        theirs.zero_grad(set_to_none=True)
    assert all(w.whole and w.mismatched_calls == 0 for w in handle.wrappers.values())


def test_the_peers_are_priced_with_the_dead_projection_torchs_checkpoint_reruns(family_and_profile):
    # Full AC and torchtitan's op-SAC run torch's checkpoint, which reruns the MLP projection only dropout reads the
    # shape of (FLOPs counted above): priced by our figures, each peer pays it, and our plan of the same blocks
    # whole (full AC's own choice, as the solver weighs it) does not.
    from lightning_sac.solver import peer_plans

    _, profile = family_and_profile
    peers = peer_plans(profile)
    full, titan = peers["full AC"], peers["torchtitan op-SAC"]
    blocks = _blocks(profile)
    assert sorted(full.decisions) == sorted(titan.decisions) == sorted(blocks)
    dead = 0.0
    for f in blocks:
        stats = profile.modules[f].op_stats
        (projection,) = skipped_ops(stats, None)
        everything = [0] * len(stats.func_names)
        assert full.decisions[f].skipped_ops == [] and titan.decisions[f].skipped_ops == []
        # Full AC reruns every op to the early stop, the projection with them: the graph backend's rerun here.
        assert full.decisions[f].recompute_ms == pytest.approx(recompute_ms(stats, everything, "graph"), abs=1e-9)
        assert titan.decisions[f].op_policy[projection] == 0  # torchtitan saves every other matmul: not this one
        dead += stats.runtimes[projection]
    assert dead > 0
    ours = solve_plan(profile, full.peak_bytes * 1.0075 / GIB)
    assert ours.predicted_peak_bytes <= full.peak_bytes * 1.0075
    added = ours.predicted_recompute_ms + ours.predicted_overhead_ms
    assert added <= full.added_ms - dead + 1e-9, (added, full.added_ms, dead)


def test_a_peers_dead_ops_cost_their_op_times_and_a_selective_policys_measured_rerun_share(family_and_profile):
    from lightning_sac.solver.decisions import _rerun_all

    _, profile = family_and_profile
    stats = profile.modules[_blocks(profile)[0]].op_stats
    (projection,) = skipped_ops(stats, None)
    dead = stats.runtimes[projection]
    n = len(stats.func_names)
    for policy, share in (([1] + [0] * (n - 1), 0.5), ([0] * n, 0.0)):  # selective: x1.5 measured; plain: its time
        ours = ModuleDecision(
            discard_ratio=1.0,
            op_policy=policy,
            recompute_ms=10.0,
            overhead_ms=2.0,
            freed_bytes=0,
            skipped_ops=[projection],
        )
        peer = _rerun_all(stats, ours, [2.0, 1.5, 30.0])
        assert peer.skipped_ops == [] and peer.recompute_ms == pytest.approx(10.0 + dead, abs=1e-12)
        assert peer.overhead_ms == pytest.approx(2.0 + share * dead, abs=1e-12)
    assert _rerun_all(stats, peer, None) is peer  # nothing skipped: as it is
