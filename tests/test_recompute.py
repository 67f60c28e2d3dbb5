"""What backward really recomputes: predicted from the profile's op graph, and counted in real CPU steps."""

from __future__ import annotations

import collections
import copy
from typing import Any

import pytest
import torch
from conftest import CASES, Case, SacOps, adamw, recompute_all_policy
from test_op_stats import _stats
from torch import nn

from lightning_sac import BudgetError, ModelProfile, ModuleDecision, Plan, profile_model, solve_plan
from lightning_sac.apply import apply_plan
from lightning_sac.apply.graph.backend import _graph
from lightning_sac.dryrun.step import default_loss
from lightning_sac.ops.aten import is_sac_ignored, op_name
from lightning_sac.profiling.overhead import measure_backend_overheads
from lightning_sac.solver import find_candidates
from lightning_sac.solver.recompute import (
    fixed_overhead_ms,
    overhead_ms,
    recompute_costs,
    recompute_ms,
    recomputed_ops,
    skipped_ops,
)

GIB = 2**30


# ----------------------------------------------------------------------------- by hand
# Body's ops (see test_op_stats): 0 t, 1 addmm, 2 add, 3 mul_ (on 2), 4 empty_like, 5 bernoulli_ (on 4),
# 6 div_ (on 4), 7 mul (3 * 6), 8 view, 9 tanh. Autograd saves div_'s output (dropout's mask, for mul's
# backward) and tanh's output; x needs no grad, so addmm saves only x, from outside.
def test_op_graph_of_a_module_by_hand():
    _, s = _stats()
    assert s.op_inputs == [[], [0], [1], [2], [3], [4], [5], [3, 6], [7], [8]]
    assert s.packed_ops == [6, 9]
    assert s.mutated_later == [2, 4, 5]  # add by mul_, empty_like's storage by bernoulli_ and div_
    assert s.recompute_stop == 10  # tanh's output is packed after tanh ran


def _policy(saved: set[int]) -> list[int]:
    return [int(i in saved) for i in range(10)]


@pytest.mark.parametrize(
    ("saved", "sac", "graph"),
    [
        # Nothing saved: both rerun everything backward needs, which here is every op.
        (set(), list(range(10)), list(range(10))),
        # The mask saved: graph needs nothing of dropout's chain, SAC reruns it all but div_.
        ({6}, [0, 1, 2, 3, 4, 5, 7, 8, 9], [0, 1, 2, 3, 7, 8, 9]),
        # mul saved: tanh's input chain stops there for graph; SAC still reruns every op before tanh.
        ({6, 7}, [0, 1, 2, 3, 4, 5, 8, 9], [8, 9]),
        # add saved but overwritten by mul_ later: graph must recompute it anyway, SAC serves its cache, so
        # nothing SAC reruns reads addmm (1): it skips it.
        ({2}, [0, 3, 4, 5, 6, 7, 8, 9], list(range(10))),
    ],
)
def test_recomputed_ops_by_hand(saved, sac, graph):
    _, s = _stats()
    assert recomputed_ops(s, _policy(saved), "sac") == sac
    assert recomputed_ops(s, _policy(saved), "graph") == graph
    assert recompute_ms(s, _policy(saved), "graph") == pytest.approx(sum(s.runtimes[i] for i in graph), abs=0)


def test_early_stop_makes_ops_after_the_last_pack_free():
    _, s = _stats()
    s.recompute_stop = 7  # as if tanh's and mul's saves were gone: the recompute ends after div_
    assert recomputed_ops(s, _policy(set()), "sac") == list(range(7))
    assert recompute_costs(s) == [*s.runtimes[:7], 0.0, 0.0, 0.0]
    s.recompute_stop = None  # an older profile: every op the policy recomputes counts
    assert recomputed_ops(s, _policy({6}), "sac") == [0, 1, 2, 3, 4, 5, 7, 8, 9]


def test_bad_policy_length_and_backend():
    _, s = _stats()
    with pytest.raises(ValueError, match="one per op"):
        recomputed_ops(s, [0, 1])
    with pytest.raises(ValueError, match="backend must be one of"):
        recomputed_ops(s, _policy(set()), "reentrant")


