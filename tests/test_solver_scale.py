"""The solver's fast paths (what makes an 80-layer plan take seconds) give exactly what the direct counts give.

Each fast path is checked against the straightforward computation it replaced, written out here, on a real
profile (a 2-block GPT with dropout, AdamW, on a CPU and on an H100 target) and, for FSDP, with the GPT's
blocks as units. Equality is exact: same constraints in the same order, same bytes; the memory rows' running sums,
substituted, give each row the direct one's coefficients.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import highspy
import numpy as np
import pytest
from conftest import gpt_profile

from lightning_sac import ModelProfile, ModuleOpStats
from lightning_sac.sharding.layout import FSDPUnit, ShardedLayout
from lightning_sac.solver import knapsack
from lightning_sac.solver.candidates import _Transient, _transient_line, find_candidates, related
from lightning_sac.solver.highs import integer_start, new_highs
from lightning_sac.solver.memory_model import (
    MemoryConstraint,
    _held,
    backward_ends,
    checkpoint_state_bytes,
    device_model,
    memory_constraints,
    peak_with_plan,
)
from lightning_sac.solver.recompute import recompute_costs, recompute_transient
from lightning_sac.solver.rows import MIB, Milp, add_candidates, clean, memory_rows, related_pairs
from lightning_sac.solver.sharded_memory import ShardedStep
from lightning_sac.solver.tradeoff import (
    _MAX_EXHAUSTIVE_FITS,
    _fit_lines,
    _fit_with_breaks,
    effective_memory,
    module_tradeoff,
)


@pytest.fixture(scope="module", params=["cpu", "H100-SXM"])
def profile(request: pytest.FixtureRequest) -> ModelProfile:
    return gpt_profile(request.param)


def with_block_units(profile: ModelProfile) -> ModelProfile:
    """The profile as if each GPT block were an FSDP2 unit under a root unit that keeps the rest, on 4 ranks."""
    blocks = [fqn for fqn in profile.modules if fqn.startswith("blocks.") and fqn.count(".") == 1]
    assert len(blocks) == 2
    units = [FSDPUnit("", 4096, 16384, 16384, 16384, 4096, 16384, reshard_after_forward=False)]
    for fqn in blocks:
        size = profile.modules[fqn].parameter_bytes
        units.append(FSDPUnit(fqn, size // 4, size, size, size, size // 4, size))
    return replace(profile, sharded=ShardedLayout("fsdp2", 4, units))


def direct_memory_constraints(
    profile: ModelProfile, windows: Mapping[str, tuple[int, int]], world_size: int, sharding: str
) -> list[MemoryConstraint]:
    """memory_constraints as it was written first: every candidate asked at every timeline index."""
    worst: dict[Any, int] = {}
    first: dict[Any, int] = {}  # the first timeline index of each
    fsdp = ShardedStep(profile, profile.sharded) if sharding == "sharded" and profile.sharded is not None else None
    on_device = fsdp.bytes_at if fsdp is not None else device_model(profile, world_size, sharding)
    ends = backward_ends(profile)
    # A CPU checkpoint keeps the generator state it stashed from its forward's start to its backward's end.
    state = checkpoint_state_bytes(profile)
    starts = {e.name: k for k, e in reversed(list(enumerate(profile.timeline))) if e.kind == "fwd_pre"}
    # Each storage a checkpoint keeps, by the event that frees it (the generator state: each checkpoint's own).
    storages: dict[Any, tuple[int, int, set[str]]] = {}
    for j in windows:
        for d, n in _held(profile.modules[j]):
            storages.setdefault(("", d), (d, n, set()))[2].add(j)
        if state:
            storages[(j, -1)] = (starts[j], state, {j})
    gathers = {j for j in windows if fsdp is not None and fsdp.units_inside(j)}

    def add(base: int, absent: frozenset[str], recompute: str | None, at: int) -> None:
        by_holders: dict[tuple[str, ...], int] = {}
        for d, n, holders in storages.values():
            active = tuple(sorted(j for j in holders if at < ends.get(j, len(profile.timeline))))
            if d <= at and active:  # kept once, under the holders whose backward is not over
                by_holders[active] = by_holders.get(active, 0) + n
        for j in sorted(gathers):
            if b := fsdp.recompute_gathers(j, at):  # type: ignore[union-attr]
                by_holders[(j,)] = by_holders.get((j,), 0) + b
        kept = tuple(sorted(by_holders.items()))
        key = (absent, recompute, kept)
        worst[key] = max(worst.get(key, base), base)
        first.setdefault(key, at)

    for k, event in enumerate(profile.timeline):
        absent = frozenset(j for j, (e, b) in windows.items() if e <= k < b)
        add(on_device(k, event.peak_after or event.at), absent, None, k)
        if fsdp is not None:
            add(on_device(k, event.at, moment=True), absent, None, k)
    for j, (_, begin) in windows.items():
        absent = frozenset(i for i, (e, b) in windows.items() if e <= begin < b)
        add(on_device(begin, profile.timeline[begin].at, moment=True), absent, j, begin)
    return [MemoryConstraint(base, *key, at=first[key]) for key, base in worst.items()]


@pytest.mark.parametrize("sharding", ["replicated", "sharded", "sharded by units"])
def test_memory_constraints_are_the_direct_count(profile: ModelProfile, sharding: str) -> None:
    if sharding == "sharded by units":
        profile, sharding = with_block_units(profile), "sharded"
    windows = {c.fqn: c.window for c in find_candidates(profile)}
    assert len(windows) >= 6
    fast = memory_constraints(profile, windows, world_size=4, sharding=sharding)
    assert fast == direct_memory_constraints(profile, windows, 4, sharding)
    assert any(c.kept for c in fast) and len({c.absent for c in fast}) > 3  # the sweeps had work to do


def test_recompute_gathers_series_is_recompute_gathers_at_each_moment(profile: ModelProfile) -> None:
    fsdp = ShardedStep(profile, with_block_units(profile).sharded)  # type: ignore[arg-type]
    nonzero = 0
    for fqn in profile.modules:
        series = fsdp.recompute_gathers_series(fqn)
        assert series == [fsdp.recompute_gathers(fqn, k) for k in range(len(profile.timeline))]
        nonzero += any(series)
    assert nonzero == 1 and any(fsdp.recompute_gathers_series(""))  # only the root contains units


def direct_transient_line(stats: ModuleOpStats, bound: int, backend: str) -> tuple[float, float]:
    """_transient_line as it was written first: the transient recounted at every point of the greedy order."""
    tradeoff = module_tradeoff(stats)
    policy = [0 if i in stats.view_like_ops else 1 for i in range(len(stats.func_names))]
    base = float(recompute_transient(stats, policy, backend) or 0)
    points = []
    for unit, (discard, _) in zip(tradeoff.order, tradeoff.curve[1:], strict=True):
        for i in unit.ops:
            policy[i] = 0
        if discard > 0:
            points.append(((recompute_transient(stats, policy, backend) or 0) - base) / discard)
    slope = max(points, default=0.0)
    if tradeoff.max_discard > 0:
        slope = min(slope, (bound - base) / tradeoff.max_discard)
    return base, slope


@pytest.mark.parametrize("backend", ["sac", "graph"])
def test_transient_line_is_the_recount_at_every_point(profile: ModelProfile, backend: str) -> None:
    checked = 0
    for m in profile.modules.values():
        stats = m.op_stats
        if stats is None or not module_tradeoff(stats).order:
            continue
        bound = recompute_transient(stats, None, backend)
        assert bound is not None
        line = _transient_line(stats, module_tradeoff(stats), bound, backend)
        assert line == direct_transient_line(stats, bound, backend)
        checked += line[1] != 0
    assert checked >= 3


def test_transient_line_of_frees_before_and_at_the_op_that_made_them() -> None:
    # Op 2's storage is freed when op 2 itself runs (no span); op 3's is "freed" (index 1) before op 3 makes it
    # (index 3), so the running total dips over [1, 3). Op 5 is stateful (never recomputed, a saved temporary of
    # 1000 bytes); op 4 is the module's output (rerun: a second copy of 10 bytes). Keeping everything, the saved
    # temporaries are 1750 bytes. Recomputing ops 3, 1, 0, 2, 4 in that order (most bytes first), the highest
    # running total is 1350 (op 3 no longer saved), 1150, 1150 (op 0's 100 back at index 0), 1100, then 1110.
    # Everything rerun (the bound, op 5 included): 0 before the rerun, 1100 once op 5 reruns, plus 10.
    stats = ModuleOpStats(
        func_names=[f"op{i}" for i in range(6)],
        runtimes=[1.0] * 6,
        memory=[100, 200, 50, 400, 10, 1000],
        freed_at=[6, 3, 2, 1, -1, 6],
        stateful_ops=[5],
        output_ops=[4],
        recompute_stop=6,
    )
    tradeoff = module_tradeoff(stats)
    assert [u.ops for u in tradeoff.order] == [(3,), (1,), (0,), (2,), (4,)]
    bound = recompute_transient(stats, None, "sac")
    assert bound == 1100 + 10
    live = _Transient(stats, [1] * 6, "sac")
    seen = [live.value()]
    for unit in tradeoff.order:
        live.recompute(unit.ops[0])
        seen.append(live.value())
    assert seen == [1750, 1350, 1150, 1150, 1100, 1110]
    line = _transient_line(stats, tradeoff, bound, "sac")
    assert line == direct_transient_line(stats, bound, "sac")
    # From 1750, the steepest of the points' slopes (each point's discard is on the curve) reaching the bound.
    slopes = [(t - 1750) / d for t, (d, _) in zip(seen[1:], tradeoff.curve[1:], strict=True)]
    assert line == (1750.0, min(max(slopes), (1110 - 1750) / tradeoff.max_discard))


def test_knapsack_is_solved_once_per_distinct_module_and_budget(profile: ModelProfile) -> None:
    stats = next(m.op_stats for fqn, m in profile.modules.items() if fqn == "blocks.0")
    twin = next(m.op_stats for fqn, m in profile.modules.items() if fqn == "blocks.1")
    assert stats is not None and twin is not None and stats == twin  # identical blocks, identical stats
    knapsack._CACHE.clear()
    first = knapsack.optimal_op_policy(stats, 0.5)
    first[0] = 7  # the caller's list is its own
    assert knapsack.optimal_op_policy(twin, 0.5) == knapsack._solve_knapsack(twin, 0.5, *_effective_and_costs(twin))
    assert len(knapsack._CACHE) == 1
    knapsack.optimal_op_policy(stats, 0.25)
    assert len(knapsack._CACHE) == 2


def _effective_and_costs(stats: ModuleOpStats) -> tuple[list[int], list[float]]:
    return effective_memory(stats), recompute_costs(stats)


def test_related_pairs_are_every_nested_pair_in_order(profile: ModelProfile) -> None:
    cands = find_candidates(profile)
    direct = [(i, j) for i, a in enumerate(cands) for j, b in enumerate(cands) if i < j and related(a.fqn, b.fqn)]
    assert related_pairs(cands) == direct
    assert len(direct) >= 5


def direct_rows(h: highspy.Highs, cands: Any, constraints: Any, y: Any, r: Any, limit: Any, bound: bool) -> None:
    """The memory rows as operator expressions, as lightning_sac.solver first built them."""
    by_fqn = {c.fqn: c for c in cands}
    groups = {tuple(j for j in holders if j in by_fqn) for con in constraints for holders, _ in con.kept}
    shared = {holders: h.addVariable(lb=0.0, ub=1.0) for holders in sorted(g for g in groups if len(g) > 1)}
    for holders, z in shared.items():
        for j in holders:
            h.addConstr(z >= y[j])
    for con in constraints:
        terms = []
        for j in con.absent:
            if j in by_fqn:
                acm = by_fqn[j].tradeoff.total_memory
                terms.append(clean(acm / MIB) * r[j] - clean((acm - by_fqn[j].retained) / MIB) * y[j])
        extras = []
        for holders, b in con.kept:
            among = tuple(j for j in holders if j in by_fqn)
            if among:  # a storage several candidates keep: once, when any of them is checkpointed
                extras.append(b / MIB * (y[among[0]] if len(among) == 1 else shared[among]))
        if con.recompute in by_fqn:
            c, j = by_fqn[con.recompute], con.recompute
            if bound:
                extras.append(c.transient / MIB * y[j])
            else:
                base, slope = c.transient_line
                extras += [clean(base / MIB) * y[j], clean(slope / MIB) * r[j]]
        if terms or extras:
            h.addConstr(con.base / MIB - h.qsum(terms) + h.qsum(extras) <= limit)


def row_expressions(h: highspy.Highs, n_vars: int) -> list[tuple[dict[int, float], float, float]]:
    """Each inequality row as ``(coefficients over the first n_vars columns, lower, upper)``, the running variables
    of memory_rows (the columns from n_vars on) replaced by the sums their equality rows make them; a row bounded
    below only is negated."""
    h.ensureRowwise()
    lp = h.getLp()
    a = lp.a_matrix_
    start, index, value = (np.asarray(v) for v in (a.start_, a.index_, a.value_))
    running: dict[int, dict[int, float]] = {}

    def substituted(entries: list[tuple[int, float]]) -> dict[int, float]:
        expr: dict[int, float] = {}
        for col, v in entries:
            for c, w in running[col].items() if col in running else [(col, 1.0)]:
                expr[c] = expr.get(c, 0.0) + v * w
        return expr

    rows = []
    for i in range(lp.num_row_):
        span = slice(start[i], start[i + 1])
        entries = list(zip(index[span].tolist(), value[span].tolist(), strict=True))
        new, one = max(entries)  # a running variable's row is the first to hold it, with coefficient 1
        if lp.row_lower_[i] == lp.row_upper_[i] == 0.0 and new >= n_vars and new not in running:
            assert one == 1.0
            running[new] = {c: -v for c, v in substituted([e for e in entries if e[0] != new]).items()}
        elif lp.row_upper_[i] == highspy.kHighsInf:  # ``peak >= expression``, as ``expression <= peak`` reads
            rows.append(({c: -v for c, v in substituted(entries).items()}, -highspy.kHighsInf, -lp.row_lower_[i]))
        else:
            rows.append((substituted(entries), lp.row_lower_[i], lp.row_upper_[i]))
    return rows


@pytest.mark.parametrize("bound", [True, False])
@pytest.mark.parametrize("limit", ["float", "variable"])
def test_memory_rows_are_the_model_expressions_give(profile: ModelProfile, bound: bool, limit: str) -> None:
    """memory_rows' running sums stand for the absent and kept terms: substituted, each row is the direct one."""
    profile = with_block_units(profile)
    cands = find_candidates(profile)
    constraints = memory_constraints(profile, {c.fqn: c.window for c in cands}, world_size=4, sharding="sharded")
    models = []
    for rows in (memory_rows, direct_rows):
        h = new_highs(time_limit_s=1.0, mip_gap=0.0)
        y, r, _ = add_candidates(h, cands)
        peak = h.addVariable(lb=0.0) if limit == "variable" else 1234.5
        n_vars = h.getNumCol()
        rows(h, cands, constraints, y, r, peak, bound)
        models.append(row_expressions(h, n_vars))
    fast, direct = models
    assert len(fast) == len(direct) > 2 * len(cands)  # memory rows were added, one for each direct one
    for (expr, lo, up), (want, want_lo, want_up) in zip(fast, direct, strict=True):
        assert lo == want_lo and up == pytest.approx(want_up, rel=1e-12, abs=1e-9)
        cols = {c for c, v in {**expr, **want}.items() if abs(v) > 1e-9}
        assert {c: pytest.approx(expr.get(c, 0.0), abs=1e-9) for c in cols} == {c: want.get(c, 0.0) for c in cols}


