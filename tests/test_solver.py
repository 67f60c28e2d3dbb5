"""The module-level MILP on a profile small enough to solve by hand, and on real profiles."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from conftest import gpt_profile as shared_gpt_profile

from lightning_sac import BudgetError, ModelProfile, ModuleOpStats, ModuleProfile, Plan, profile_model, solve_plan
from lightning_sac.devices import get_device_spec
from lightning_sac.dryrun.data import TimelineEvent, empty_snapshot
from lightning_sac.plan.reserve import DeviceReserve, device_reserve
from lightning_sac.solver.memory_model import device_bytes

MIB = 2**20
GIB = 2**30
PARAMS = 100  # MiB of parameters, alive all step

# (kind, name, MiB of activation at the event, MiB peak until the next event). Module a retains 40 MiB,
# b retains 60 MiB; each forward has 5 MiB of temporaries; the loss's backward peaks at 260 MiB.
TIMELINE = [
    ("phase", "forward", 0, 0),
    ("fwd_pre", "", 0, 0),
    ("fwd_pre", "a", 0, 45),
    ("fwd_post", "a", 40, 40),  # 3
    ("fwd_pre", "b", 40, 105),
    ("fwd_post", "b", 100, 100),  # 5
    ("fwd_post", "", 100, 100),
    ("phase", "backward", 100, 160),
    ("bwd_pre", "", 100, 100),
    ("bwd_pre", "b", 100, 130),  # 9
    ("bwd_post", "b", 40, 60),
    ("bwd_pre", "a", 40, 60),  # 11
    ("bwd_post", "a", 0, 0),
    ("bwd_post", "", 0, 0),
    ("phase", "optimizer", 0, 0),
    ("phase", "done", 0, None),
]


def snap(activation_mib: float, params_mib: float = PARAMS) -> dict[str, int]:
    s = empty_snapshot()
    s["parameter"] = int(params_mib * MIB)
    s["activation"] = int(activation_mib * MIB)
    return s


def module(
    fqn: str, memory_mib: list[float], runtimes: list[float], act_before: float, act_after: float
) -> ModuleProfile:
    m = ModuleProfile(fqn=fqn, module_type="Block", is_leaf=False, calls=1, output_bytes=5 * MIB)
    m.memory["pre_forward"] = snap(act_before)
    m.memory["post_forward"] = snap(act_after)
    m.memory["peak_forward"] = snap(act_after + 5)
    m.op_stats = ModuleOpStats(
        func_names=[f"op{i}" for i in range(len(runtimes))],
        runtimes=runtimes,
        memory=[int(x * MIB) for x in memory_mib],
        saved_autograd_ops=[len(runtimes) - 1],
        packed_ops=[len(runtimes) - 1],
        output_saved_inside=True,  # the module's own backward keeps its output: keeping it is free
    )
    return m


def hand_profile() -> ModelProfile:
    # a: units of 20 MiB at 1 ms and 20 MiB at 4 ms, output op 1 ms (6 ms); b: 30 MiB at 2 ms and 30 MiB at
    # 6 ms, output op 2 ms (10 ms). Retained = post - pre - output: a 45 - 0 - 5 = 40, b 105 - 40 - 5 = 60.
    root = ModuleProfile(fqn="", module_type="Net", is_leaf=False, calls=1)
    a = module("a", [20, 20, 5], [1.0, 4.0, 1.0], 0, 45)
    b = module("b", [30, 30, 5], [2.0, 6.0, 2.0], 40, 105)
    timeline = [
        TimelineEvent(kind=k, name=n, at=snap(at), peak_after={} if peak is None else snap(peak))
        for k, n, at, peak in TIMELINE
    ]
    # The solver's arithmetic by hand: an H100 without the device's reserve (tested on its own below).
    h100 = replace(get_device_spec("H100-SXM"), context_bytes=0, blas_workspace_bytes=0, nccl_bytes=0)
    return ModelProfile(
        device=h100,
        estimate="roofline",
        modules={"": root, "a": a, "b": b},
        timeline=timeline,
        peak_bytes=(PARAMS + 160) * MIB,
        forward_ms=10.0,
        backward_ms=20.0,
    )


def recheck_peak(profile: ModelProfile, plan: Plan) -> int:
    """The plan's peak straight from the timeline and the op lifetimes, without the solver's memory model.

    A checkpointed module's activations are gone from its forward's end to its backward's start, less what its
    policy saves; on a CPU it holds the generator state ``torch.utils.checkpoint`` stashes from its forward's
    start to its backward's end; at its backward's start its recompute reruns its ops in order, each rerun
    discarded activation coming back at its op and each rerun temporary alive for its forward span.
    """
    index = {(e.kind, e.name): k for k, e in enumerate(profile.timeline)}
    state = torch.get_rng_state().nbytes if not profile.device.is_cuda else 0

    def others(k: int, value: int) -> int:
        for fqn, d in plan.decisions.items():
            if index[("fwd_post", fqn)] <= k < index[("bwd_pre", fqn)]:
                value -= d.freed_bytes
            if index[("fwd_pre", fqn)] <= k < index[("bwd_post", fqn)]:
                value += state
        return value

    peak = max(others(k, sum(e.peak_after.values())) for k, e in enumerate(profile.timeline[:-1]))
    for fqn, d in plan.decisions.items():
        k = index[("bwd_pre", fqn)]
        m, s = profile.modules[fqn], profile.modules[fqn].op_stats
        if len(s.freed_at) != len(s.func_names):  # no op lifetimes (an older profile): the forward's temporaries
            rise = sum(m.memory["peak_forward"].values()) - sum(m.memory["post_forward"].values())
            peak = max(peak, others(k, sum(profile.timeline[k].at.values())) + rise)
            continue
        stop = len(s.func_names) if s.recompute_stop is None else s.recompute_stop
        rerun = [i < stop and not d.op_policy[i] for i in range(len(s.func_names))]
        temp = [s.freed_at[i] >= 0 for i in range(len(s.func_names))]
        saved_temps = sum(s.memory[i] for i in range(len(s.func_names)) if d.op_policy[i] and temp[i])
        out = s.output_ops[-1]
        rise = max(
            saved_temps
            + sum(s.memory[j] for j in range(i + 1) if rerun[j] and temp[j] and s.freed_at[j] > i)
            - sum(s.memory[j] for j in range(i + 1, stop) if rerun[j] and not temp[j] and j not in s.output_ops)
            + (s.memory[out] if rerun[out] and out <= i else 0)
            for i in range(stop)
        )
        peak = max(peak, others(k, sum(profile.timeline[k].at.values())) + rise)
    return peak


def test_slack_budget_gives_an_empty_plan():
    plan = solve_plan(hand_profile(), 400 * MIB / GIB)
    assert plan.decisions == {} and plan.predicted_recompute_ms == 0.0
    assert plan.unconstrained_peak_bytes == plan.predicted_peak_bytes == 260 * MIB
    assert plan.solver_status == "Not needed"


def test_mild_budget_checkpoints_the_cheapest_memory_by_hand():
    profile = hand_profile()
    plan = solve_plan(profile, 220 * MIB / GIB, candidates=["a", "b"])
    # Needed: 40 MiB absent during the loss backward, 10 MiB of it from a. Cheapest per MiB: a's first unit
    # (1 ms / 20 MiB), then b's first (2 ms / 30 MiB): a discards 1/2, b 1/3.
    assert set(plan.decisions) == {"a", "b"}
    assert plan.decisions["a"].discard_ratio == pytest.approx(0.5, abs=1e-6)
    # The solver keeps 1 KiB below the budget, which b's 60 MiB turn into a ratio 1.6e-5 above 1/3.
    assert plan.decisions["b"].discard_ratio == pytest.approx(1 / 3, abs=1e-4)
    # Op policies: a recomputes its first unit, b (40 MiB may stay) keeps the 6 ms unit and recomputes the other.
    assert plan.decisions["a"].op_policy == [0, 1, 1]
    assert plan.decisions["b"].op_policy == [0, 1, 1]
    assert plan.decisions["a"].freed_bytes == 20 * MIB and plan.decisions["b"].freed_bytes == 30 * MIB
    assert plan.predicted_recompute_ms == 3.0
    assert plan.predicted_step_ms == 33.0
    assert plan.predicted_peak_bytes == recheck_peak(profile, plan) == 210 * MIB
    assert plan.predicted_peak_bytes <= plan.budget_bytes


def test_tighter_budget_by_hand():
    profile = hand_profile()
    plan = solve_plan(profile, 200 * MIB / GIB, candidates=["a", "b"])
    # 60 MiB absent in the loss backward, 30 MiB of it from a during b's backward (130 + 100 params).
    assert plan.decisions["a"].discard_ratio >= 0.75 - 1e-6
    assert plan.predicted_peak_bytes == recheck_peak(profile, plan) <= 200 * MIB


@pytest.mark.parametrize(
    ("budget_mib", "minimum_mib"),
    # b's backward (230 MiB) only shrinks by a's 40 MiB: 190 is the floor, whatever is below it is refused.
    [(150, 190), (189, 190)],
)
def test_infeasible_budget_names_minimum_and_unconstrained_peaks(budget_mib, minimum_mib):
    with pytest.raises(BudgetError, match=r"minimum achievable peak of .* unconstrained peak is 0\.254 GiB") as info:
        solve_plan(hand_profile(), budget_mib * MIB / GIB, candidates=["a", "b"])
    assert info.value.minimum_bytes == pytest.approx(minimum_mib * MIB, abs=1024)
    assert info.value.unconstrained_bytes == 260 * MIB
    assert f"{minimum_mib * MIB / GIB:.3f} GiB" in str(info.value)


def test_the_budget_keeps_the_devices_reserve_by_hand():
    # The same step on a real H100 entry: the budget also holds the CUDA context (709 MiB), two cuBLAS workspaces
    # of 32 MiB (SM 9.0's :4096:8; the forward's thread and autograd's each get one) and, on 8 processes, one NCCL
    # communicator's buffers (1088 MiB). The tensors get what is left: a budget raised by exactly the reserve gives
    # exactly the plan of the reserve-free device.
    profile = replace(hand_profile(), device=get_device_spec("H100-SXM"))
    reserve = device_reserve(profile, 1)
    assert reserve == DeviceReserve(context_bytes=709 * MIB, blas_workspace_bytes=64 * MIB)
    assert device_reserve(profile, 8).nccl_bytes == 1088 * MIB
    plan = solve_plan(profile, (220 + 773) * MIB / GIB, candidates=["a", "b"])
    bare = solve_plan(hand_profile(), 220 * MIB / GIB, candidates=["a", "b"])
    assert plan.decisions == bare.decisions and plan.predicted_peak_bytes == bare.predicted_peak_bytes == 210 * MIB
    assert plan.reserve == reserve.to_dict() and plan.tensor_budget_bytes == 220 * MIB
    assert plan.allocated_budget_bytes == (220 + 64) * MIB  # what torch.cuda.max_memory_allocated() may reach
    # The least budget a plan fits in counts the reserve too.
    with pytest.raises(BudgetError, match=r"the tensors' 0\.186 GiB plus 0\.755 GiB the device holds") as info:
        solve_plan(profile, 900 * MIB / GIB, candidates=["a", "b"])
    assert info.value.minimum_bytes == pytest.approx((190 + 773) * MIB, abs=1024)
    # Fragmentation: what the allocator model reserved beyond the tensors' peak is kept as well.
    fragmented = replace(profile, reserved_peak_bytes=profile.peak_bytes + 20 * MIB)
    assert device_reserve(fragmented).fragmentation_bytes == 20 * MIB


def test_sharded_divides_parameters_gradients_and_optimizer_state():
    s = empty_snapshot()
    s.update(parameter=400, gradient=400, optimizer_state=800, activation=1000, buffer=8)
    assert device_bytes(s, 4, "replicated") == 2608
    assert device_bytes(s, 4, "sharded") == 100 + 100 + 200 + 1000 + 8
    profile = hand_profile()
    plan = solve_plan(profile, 200 * MIB / GIB, world_size=4, sharding="sharded", candidates=["a", "b"])
    assert plan.unconstrained_peak_bytes == (260 - 75) * MIB  # 100 MiB of parameters become 25 per device
    assert plan.decisions == {}


def test_candidates_restrict_choice():
    # Only a's activations can be absent during b's backward (230 MiB): without a, that is the floor.
    with pytest.raises(BudgetError) as info:
        solve_plan(hand_profile(), 220 * MIB / GIB, candidates=["b"])
    assert info.value.minimum_bytes == pytest.approx(230 * MIB, abs=1024)
    with pytest.raises(BudgetError) as info:
        solve_plan(hand_profile(), 220 * MIB / GIB, candidates=["nothing*"])
    assert info.value.minimum_bytes == pytest.approx(260 * MIB, abs=1024)
    plan = solve_plan(hand_profile(), 240 * MIB / GIB, candidates=["a"])
    assert set(plan.decisions) == {"a"}


def test_bad_arguments():
    with pytest.raises(ValueError, match="sharding must be"):
        solve_plan(hand_profile(), 1.0, sharding="zero3")
    with pytest.raises(ValueError, match="world_size"):
        solve_plan(hand_profile(), 1.0, world_size=0)
    with pytest.raises(TypeError, match="module classes or fqn glob patterns"):
        solve_plan(hand_profile(), 0.2, candidates=[3])


@pytest.fixture(scope="module")
def gpt_profile() -> ModelProfile:
    return shared_gpt_profile()


@pytest.mark.parametrize("fraction", [0.9, 0.75, 0.66])
def test_gpt_plans_never_nest_and_respect_the_budget(gpt_profile, fraction):
    budget = gpt_profile.peak_bytes * fraction / GIB
    plan = solve_plan(gpt_profile, budget)
    fqns = list(plan.decisions)
    assert fqns, "a budget below the unconstrained peak needs checkpointing"
    for a in fqns:
        assert not gpt_profile.modules[a].is_leaf
        for b in fqns:
            assert a == b or not (b.startswith(a + ".") or a.startswith(b + ".") or a == "" or b == "")
    assert plan.predicted_peak_bytes == recheck_peak(gpt_profile, plan) <= plan.budget_bytes
    assert plan.predicted_recompute_ms > 0
    again = solve_plan(gpt_profile, budget)  # deterministic
    assert again.decisions == plan.decisions and again.predicted_peak_bytes == plan.predicted_peak_bytes


def test_gpt_recompute_grows_as_the_budget_tightens(gpt_profile):
    budgets = [gpt_profile.peak_bytes * f / GIB for f in (0.9, 0.75, 0.66)]
    costs = [solve_plan(gpt_profile, b).predicted_recompute_ms for b in budgets]
    assert costs == sorted(costs) and costs[0] < costs[-1]


def test_candidates_by_class_and_pattern(gpt_profile):
    from lightning_sac.demos import TransformerBlock

    budget = gpt_profile.peak_bytes * 0.9 / GIB
    by_class = solve_plan(gpt_profile, budget, candidates=[TransformerBlock])
    assert by_class.decisions and all(f in ("blocks.0", "blocks.1") for f in by_class.decisions)
    by_glob = solve_plan(gpt_profile, budget, candidates=["blocks.*.mlp"])
    assert all(f.endswith(".mlp") for f in by_glob.decisions)


def test_plan_json_round_trip_and_table(gpt_profile):
    plan = solve_plan(gpt_profile, gpt_profile.peak_bytes * 0.75 / GIB)
    assert Plan.from_json(plan.to_json()) == plan
    table = plan.table()
    for fqn, d in plan.decisions.items():
        assert fqn in table and f"{100 * d.discard_ratio:.1f}" in table
    assert plan.fingerprint == solve_plan(gpt_profile, 1.0).fingerprint
    assert len(plan.fingerprint) == 16
    torch.manual_seed(0)


@pytest.mark.parametrize("fraction", [0.8, 0.66, 0.6])
def test_refining_keeps_the_better_of_two_fits_and_its_own_figures_fit_the_budget(gpt_profile, fraction):
    budget = gpt_profile.peak_bytes * fraction / GIB
    coarse = solve_plan(gpt_profile, budget, refine=False)
    finer = solve_plan(gpt_profile, budget, n_segments=3, refine=False)
    plan = solve_plan(gpt_profile, budget)
    best = min((coarse, finer), key=lambda p: p.predicted_step_ms)  # the first on a tie, as solve_plan keeps
    assert plan.decisions == best.decisions and plan.predicted_step_ms == best.predicted_step_ms
    assert plan.predicted_step_ms <= coarse.predicted_step_ms
    assert plan.predicted_peak_bytes == recheck_peak(gpt_profile, plan) <= plan.budget_bytes


def test_a_small_models_budget_error_prints_figures_that_differ():
    # A budget of 0.0018 GiB below a minimum of 0.0019 read "a budget of 0.002 GiB is below the minimum achievable
    # peak of 0.002 GiB": below a tenth of a GiB the figures are MiB, the budget also as given.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    profile = profile_model(model, (torch.randn(32, 64),), device="cpu")
    with pytest.raises(BudgetError) as below:
        solve_plan(profile, 1e-6)
    budget_gb = below.value.minimum_bytes * 0.98 / GIB
    with pytest.raises(BudgetError) as info:
        solve_plan(profile, budget_gb)
    message = str(info.value)
    pattern = r"A budget of (\d+\.\d+) MiB \(budget_gb=([\d.e-]+)\) per device .* peak of (\d+\.\d+) MiB"
    figures = re.search(pattern, message)
    assert figures is not None, message
    assert float(figures[1]) == pytest.approx(budget_gb * 1024, abs=5e-4)
    assert float(figures[2]) == pytest.approx(budget_gb, rel=1e-5)
    assert float(figures[3]) == pytest.approx(info.value.minimum_bytes / MIB, abs=5e-4)
    assert figures[1] != figures[3]