# ----------------------------------------------------------------------------- counted in real steps
_PROFILES: dict[str, tuple[Case, ModelProfile]] = {}


def _case(name: str) -> tuple[Case, ModelProfile]:
    if name not in _PROFILES:
        case = CASES[name]()
        profile = profile_model(case.model, case.inputs, loss_fn=case.loss_fn, optimizer_factory=adamw, device="cpu")
        _PROFILES[name] = (case, profile)
    return _PROFILES[name]


def _plan(kind: str, profile: ModelProfile) -> Plan:
    if kind == "tight":
        with pytest.raises(BudgetError) as info:
            solve_plan(profile, 1e-6)
        return solve_plan(profile, info.value.minimum_bytes * 1.02 / GIB)
    cands = [c.fqn for c in find_candidates(profile) if c.fqn]
    top = [f for f in cands if not any(f.startswith(o + ".") for o in cands if o != f)]
    decisions = {}
    for fqn in top:
        stats = profile.modules[fqn].op_stats
        decisions[fqn] = ModuleDecision(
            discard_ratio=1.0,
            op_policy=recompute_all_policy(stats),
            recompute_ms=0.0,
            freed_bytes=0,
            op_names=list(stats.func_names),
        )
    return Plan(decisions=decisions, budget_bytes=0)


def _step(model: nn.Module, case: Case) -> None:
    torch.manual_seed(1)
    (case.loss_fn or default_loss)(model(*case.inputs)).backward()


@pytest.mark.parametrize("kind", ["recompute-all", "tight"])
@pytest.mark.parametrize("name", ["gpt", "mlp", "conv"])
def test_sac_recompute_stops_where_the_profile_says(name, kind):
    case, profile = _case(name)
    plan = _plan(kind, profile)
    handle = apply_plan(case.model, plan, backend="sac")
    rerun: dict[str, list[str]] = {}
    for fqn, wrapper in handle.wrappers.items():
        inner, calls = wrapper.inner, [0]

        def counted(*args: Any, _fqn: str = fqn, _inner: Any = inner, _calls: list[int] = calls, **kw: Any) -> Any:
            _calls[0] += 1
            if _calls[0] == 1:  # the forward; the second call is the recompute in backward
                return _inner(*args, **kw)
            with SacOps(rerun.setdefault(_fqn, [])):
                return _inner(*args, **kw)

        wrapper.inner = counted
    try:
        _step(case.model, case)
    finally:
        handle.remove()
    assert set(rerun) == set(plan.decisions)
    for fqn, names in rerun.items():
        stats = profile.modules[fqn].op_stats
        assert stats.recompute_stop is not None and stats.recompute_stop <= len(stats.func_names)
        # The recompute ran exactly the profiled ops up to the early stop, in order.
        assert names == stats.func_names[: stats.recompute_stop], fqn


@pytest.mark.parametrize("kind", ["recompute-all", "tight"])
@pytest.mark.parametrize("name", ["gpt", "mlp", "conv"])
def test_graph_recomputes_exactly_the_predicted_ops(name, kind, monkeypatch):
    case, profile = _case(name)
    plan = _plan(kind, profile)
    computed: list[str] = []
    graph = _graph()
    compute = graph._compute

    def logged(node: Any) -> Any:
        if not is_sac_ignored(node.func):
            computed.append(op_name(node.func))
        return compute(node)

    monkeypatch.setattr(graph, "_compute", logged)
    with apply_plan(case.model, plan, backend="graph"):
        _step(case.model, case)
    predicted = collections.Counter(
        profile.modules[fqn].op_stats.func_names[i]
        for fqn, d in plan.decisions.items()
        for i in recomputed_ops(profile.modules[fqn].op_stats, d.op_policy, "graph")
    )
    assert collections.Counter(computed) == predicted
    # Graph reruns a subset of what SAC reruns under the same policy (staleness aside, absent here), and of
    # what SAC skips: graph reruns a matmul whose output dropout's empty_like reads for its layout only.
    for fqn, d in plan.decisions.items():
        stats = profile.modules[fqn].op_stats
        sac = set(recomputed_ops(stats, d.op_policy, "sac"))
        skipped = set(skipped_ops(stats, d.op_policy))
        assert set(recomputed_ops(stats, d.op_policy, "graph")) <= sac | skipped
        assert not sac & skipped