def pwlf_exhaustive_fit(x: np.ndarray, y: np.ndarray, n_segments: int) -> tuple[list[float], list[float], list[float]]:
    """_fit_lines' exhaustive search as it was written first: pwlf's fit_with_breaks at every choice of breaks."""
    import pwlf

    model = pwlf.PiecewiseLinFit(x, y)
    best: tuple[float, list[float]] | None = None
    for inner in itertools.combinations(x[1:-1], n_segments - 1):
        breaks = [float(x[0]), *map(float, inner), float(x[-1])]
        ssr = float(model.fit_with_breaks(breaks))
        if best is None or ssr < best[0] - 1e-15:
            best = (ssr, breaks)
    assert best is not None
    model.fit_with_breaks(best[1])
    return list(map(float, model.slopes)), list(map(float, model.intercepts)), list(map(float, model.fit_breaks))


@pytest.mark.parametrize("n_segments", [1, 2, 3])
def test_fits_are_pwlfs_to_the_bit(profile: ModelProfile, n_segments: int) -> None:
    """The trade-off fits, without pwlf where every choice of breaks is tried, are those pwlf gives."""
    checked = 0
    for m in profile.modules.values():
        curve = module_tradeoff(m.op_stats).curve if m.op_stats is not None else []
        if len(curve) - 1 <= n_segments or math.comb(len(curve) - 2, n_segments - 1) > _MAX_EXHAUSTIVE_FITS:
            continue
        x, y = (np.array(v) for v in zip(*curve, strict=True))
        assert _fit_lines(x, y, n_segments) == pwlf_exhaustive_fit(x, y, n_segments)
        checked += 1
    assert checked >= 3


