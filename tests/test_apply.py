"""apply_plan with both backends: same loss and gradients as the plain model, reversible, measured memory."""

from __future__ import annotations

import copy
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
from conftest import Case, adamw, gpt_case, recompute_all_policy
from torch import nn

from lightning_sac import BudgetError, ModelProfile, ModuleDecision, Plan, profile_model, solve_plan
from lightning_sac.apply import apply_plan
from lightning_sac.demos import MLP, ConvNet
from lightning_sac.dryrun.measured import measure_training_step
from lightning_sac.dryrun.step import default_loss
from lightning_sac.solver import find_candidates

GIB = 2**30


def apply_cases() -> dict[str, Case]:
    """The test models with batches large enough that activations, not weights, set the peak."""
    torch.manual_seed(0)
    labels = torch.randint(0, 10, (64,))
    return {
        "gpt": gpt_case(),
        "mlp": Case("mlp", nn.Sequential(MLP(256, 1024), nn.ReLU(), MLP(256, 1024)), (torch.randn(2048, 256),), None),
        "conv": Case(
            "conv", ConvNet(width=16), (torch.randn(64, 3, 32, 32),), lambda o: nn.functional.cross_entropy(o, labels)
        ),
    }


_PROFILES: dict[str, ModelProfile] = {}


def profile_of(case: Case) -> ModelProfile:
    if case.name not in _PROFILES:
        _PROFILES[case.name] = profile_model(
            case.model, case.inputs, loss_fn=case.loss_fn, optimizer_factory=adamw, device="cpu"
        )
    return _PROFILES[case.name]


def tight_plan(profile: ModelProfile) -> Plan:
    with pytest.raises(BudgetError) as info:
        solve_plan(profile, 1e-6)
    return solve_plan(profile, info.value.minimum_bytes * 1.02 / GIB)


def recompute_everything(profile: ModelProfile) -> Plan:
    """Every outermost candidate (below the root) checkpointed with every op recomputed that may be."""
    cands = [c.fqn for c in find_candidates(profile) if c.fqn]
    top = [f for f in cands if not any(f.startswith(o + ".") for o in cands if o != f)]
    decisions = {}
    for fqn in top:
        stats = profile.modules[fqn].op_stats
        decisions[fqn] = ModuleDecision(
            discard_ratio=1.0,
            op_policy=recompute_all_policy(stats),
            recompute_ms=sum(stats.runtimes),
            freed_bytes=0,
            op_names=list(stats.func_names),
        )
    return Plan(decisions=decisions, budget_bytes=0)


def make_plan(kind: str, profile: ModelProfile) -> Plan:
    if kind == "empty":
        return Plan(budget_bytes=profile.peak_bytes)
    if kind == "recompute-all":
        return recompute_everything(profile)
    return tight_plan(profile)