# ----------------------------------------------------------------------------- the backends' own cost
def test_backend_overheads_are_measured_on_this_host():
    measured = measure_backend_overheads(n_ops=32, repeats=5)
    assert set(measured) == {"sac", "graph"}
    for overhead in measured.values():
        # A Python dispatch mode on every op costs microseconds per op on any CPU; a 1 ms per op answer
        # would mean the chain's kernels, not the wrapper, were timed.
        assert 1.0 < overhead.forward_us < 1000.0
        assert 0.0 <= overhead.rerun_us < 1000.0


def test_overhead_counts_wrapped_ops_and_reruns_by_hand():
    _, s = _stats()
    per_op = [50.0, 20.0]  # us: forward, rerun
    # SAC: 10 ops wrapped in forward, 10 rerun to the early stop whatever the policy.
    assert fixed_overhead_ms(s, "sac", per_op) == pytest.approx((10 * 50 + 10 * 20) / 1e3)
    assert overhead_ms(s, _policy({6}), "sac", per_op) == pytest.approx(0.7)
    # Graph: 10 ops recorded in forward, and a rerun only for each of the 7 recomputed ops of this policy.
    assert fixed_overhead_ms(s, "graph", per_op) == pytest.approx(0.5)
    assert overhead_ms(s, _policy({6}), "graph", per_op) == pytest.approx((10 * 50 + 7 * 20) / 1e3)


def test_plans_count_the_backend_overhead_and_wrap_fewer_ops_when_it_is_dear():
    case, profile = _case("gpt")
    budget = profile.peak_bytes * 0.85 / GIB
    cheap = solve_plan(profile, budget)
    assert cheap.predicted_overhead_ms == 0.0  # a roofline profile does not measure host overhead
    dear_profile = copy.copy(profile)
    dear_profile.backend_overhead_us = {"sac": [2000.0, 2000.0], "graph": [2000.0, 2000.0]}
    dear = solve_plan(dear_profile, budget)
    for fqn, d in dear.decisions.items():
        stats = profile.modules[fqn].op_stats
        # A policy that saves nothing runs as a plain checkpoint, without the per-op cost (apply.sac).
        expected = 0.0 if not any(d.op_policy) else fixed_overhead_ms(stats, "sac", [2000.0, 2000.0])
        assert d.overhead_ms == pytest.approx(expected)
    assert dear.predicted_overhead_ms == pytest.approx(sum(d.overhead_ms for d in dear.decisions.values()))
    assert dear.predicted_step_ms == pytest.approx(
        profile.step_ms + dear.predicted_recompute_ms + dear.predicted_overhead_ms
    )

    # Every op wrapped under a selective policy now costs 4 ms: the solver runs no more ops under one than
    # without that cost, within budget.
    def selective_ops(plan):  # noqa: ANN001, ANN202
        return sum(len(d.op_names) for d in plan.decisions.values() if any(d.op_policy))

    assert selective_ops(dear) <= selective_ops(cheap)
    assert dear.predicted_peak_bytes <= dear.budget_bytes


def test_a_plan_is_applied_with_its_own_backend_by_default():
    case, profile = _case("mlp")
    plan = _plan("tight", profile)
    graph_plan = solve_plan(profile, plan.budget_bytes / GIB, backend="graph")
    assert plan.backend == "sac" and graph_plan.backend == "graph"
    assert [d.op_policy for d in graph_plan.decisions.values()] == [d.op_policy for d in plan.decisions.values()]
    for fqn, d in graph_plan.decisions.items():
        assert d.recompute_ms == recompute_ms(profile.modules[fqn].op_stats, d.op_policy, "graph")
    with apply_plan(case.model, graph_plan) as handle:
        assert handle.backend == "graph"
    assert Plan.from_json(graph_plan.to_json()) == graph_plan
    with pytest.raises(ValueError, match="backend must be one of"):
        solve_plan(profile, 1.0, backend="reentrant")