def test_a_milp_built_once_is_the_milp_built_at_each_limit_and_starts_from_the_last_plan(profile: ModelProfile) -> None:
    cands = find_candidates(profile)
    constraints = memory_constraints(profile, {c.fqn: c.window for c in cands}, world_size=1, sharding="replicated")
    unconstrained = peak_with_plan(constraints, {}, {}) / MIB
    limits = [0.9 * unconstrained, 0.8 * unconstrained]
    milp = Milp(cands, constraints, ({}, {}, {}), bound=True)
    objectives = []
    start = None
    for limit in limits:
        h = new_highs(time_limit_s=10.0, mip_gap=1e-2)
        y, r = milp.at(limit, h)
        direct = new_highs(time_limit_s=10.0, mip_gap=1e-2)
        dy, dr, rc = add_candidates(direct, cands)
        memory_rows(direct, cands, constraints, dy, dr, limit, bound=True)
        direct.setObjective(direct.qsum(rc), highspy.ObjSense.kMinimize)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(lp_arrays(h), lp_arrays(direct), strict=True))
        assert y == {j: v.index for j, v in dy.items()} and r == {j: v.index for j, v in dr.items()}
        if start is not None:  # the first plan's candidates, as solve_plan's next solve starts
            h.setSolution(len(start[0]), *start)
        h.run()
        assert h.getModelStatus() == highspy.HighsModelStatus.kOptimal
        start = integer_start(h)
        assert len(start[0]) >= len(cands) and set(start[1].tolist()) <= {0.0, 1.0}
        direct.run()
        objectives.append((h.getInfo().objective_function_value, direct.getInfo().objective_function_value))
    (first, first_direct), (second, second_direct) = objectives
    assert first == first_direct and 0 < first < second  # the lower limit costs more recompute
    assert second == pytest.approx(second_direct, rel=1e-2)  # within the MIP gap of the solve from nothing


