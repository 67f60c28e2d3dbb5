"""Trade-off curves and op policies on op statistics small enough to solve by hand."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_sac import ModuleOpStats, greedy_op_policy, optimal_op_policy
from lightning_sac.solver.tradeoff import effective_memory, module_tradeoff


def toy(force_store_random: bool = False) -> ModuleOpStats:
    # 0 addmm, 1 view, 2 relu, 3 mul_ on relu's output, 4 dropout, 5 mm, 6 dropout, 7 add (the module's output)
    return ModuleOpStats(
        func_names=["addmm", "view", "relu", "mul_", "dropout", "mm", "dropout", "add"],
        runtimes=[10.0, 0.0, 1.0, 1.0, 2.0, 20.0, 2.0, 1.0],
        memory=[100, 0, 100, 0, 50, 200, 50, 100],
        view_like_ops=[1],
        rand_ops=[4, 6],
        saved_autograd_ops=[0, 2, 5, 7],
        packed_ops=[0, 2, 5, 7],
        output_saved_inside=True,  # 7, the output, is saved by the module's own backward
        inplace_ops=[(3, 2)],
        force_store_random=force_store_random,
    )


# Units: A={0} 100 B/10 ms, B={2,3} 100 B/2 ms, C={4,6} (random) 100 B/4 ms, D={5} 200 B/20 ms; op 7 is the
# output, free to keep; op 1 is a view, always recomputed. Total memory 500 B, total runtime 37 ms.
OPTIMAL = {
    0.0: [0, 0, 0, 0, 0, 0, 0, 1],  # only the free output stays
    0.2: [1, 0, 0, 0, 0, 0, 0, 1],  # 100 B: A (10 ms) beats B (2) and C (4)
    0.4: [0, 0, 0, 0, 0, 1, 0, 1],  # 200 B: D (20) beats A+C (14)
    0.6: [1, 0, 0, 0, 0, 1, 0, 1],  # 300 B: A+D (30)
    0.8: [1, 0, 0, 0, 1, 1, 1, 1],  # 400 B: A+C+D (34)
    1.0: [1, 0, 1, 1, 1, 1, 1, 1],  # everything but the view
}


def test_effective_memory_zeroes_the_modules_output_op_when_its_own_backward_keeps_it():
    assert effective_memory(toy()) == [100, 0, 100, 0, 50, 200, 50, 0]
    unsaved = toy()
    unsaved.saved_autograd_ops = unsaved.packed_ops = [0, 2, 5]  # nothing keeps the output: caching it costs memory
    unsaved.output_saved_inside = False
    assert effective_memory(unsaved) == [100, 0, 100, 0, 50, 200, 50, 100]
    downstream = toy()
    # Only the next module saves it: autograd frees it at that module's backward, before this module's, but a
    # checkpoint's cache would keep it until this module's backward, so caching it costs its size.
    downstream.packed_ops = [0, 2, 5]
    downstream.output_saved_inside = False
    assert effective_memory(downstream) == [100, 0, 100, 0, 50, 200, 50, 100]


def test_modules_that_differ_only_in_what_keeps_their_output_do_not_share_a_trade_off():
    # The trade-offs of equal stats are shared; whether the output costs memory is part of what makes them equal.
    kept, unsaved = toy(), toy()
    unsaved.output_saved_inside = False
    assert module_tradeoff(kept).total_memory == 500
    assert module_tradeoff(unsaved).total_memory == 600
    other_output = toy()
    other_output.output_ops = [5]  # the mm made the output: it is free to keep, and the add is not
    assert module_tradeoff(other_output).total_memory == 400


def test_greedy_order_and_curve():
    t = module_tradeoff(toy(), n_segments=2)
    assert [u.ops for u in t.order] == [(2, 3), (4, 6), (0,), (5,)]  # MSPS 50, 25, 10, 10 (tie: earlier op)
    assert [u.ops for u in t.stored] == [(7,)]
    assert t.total_memory == 500 and t.total_runtime == 37.0
    xs, ys = zip(*t.curve, strict=True)
    assert xs == pytest.approx([0, 0.2, 0.4, 0.6, 1.0])
    assert ys == pytest.approx([0, 2 / 37, 6 / 37, 16 / 37, 36 / 37])


@pytest.mark.parametrize("n_segments", [1, 2, 3])
def test_fit_never_lies_below_the_curve_and_touches_it(n_segments):
    t = module_tradeoff(toy(), n_segments=n_segments)
    assert len(t.slopes) == n_segments
    xs = np.linspace(0.0, t.max_discard, 1001)  # between the points too: the curve is linear there
    gaps = [t.fit(x) - np.interp(x, *zip(*t.curve, strict=True)) for x in xs] + [t.fit(x) - y for x, y in t.curve]
    assert min(gaps) >= -1e-12  # never below (up to float rounding)
    assert min(gaps) == pytest.approx(0.0, abs=1e-12)  # shifted no more than needed
    assert module_tradeoff(toy(), n_segments=n_segments).slopes == t.slopes  # reproducible


def test_fit_does_not_touch_numpys_global_random_state():
    np.random.seed(123)
    expected = np.random.rand()
    np.random.seed(123)
    module_tradeoff(toy(force_store_random=True), n_segments=2)
    assert np.random.rand() == expected


def test_forced_random_ops_are_stored_and_leave_the_curve():
    t = module_tradeoff(toy(force_store_random=True))
    assert (4, 6) in [u.ops for u in t.stored]
    assert t.max_discard == pytest.approx(0.8)


@pytest.mark.parametrize("budget", sorted(OPTIMAL))
def test_optimal_op_policy_at_budgets_from_0_to_1(budget):
    assert optimal_op_policy(toy(), budget) == OPTIMAL[budget]


def test_optimal_beats_greedy_where_greedy_overshoots():
    stats = toy()
    # Greedy recomputes B, C, A and then must drop D too to fit 100 B; the knapsack keeps A.
    assert greedy_op_policy(stats, 0.2) == [0, 0, 0, 0, 0, 0, 0, 1]
    assert greedy_op_policy(stats, 0.6) == OPTIMAL[0.6]
    for budget in OPTIMAL:
        runtime = [
            sum(r for r, keep in zip(stats.runtimes, p, strict=True) if keep)
            for p in (optimal_op_policy(stats, budget), greedy_op_policy(stats, budget))
        ]
        assert runtime[0] >= runtime[1]


def test_constraints_random_inplace_view():
    stats = toy(force_store_random=True)
    assert optimal_op_policy(stats, 0.2) == [0, 0, 0, 0, 1, 0, 1, 1]  # the random pair is all that fits
    with pytest.raises(ValueError, match=r"below the 0\.2000 of this module's op memory"):
        optimal_op_policy(stats, 0.1)
    own = toy()
    own.inplace_ops = [(3, 3)]  # mul_ on a storage from outside the module: must be saved
    for budget in OPTIMAL:
        policy = optimal_op_policy(own, budget)
        assert policy[3] == 1 and policy[1] == 0 and policy[4] == policy[6]
    for budget in OPTIMAL:
        policy = optimal_op_policy(toy(), budget)
        assert policy[3] == policy[2]  # in-place follows its parent


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_budget_outside_unit_interval_is_refused(bad):
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        optimal_op_policy(toy(), bad)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        greedy_op_policy(toy(), bad)
