"""Dropout noise kept as ``bool`` masks and copied back in recompute (:mod:`lightning_sac.solver.masks`).

On Hugging Face GPT-2 (dropout 0.1 on attention weights and both residual branches, drawn on a CPU into
``empty_like(x).bernoulli_(1 - p)``): the profile's mask facts are the noise's own sizes, a masked plan trains
bit-equal to the plain model and copies every mask back, keeps the masks' bytes instead of the noise's (peak
from torch.profiler's allocator events), and the solver masks where the copy is cheaper than the draw.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import adamw
from zoo import gpt2

from lightning_sac import profile_model, solve_plan
from lightning_sac.adapters import sac_sees_outputs
from lightning_sac.apply import apply_plan
from lightning_sac.dryrun.measured import measure_training_step
from lightning_sac.dryrun.step import default_loss
from lightning_sac.errors import LightningSACError
from lightning_sac.plan.decisions import ModuleDecision, Plan
from lightning_sac.solver.masks import mask_fixed_ms, mask_unit, masked_view, realize
from lightning_sac.solver.recompute import recompute_ms, recompute_transient, recomputed_ops, skipped_ops
from lightning_sac.solver.tradeoff import effective_memory

GIB = 2**30


@pytest.fixture(scope="module")
def family_and_profile():  # noqa: ANN201
    family = gpt2()
    family.model.config.use_cache = False
    profile = profile_model(family.model, family.batch, optimizer_factory=adamw, device="cpu")
    # A roofline sees no cost in drawing, and this tiny model's timed draws take tens of microseconds, where a busy
    # machine decides whether a draw costs more than copying its mask back. On a CPU it does, for large tensors (the
    # vs_peers GPT: 30 against 3.8 ms): each draw costs 8x its copies here, the same on every run.
    for module in profile.modules.values():
        stats = module.op_stats
        for draw, ms in zip(stats.mask_ops, stats.mask_ms, strict=True) if stats is not None else ():
            stats.runtimes[draw] = 8 * ms
    return family, profile


def _blocks(profile):  # noqa: ANN001, ANN202
    return [f for f in profile.modules if f.count(".") == 2 and f.startswith("transformer.h.")]


def _plan(profile, masked: bool) -> Plan:  # noqa: ANN001
    """Every block saves all it may; its random unit as masks, or as the noise itself."""
    decisions = {}
    for f in _blocks(profile):
        stats = profile.modules[f].op_stats
        views = set(stats.view_like_ops)
        found = [0 if i in views else 1 for i in range(len(stats.func_names))]
        policy, masks = realize(stats, found) if masked else (found, [])
        decisions[f] = ModuleDecision(
            discard_ratio=0.0,
            op_policy=policy,
            recompute_ms=0.0,
            freed_bytes=0,
            op_names=list(stats.func_names),
            skipped_ops=skipped_ops(stats, policy),
            masked_ops=masks,
        )
    return Plan(decisions=decisions, budget_bytes=0)


def _step(model, batch) -> torch.Tensor:  # noqa: ANN001
    torch.manual_seed(3)  # the same dropout noise in every model
    loss = default_loss(model(**batch))
    loss.backward()
    return loss.detach()


def test_the_profile_records_each_dropout_draw_and_the_bytes_of_its_mask(family_and_profile):
    _, profile = family_and_profile
    config = family_and_profile[0].model.config
    tokens = family_and_profile[0].batch["input_ids"].numel()
    batch = family_and_profile[0].batch["input_ids"].shape[0]
    seq = tokens // batch
    for f in _blocks(profile):
        stats = profile.modules[f].op_stats
        unit = mask_unit(stats)
        assert unit is not None and stats.mask_ops == stats.rand_ops == list(unit.draws)
        # Attention weights (batch x heads x seq x seq) and the two residual branches (tokens x d): one byte an
        # element, where the fp32 noise the draw fills takes four.
        expected = [batch * config.n_head * seq * seq, tokens * config.n_embd, tokens * config.n_embd]
        assert sorted(stats.mask_bytes) == sorted(expected)
        for maker, size in zip(unit.makers, stats.mask_bytes, strict=True):
            assert stats.memory[maker] == 4 * size
        assert all(0 < ms < stats.runtimes[d] for d, ms in zip(unit.draws, stats.mask_ms, strict=True))


def test_the_masked_view_costs_what_the_backend_runs_in_both_states(family_and_profile):
    _, profile = family_and_profile
    stats = profile.modules[_blocks(profile)[0]].op_stats
    unit = mask_unit(stats)
    view = masked_view(stats)
    # The masks' bytes stand for the noise when the unit is kept.
    assert sum(effective_memory(stats)) - sum(effective_memory(view)) == 3 * sum(stats.mask_bytes)
    everything = [0] * len(stats.func_names)
    kept = [0 if i in stats.view_like_ops else 1 for i in range(len(stats.func_names))]
    for found in (everything, kept):
        policy, masked = realize(stats, found)
        assert masked == ([] if found is everything else list(unit.draws))
        # What the view's curve says the policy recomputes, plus the fixed part, is what the backend reruns.
        on_view = sum(t for i, t in enumerate(view.runtimes) if not found[i] and i in recomputed_ops(view, found))
        assert on_view + mask_fixed_ms(stats) == pytest.approx(recompute_ms(stats, policy, "sac", masked), abs=1e-9)
    # A masked recompute holds the masks until their draws, on top of the noise it rebuilds.
    policy, masked = realize(stats, kept)
    assert recompute_transient(stats, policy, "sac", masked) >= recompute_transient(stats, policy, "sac")
    assert masked_view(stats, "graph") is stats and realize(stats, kept, "graph") == (kept, [])


def test_a_masked_plan_trains_bit_equal_to_the_plain_model_and_copies_every_mask(family_and_profile):
    family, profile = family_and_profile
    plain, planned = copy.deepcopy(family.model), copy.deepcopy(family.model)
    plan = _plan(profile, masked=True)
    handle = apply_plan(planned, plan)
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loss = _step(plain, family.batch)
            planned_loss = _step(planned, family.batch)
        assert torch.equal(planned_loss, loss)
        for p, q in zip(plain.parameters(), planned.parameters(), strict=True):
            assert torch.equal(q.grad, p.grad)
            p.grad = q.grad = None
        for f, w in handle.wrappers.items():
            assert not w.whole and w.mismatched_calls == 0
            assert w.last_skipper.copied == len(plan.decisions[f].masked_ops) == 3
    for a, b in zip(plain.buffers(), planned.buffers(), strict=True):
        assert torch.equal(a, b)


def test_masks_keep_a_quarter_of_the_noise_bytes_in_a_real_step(family_and_profile):
    family, profile = family_and_profile
    peaks = {}
    for masked in (False, True):
        model = copy.deepcopy(family.model)
        apply_plan(model, _plan(profile, masked))
        peaks[masked] = measure_training_step(model, family.batch, optimizer_factory=adamw).peak_bytes
    noise = sum(4 * sum(profile.modules[f].op_stats.mask_bytes) for f in _blocks(profile))
    # Ground truth from the allocator: masking frees at most three quarters of every block's noise (the peak
    # falls by that when it lies where all blocks' activations are alive, less where a recompute rebuilds some).
    assert 0 < peaks[False] - peaks[True] <= noise * 3 // 4


def test_a_call_that_leaves_the_plan_redraws_its_noise_exactly(family_and_profile):
    family, profile = family_and_profile
    plan = _plan(profile, masked=True)
    for d in plan.decisions.values():
        d.op_names[-1] = "aten.not_this_op.default"  # every call differs from the profile at its last op
    plain, planned = copy.deepcopy(family.model), copy.deepcopy(family.model)
    handle = apply_plan(planned, plan)
    planned_loss = _step(planned, family.batch)
    assert all(w.mismatched_calls == 1 for w in handle.wrappers.values())
    assert torch.equal(planned_loss, _step(plain, family.batch))
    for p, q in zip(plain.parameters(), planned.parameters(), strict=True):
        assert torch.equal(q.grad, p.grad)
    assert all(w.last_skipper.copied == 0 for w in handle.wrappers.values())


def _fixed_costs(measured):  # noqa: ANN001, ANN202
    profile = type(measured).from_json(measured.to_json())
    for module in profile.modules.values():
        module.measured_overhead = {}  # calibration's timings too: the wrapping's cost is then modelled
        stats = module.op_stats
        if stats is None:
            continue
        views = set(stats.view_like_ops)
        stats.runtimes = [0.0 if i in views else 1e-3 + b / 1e6 for i, b in enumerate(stats.memory)]
        stats.mask_ms = [2 * 4 * nbytes / 1e6 for nbytes in stats.mask_bytes]  # in and out, per float32 noise byte
        for draw, ms in zip(stats.mask_ops, stats.mask_ms, strict=True):
            stats.runtimes[draw] = 8 * ms
    return profile


def test_the_solver_masks_where_copies_are_cheaper_and_keeps_its_budget(family_and_profile):
    family, measured = family_and_profile
    # This tiny model's ops take tens of microseconds, where timing noise (a busy machine) decides the plan. So every
    # op costs a fixed time per byte it makes, each mask copy as much per byte of the noise it stands for, and a
    # draw 8x its copies, as drawing a large tensor on a CPU does (the vs_peers GPT: 30 against 3.8 ms).
    profile = _fixed_costs(measured)
    masked = []
    for fraction in (0.65, 0.6, 0.55, 0.5):
        budget = fraction * profile.peak_bytes / GIB
        with_masks, without = solve_plan(profile, budget), solve_plan(profile, budget, masks=False)
        assert not any(d.masked_ops for d in without.decisions.values())
        # Solved both ways, the faster plan is kept.
        assert with_masks.predicted_step_ms <= without.predicted_step_ms
        if any(d.masked_ops for d in with_masks.decisions.values()):
            assert with_masks.predicted_step_ms < without.predicted_step_ms
            masked.append(with_masks)
    assert masked  # tight budgets mask
    plan = masked[0]
    model = copy.deepcopy(family.model)
    apply_plan(model, plan)
    peak = measure_training_step(model, family.batch, optimizer_factory=adamw).peak_bytes
    # Allocator events against the plan's model: within 10% (as tests/test_apply.py holds plans without masks).
    assert abs(peak - plan.predicted_peak_bytes) <= 0.10 * plan.predicted_peak_bytes
    # A plan from before masks loads with none.
    old = plan.to_dict()
    for d in old["decisions"].values():
        del d["masked_ops"]
    assert all(d.masked_ops == [] for d in Plan.from_dict(old).decisions.values())


@pytest.fixture
def torch_before_2_12(monkeypatch):  # noqa: ANN001, ANN201
    """``SelectiveCheckpointContext`` as torch 2.11 and older make it: no ``op_output`` (the policy runs first)."""
    from torch.utils.checkpoint import SelectiveCheckpointContext

    def init(self, *, is_recompute, **_newer) -> None:  # noqa: ANN001
        self.is_recompute = is_recompute

    monkeypatch.setattr(SelectiveCheckpointContext, "__init__", init)
    assert not sac_sees_outputs()


def test_before_torch_2_12_a_selective_plan_trains_bit_equal(family_and_profile, torch_before_2_12):
    # GPU-found: torch 2.11's policy context has no op_output, and every selective plan raised AttributeError.
    family, profile = family_and_profile
    plain, planned = copy.deepcopy(family.model), copy.deepcopy(family.model)
    handle = apply_plan(planned, _plan(profile, masked=False))
    for _ in range(2):
        loss, planned_loss = _step(plain, family.batch), _step(planned, family.batch)
        assert torch.equal(planned_loss, loss)
        for p, q in zip(plain.parameters(), planned.parameters(), strict=True):
            assert torch.equal(q.grad, p.grad)
            p.grad = q.grad = None
    assert all(not w.whole and w.calls == 2 and w.mismatched_calls == 0 for w in handle.wrappers.values())
    for a, b in zip(plain.buffers(), planned.buffers(), strict=True):
        assert torch.equal(a, b)


def test_before_torch_2_12_the_solver_plans_no_masks_and_a_masked_plan_is_refused(
    family_and_profile, torch_before_2_12
):
    family, measured = family_and_profile
    profile = _fixed_costs(measured)
    plans = [solve_plan(profile, fraction * profile.peak_bytes / GIB) for fraction in (0.65, 0.6, 0.55, 0.5)]
    assert all(p.decisions and not any(d.masked_ops for d in p.decisions.values()) for p in plans)
    model, plan, masked = copy.deepcopy(family.model), _plan(measured, masked=False), _plan(measured, masked=True)
    last = _blocks(measured)[-1]
    plan.decisions[last] = masked.decisions[last]  # the first blocks are wrapped before the last one is refused
    with pytest.raises(LightningSACError, match=r"op_output, torch >= 2\.12"):
        apply_plan(model, plan)
    # Refused whole: no module is left wrapped.
    assert not [n for n, m in model.named_modules() if "forward" in m.__dict__]
    loss, plain_loss = _step(model, family.batch), _step(copy.deepcopy(family.model), family.batch)
    assert torch.equal(loss, plain_loss)
