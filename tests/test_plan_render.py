"""The plan as text: one unit per screen, a peak within the budget never printed above it, a legend, a summary that
says what its figures include."""

from __future__ import annotations

import random
import re

from lightning_sac import ModuleDecision, Plan
from lightning_sac.plan.table import LEGEND, choose_unit, render_plan_table

GIB, MIB = 2**30, 2**20
# The summary's peak line: the device total with the plan of the budget, without a plan; all in one unit.
PEAK_LINE = re.compile(
    r"peak per device \((\w+), world size (\d+)\): ([\d.]+) (MiB|GiB) of ([\d.]+) \4 budget with the plan "
    r"\(recompute included(?:; [\d.]+ \4 CUDA reserve included)?\); ([\d.]+) \4 without a plan"
)


def _plan(budget: int, peak: int, plain: int, *, world_size: int = 1, sharding: str = "replicated") -> Plan:
    decisions = {
        "blocks.0": ModuleDecision(discard_ratio=0.5, op_policy=[0, 1], recompute_ms=1.25, freed_bytes=plain - peak),
        "": ModuleDecision(discard_ratio=1.0, op_policy=[0], recompute_ms=0.5, freed_bytes=3 * MIB),
    }
    return Plan(
        decisions=decisions,
        budget_bytes=budget,
        world_size=world_size,
        sharding=sharding,
        device="H100-SXM",
        predicted_peak_bytes=peak,
        unconstrained_peak_bytes=plain,
        predicted_recompute_ms=1.75,
        predicted_step_ms=101.75,
        solver_status="Optimal",
        solver_gap=0.004,
    )


def test_the_issue_case_reads_within_budget():
    # The example printed `peak 0.332 GiB` against `budget 0.33 GiB` for a 341 MiB budget it met.
    plan = _plan(341 * MIB, int(0.332 * GIB), int(0.476 * GIB))
    text = plan.table()
    peak, budget = PEAK_LINE.search(text).group(3, 5)
    assert (peak, budget) == ("340.0", "341.0")
    assert "GiB" not in text and "freed MiB" in text


def test_a_peak_within_budget_never_prints_above_it_and_one_above_never_prints_equal():
    rng = random.Random(0)
    for _ in range(500):
        scale = rng.choice([MIB, 100 * MIB, GIB, 40 * GIB])
        budget = rng.randint(scale // 2, 2 * scale)
        peak = budget - rng.choice([0, 1, rng.randint(0, budget // 3)])
        plain = budget + rng.choice([1, 512, rng.randint(1, 2 * budget)])
        found = PEAK_LINE.search(_plan(budget, peak, plain).table())
        assert found is not None
        shown_peak, shown_budget, shown_plain = (float(found.group(i)) for i in (3, 5, 6))
        assert shown_peak <= shown_budget < shown_plain, found.group(0)


def test_one_unit_per_screen_with_the_precision_of_its_size():
    assert (choose_unit([GIB]).name, choose_unit([GIB]).decimals) == ("GiB", 3)
    assert (choose_unit([GIB - 1]).name, choose_unit([GIB - 1]).decimals) == ("MiB", 1)
    assert choose_unit([5 * MIB]).decimals == 2 and choose_unit([MIB // 2]).decimals == 3
    big = _plan(6 * GIB, 5 * GIB + 7 * MIB, 9 * GIB).table()
    assert "MiB" not in big and "freed GiB" in big
    # the freed column in the same unit: 4 GiB - 7 MiB
    assert f"{(4 * GIB - 7 * MIB) / GIB:.3f}" in big and "3.993" in big
    small = _plan(50 * MIB, 40 * MIB, 80 * MIB).table()
    assert "GiB" not in small and "40.0 MiB of 50.0 MiB budget with the plan" in small and "freed MiB" in small


def test_the_legend_is_one_line_under_the_table():
    lines = _plan(6 * GIB, 5 * GIB, 9 * GIB).table().splitlines()
    rules = [i for i, line in enumerate(lines) if set(line) == {"-"}]
    assert len(rules) == 2 and lines[rules[1] + 1] == LEGEND
    assert lines.count(LEGEND) == 1 and "discard %" in LEGEND and "freed" in LEGEND and "recompute ms" in LEGEND
    assert lines[rules[0] + 1].startswith("blocks.0 ") and lines[rules[0] + 2].startswith("<root> ")


def test_the_summary_says_sharding_world_size_and_what_includes_recompute():
    text = _plan(6 * GIB, 5 * GIB, 9 * GIB, world_size=8, sharding="sharded").table()
    assert "world size 8, sharded: parameters, gradients and optimizer state divided over 8 devices" in text
    assert PEAK_LINE.search(text).group(1, 2) == ("sharded", "8")
    assert "step 101.750 ms with the plan (1.750 ms of recompute), 100.000 ms without" in text
    assert "communication is not modeled" in text and "gap 0.40%" in text
    one = _plan(6 * GIB, 5 * GIB, 9 * GIB).table()
    assert "world size 1 (one device holding the whole model)" in one and "communication" not in one


def test_a_plan_without_decisions_has_no_table():
    plan = Plan(budget_bytes=2 * GIB, device="cpu", predicted_peak_bytes=GIB, unconstrained_peak_bytes=GIB)
    text = plan.table()
    assert text.splitlines()[0] == "no module needs checkpointing"
    assert LEGEND not in text and "peak per device (replicated, world size 1): 1.000 GiB of 2.000 GiB budget" in text
    assert text == render_plan_table(plan)


def test_a_peak_is_the_device_total_with_the_reserve_named_inside_it():
    # The issue's case: a 12 GiB budget keeping 0.566 GiB for the device; the tensors' peak alone would read as
    # 0.6 GiB of headroom where there are 0.04.
    reserve = {"context_bytes": 709 * MIB, "blas_workspace_bytes": 64 * MIB}  # 0.755 GiB
    total = sum(reserve.values())
    plan = _plan(12 * GIB, int(11.96 * GIB) - total, int(17.35 * GIB) - total)
    plan.reserve = reserve
    text = plan.table()
    assert (
        "peak per device (replicated, world size 1): 11.960 GiB of 12.000 GiB budget with the plan (recompute "
        "included; 0.755 GiB CUDA reserve included); 17.350 GiB without a plan"
    ) in text
    assert PEAK_LINE.search(text).group(3, 5, 6) == ("11.960", "12.000", "17.350")
    tensors = f"{plan.tensor_budget_bytes / GIB:.3f}"
    assert f"the tensors get {tensors} GiB of the budget" in text and tensors == "11.245"
    # A budget under 1 GiB: the whole screen in MiB, the reserve included.
    small = _plan(900 * MIB, 500 * MIB, 1200 * MIB)
    small.reserve = {"context_bytes": 300 * MIB}
    assert "800.0 MiB of 900.0 MiB budget with the plan" in small.table()
    assert "1500.0 MiB without a plan" in small.table() and "GiB" not in small.table()