def lp_arrays(h: highspy.Highs) -> list[np.ndarray]:
    """The model's arrays, its matrix by rows with each row's entries in column order (as a model passed whole)."""
    h.ensureRowwise()
    lp = h.getLp()
    a = lp.a_matrix_
    start, index, value = (np.asarray(v) for v in (a.start_, a.index_, a.value_))
    order = np.concatenate([start[i] + np.argsort(index[start[i] : start[i + 1]]) for i in range(lp.num_row_)])
    arrays = (start, index[order], value[order], lp.row_lower_, lp.row_upper_, lp.col_cost_, lp.col_upper_)
    return [np.asarray(v) for v in arrays]


def test_two_lines_over_thousands_of_points_break_where_trying_every_point_does() -> None:
    """Past _MAX_EXHAUSTIVE_FITS points the one inner break comes from suffix sums: where the direct fits break best."""
    rng = np.random.default_rng(0)
    n = _MAX_EXHAUSTIVE_FITS + 100
    x = np.concatenate([[0.0], np.cumsum(rng.random(n))])
    y = np.concatenate([[0.0], np.cumsum(np.sort(rng.random(n) ** 3))])
    x, y = x / x[-1], y / y[-1]
    direct = [_fit_with_breaks(x, y, [x[0], b, x[-1]])[0] for b in x[1:-1]]
    slopes, intercepts, breaks = _fit_lines(x, y, 2)
    assert breaks == [0.0, float(x[1:-1][int(np.argmin(direct))]), 1.0]
    assert len(slopes) == 2 and slopes[0] * breaks[1] + intercepts[0] == pytest.approx(
        slopes[1] * breaks[1] + intercepts[1], abs=1e-12
    )  # continuous at the break