def step(model: nn.Module, case: Case) -> torch.Tensor:
    torch.manual_seed(123)  # the same dropout masks in both runs
    loss = (case.loss_fn or default_loss)(model(*case.inputs))
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("backend", ["sac", "graph"])
@pytest.mark.parametrize("kind", ["empty", "recompute-all", "tight"])
@pytest.mark.parametrize("name", ["gpt", "mlp", "conv"])
def test_loss_and_gradients_equal_the_plain_models(name, kind, backend):
    case = apply_cases()[name]
    plan = make_plan(kind, profile_of(case))
    if kind != "empty":
        assert plan.decisions
    plain, planned = copy.deepcopy(case.model), copy.deepcopy(case.model)
    handle = apply_plan(planned, plan, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the profiled op sequence matches: no fallback warning
        loss = step(planned, case)
    torch.testing.assert_close(loss, step(plain, case))
    for (n, p), q in zip(plain.named_parameters(), planned.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=n)
    assert all(w.calls == 1 and w.mismatched_calls == 0 for w in handle.wrappers.values())


@pytest.mark.parametrize("backend", ["sac", "graph"])
def test_remove_restores_the_model_and_state_dict_keys_never_change(backend):
    case = apply_cases()["gpt"]
    model = case.model
    keys = list(model.state_dict())
    plan = tight_plan(profile_of(case))
    handle = apply_plan(model, plan, backend=backend)
    assert all("forward" in dict(model.named_modules())[f].__dict__ for f in plan.decisions)
    assert list(model.state_dict()) == keys
    fresh = copy.deepcopy(apply_cases()["gpt"].model)
    fresh.load_state_dict(model.state_dict())  # checkpoints load with or without a plan
    with pytest.raises(RuntimeError, match="already has its forward replaced"):
        apply_plan(model, plan, backend=backend)
    handle.remove()
    handle.remove()
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert list(model.state_dict()) == keys


def test_bad_backend_and_foreign_plan():
    case = apply_cases()["gpt"]
    plan = tight_plan(profile_of(case))
    with pytest.raises(ValueError, match="backend must be one of"):
        apply_plan(case.model, plan, backend="magic")
    with pytest.raises(ValueError, match="does not have"):
        apply_plan(nn.Linear(2, 2), plan)


@pytest.mark.parametrize("backend", ["sac", "graph"])
def test_other_code_path_falls_back_to_saving_and_warns_once(backend):
    case = apply_cases()["gpt"]
    plan = tight_plan(profile_of(case))
    plain, planned = copy.deepcopy(case.model), copy.deepcopy(case.model)
    handle = apply_plan(planned, plan, backend=backend)
    # In eval mode with grad on (fine-tuning without dropout) the blocks run no dropout ops: another op sequence.
    plain.eval()
    planned.eval()
    fqn = next(iter(plan.decisions))
    with warnings.catch_warnings():
        # A first call may build what the module caches for later ones (tests/test_cached_values.py): not warned.
        warnings.simplefilter("error")
        loss = step(planned, case)
    assert handle.wrappers[fqn].mismatched_calls == 1
    torch.testing.assert_close(loss, step(plain, case))
    for p, q in zip(plain.parameters(), planned.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad)
    with pytest.warns(UserWarning, match=rf"module '{fqn}' ran other ops than the profiled ones"):
        loss = step(planned, case)
    torch.testing.assert_close(loss, step(plain, case))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once, not per step
        step(planned, case)
    assert handle.wrappers[fqn].mismatched_calls == 3


@pytest.mark.parametrize("backend", ["sac", "graph"])
def test_measured_peak_falls_with_the_budget_and_matches_the_prediction(backend):
    case = apply_cases()["gpt"]
    profile = profile_of(case)
    measured = []
    for fraction in (0.9, 0.75, 0.66):
        plan = solve_plan(profile, profile.peak_bytes * fraction / GIB)
        model = copy.deepcopy(case.model)
        apply_plan(model, plan, backend=backend)
        peak = measure_training_step(model, case.inputs, loss_fn=case.loss_fn, optimizer_factory=adamw).peak_bytes
        # Independent ground truth (allocator events) against the plan's model of the step: within 10%.
        assert abs(peak - plan.predicted_peak_bytes) <= 0.10 * plan.predicted_peak_bytes, (fraction, peak, plan)
        measured.append(peak)
    assert measured[0] > measured[1] > measured[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("backend", ["sac", "graph"])
def test_plan_then_ddp_gives_the_plain_gradients(backend):
    case = apply_cases()["gpt"]
    plan = tight_plan(profile_of(case))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        planned = copy.deepcopy(case.model)
        apply_plan(planned, plan, backend=backend)  # the plan first, then DDP, as the docstring says
        ddp = nn.parallel.DistributedDataParallel(planned)
        plain = copy.deepcopy(case.model)
        torch.testing.assert_close(step(ddp, case), step(plain, case))
        for p, q in zip(plain.parameters(), planned.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad)
    finally:
        dist.destroy_process_group()
