"""The budget search for compiled fits (``lightning.compiled_budget.plan_compiled``), without inductor.

A stand-in for the compiled step's trace: each plan's compiled step holds its eager prediction less a fraction of
its activations plus a fixed offset (inductor keeps less than eager, unevenly), so the solver's budget and the
compiled peak differ as they do under inductor. The search must land a plan within 2% under the real budget, never
trace a plan twice, and say when no plan fits.
"""

from __future__ import annotations

import pytest
from conftest import gpt_profile

from lightning_sac import BudgetError, solve_plan
from lightning_sac.apply import CompiledStepMemory
from lightning_sac.apply.compiled_memory import GraphMemory
from lightning_sac.lightning.compiled_budget import MAX_ROUNDS, TOLERANCE, compiled_peak, plan_compiled, step_figures


@pytest.fixture(scope="module")
def profile():  # noqa: ANN201
    return gpt_profile()


def _stand_in(profile, keep: float, offset: int):  # noqa: ANN001, ANN202
    """A trace whose compiled step keeps ``keep`` of the eager activations (its forward and backward alike)."""
    figures = step_figures(profile)
    traced: list[str] = []

    def trace(plan):  # noqa: ANN001, ANN202
        eager = profile.peak_bytes if plan is None else plan.predicted_peak_bytes
        held = int(keep * (eager - figures.forward_resident_bytes)) + offset
        traced.append("plain" if plan is None else plan.to_json())
        graph = GraphMemory(start_bytes=0, peak_bytes=held, end_bytes=0)
        return CompiledStepMemory(forwards=[graph], backwards=[GraphMemory(0, 0, 0)])

    return trace, traced


def _solve(profile):  # noqa: ANN001, ANN202
    return lambda solver_bytes: solve_plan(profile, solver_bytes / 2**30, refine=False, masks=False)


@pytest.mark.parametrize(("keep", "offset"), [(0.7, 0), (0.9, 4096), (1.0, 0)])
def test_the_search_lands_within_two_percent_under_the_budget(profile, keep, offset):
    trace, traced = _stand_in(profile, keep, offset)
    plain = compiled_peak(profile, trace(None))
    traced.clear()
    budget = int(0.85 * plain)
    plan, search = plan_compiled(profile, budget, _solve(profile), trace)
    assert plan.decisions and search.fits
    assert budget * (1 - TOLERANCE) <= plan.predicted_peak_bytes <= budget, (search.rounds, budget)
    assert plan.budget_bytes == budget and search.plain_peak_bytes == plain
    assert len(search.rounds) <= MAX_ROUNDS
    plans = [t for t in traced if t != "plain"]
    assert len(plans) == len(set(plans)), "no plan is traced twice"


def test_a_budget_no_plan_reaches_is_refused_with_the_lowest_figure(profile):
    trace, _ = _stand_in(profile, 1.0, 0)
    budget = step_figures(profile).forward_resident_bytes  # not even the parameters' step fits
    with pytest.raises(BudgetError, match="No plan traced for the compiled step") as err:
        plan_compiled(profile, budget, _solve(profile), trace)
    assert err.value.minimum_bytes > budget
    plan, search = plan_compiled(profile, budget, _solve(profile), trace, strict=False)
    assert not search.fits and plan.predicted_peak_bytes == err.value.minimum_bytes
