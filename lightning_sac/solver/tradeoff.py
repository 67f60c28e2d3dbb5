"""Per-module trade-off between activation memory discarded and runtime recomputed.

From a module's :class:`~lightning_sac.dryrun.data.ModuleOpStats`, ops are grouped into units that selective
checkpointing must save or recompute together, ordered greedily by memory freed per ms of recompute (MSPS),
and the cumulative order gives the trade-off curve: fraction of the module's op memory discarded -> fraction
of its op runtime recomputed. A piecewise-linear fit of that curve, shifted so that it never lies below it,
is what the module-level MILP uses, so the solver never underestimates recompute.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from lightning_sac.adapters import host_generators
from lightning_sac.dryrun import ModuleOpStats
from lightning_sac.solver.recompute import output_op, recompute_costs

__all__ = ["ModuleTradeoff", "RecomputeUnit", "effective_memory", "module_tradeoff", "recompute_units"]

# Exhaustive search over break points is exact and needs no random numbers; past this many candidate break
# combinations the search falls back to pwlf's fitfast with a fixed seed.
_MAX_EXHAUSTIVE_FITS = 2000

_CACHE: dict[str, ModuleTradeoff] = {}


@dataclass(frozen=True)
class RecomputeUnit:
    """Ops a SAC policy must save or recompute together.

    Attributes:
        ops: Op indices of the unit, sorted.
        memory: Bytes its outputs hold (see :func:`effective_memory`).
        runtime: What recomputing its ops costs, ms (:func:`~lightning_sac.solver.recompute.recompute_costs`).
    """

    ops: tuple[int, ...]
    memory: int
    runtime: float

    @property
    def msps(self) -> float:
        """Memory freed per ms of recompute; a unit that costs no time is the first to recompute."""
        return math.inf if self.runtime <= 0 else self.memory / self.runtime


@dataclass(kw_only=True)
class ModuleTradeoff:
    """The greedy trade-off of one module and its piecewise-linear fit.

    Attributes:
        total_memory: Sum of :func:`effective_memory`, bytes (the "100%" of discard ratios).
        total_runtime: Sum of the ops' recompute costs, ms (the "100%" of recompute fractions).
        stored: Units that must be saved (in-place on a storage from outside the module, stateful ops, random
            ops when forced, units holding no memory).
        order: Units in the order they are recomputed as more memory is discarded.
        curve: ``(discard fraction, recompute fraction)`` points, from ``(0, 0)`` along ``order``.
        slopes: Slope of each line of the fit.
        intercepts: Intercept of each line; the fit is the maximum of the lines, never below ``curve``.
        breaks: Break points of the fit along the discard axis.
    """

    total_memory: int
    total_runtime: float
    stored: list[RecomputeUnit] = field(default_factory=list)
    order: list[RecomputeUnit] = field(default_factory=list)
    curve: list[tuple[float, float]] = field(default_factory=list)
    slopes: list[float] = field(default_factory=list)
    intercepts: list[float] = field(default_factory=list)
    breaks: list[float] = field(default_factory=list)

    @property
    def max_discard(self) -> float:
        """Largest fraction of the module's op memory that can be discarded."""
        return self.curve[-1][0] if self.curve else 0.0

    def fit(self, discard: float) -> float:
        """The fitted recompute fraction at ``discard``: the maximum of the fit's lines (0 without a fit)."""
        if not self.slopes:
            return 0.0
        return max(s * discard + b for s, b in zip(self.slopes, self.intercepts, strict=True))


def effective_memory(stats: ModuleOpStats) -> list[int]:
    """Op memory as the trade-off counts it: the module's output op is free when its own backward keeps it.

    The output op is the last op that is neither a view nor in place
    (:func:`~lightning_sac.solver.recompute.output_op`).
    When an op of the module saves the module's output for backward (a ReLU saves its result:
    ``stats.output_saved_inside``), autograd keeps it until the module's backward anyway, so a checkpoint's cache
    keeping it costs nothing. A stateful output op (BatchNorm whose output an in-place ReLU returns) is always
    saved, so it does not count here either: the memory model keeps its output alive from when the plain step
    frees it (:attr:`ModuleProfile.freed_outputs`). Otherwise it is counted like any other op: when only the next
    module saves it (a residual stream read by the next norm), autograd frees it at that module's backward,
    earlier than the checkpoint's cache would, as measured.
    """
    memory = list(stats.memory)
    i = output_op(stats)
    if i is not None and (stats.output_saved_inside or i in stats.stateful_ops):
        memory[i] = 0
    return memory


def recompute_units(stats: ModuleOpStats, backend: str = "sac") -> tuple[list[RecomputeUnit], list[RecomputeUnit]]:
    """Group ops into units; return ``(candidates, stored)``. View-like ops belong to neither: always recomputed.

    In-place ops join the op that produced the storage they mutate, and an op that reads a tensor before an in-place
    op overwrites it joins the op that made it (``reads_before_overwrite``); all random ops form one unit, so that
    recompute replays the generator exactly; a unit is stored when it holds an in-place op on a storage from outside
    the module, a stateful op (one that writes state it does not return, which must not run twice), random ops with
    ``force_store_random``, or no memory at all.
    """
    n = len(stats.func_names)
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for op, head in [*stats.inplace_ops, *stats.reads_before_overwrite]:
        parent[find(op)] = find(head)
    for a, b in itertools.pairwise(stats.rand_ops):
        parent[find(b)] = find(a)
    memory = effective_memory(stats)
    costs = recompute_costs(stats, backend)
    views = set(stats.view_like_ops)
    own_storage = {op for op, head in stats.inplace_ops if op == head}
    stateful = set(stats.stateful_ops)
    groups: dict[int, list[int]] = {}
    for i in range(n):
        if i not in views:
            groups.setdefault(find(i), []).append(i)
    candidates: list[RecomputeUnit] = []
    stored: list[RecomputeUnit] = []
    for ops in groups.values():
        unit = RecomputeUnit(tuple(ops), sum(memory[i] for i in ops), sum(costs[i] for i in ops))
        forced = (
            bool(own_storage.intersection(ops))
            or bool(stateful.intersection(ops))
            or (stats.force_store_random and bool(set(stats.rand_ops) & set(ops)))
        )
        (stored if forced or unit.memory == 0 else candidates).append(unit)
    return candidates, stored


def _fit_with_breaks(x: np.ndarray, y: np.ndarray, breaks: list[float]) -> tuple[float, np.ndarray]:
    """The continuous piecewise-linear least-squares fit with these breaks: its squared residuals, its break values.

    pwlf's ``fit_with_breaks`` and ``predict``, without importing pwlf (and scipy, about 1-2 s): its regression
    matrix (a constant, ``x - breaks[0]``, and a hinge ``max(x - b, 0)`` at each inner break), solved by LAPACK's
    ``gelsd`` as pwlf's default asks; the residuals summed directly.
    """

    def matrix(at: np.ndarray) -> np.ndarray:
        hinges = [np.where(at > b, at - b, 0.0) for b in breaks[1:-1]]
        return np.vstack([np.ones_like(at), at - breaks[0], *hinges]).T

    a = matrix(x)
    beta = np.linalg.lstsq(a, y, rcond=None)[0]
    residuals = a @ beta - y
    return float(residuals @ residuals), matrix(np.asarray(breaks)) @ beta


def _best_break(x: np.ndarray, y: np.ndarray) -> int:
    """Which of ``x[1:-1]`` (ascending) as the one inner break gives the two-line fit of the least squared residuals.

    Each break's fit solves the normal equations of its regression matrix (``1``, ``u = x - x[0]``, the hinge
    ``h = max(x - b, 0)``), whose sums over the hinge's points are suffix sums: every break at once, in linear time.
    """
    u = x - x[0]
    b = x[1:-1]

    # Suffix sums over the points past each break (x ascending: those after it).
    def past(v: np.ndarray) -> np.ndarray:
        return np.cumsum(v[::-1])[::-1][2:]

    count, sx, sxx, sy, sxy = past(np.ones_like(x)), past(x), past(x * x), past(y), past(x * y)
    sh = sx - b * count
    shh = sxx - 2 * b * sx + b * b * count
    suh = sxx - (b + x[0]) * sx + x[0] * b * count
    shy = sxy - b * sy
    n = np.full_like(b, len(x))
    su, suu = np.full_like(b, u.sum()), np.full_like(b, (u * u).sum())
    gram = np.stack([np.stack([n, su, sh], -1), np.stack([su, suu, suh], -1), np.stack([sh, suh, shh], -1)], -2)
    rhs = np.stack([np.full_like(b, y.sum()), np.full_like(b, (u * y).sum()), shy], -1)
    beta = (np.linalg.pinv(gram) @ rhs[..., None])[..., 0]  # pinv: a hinge over tied last points is all zeros
    ssr = float(y @ y) - np.einsum("ij,ij->i", beta, rhs)
    return int(np.argmin(ssr))


def _fit_lines(x: np.ndarray, y: np.ndarray, n_segments: int) -> tuple[list[float], list[float], list[float]]:
    """Continuous piecewise-linear least-squares fit with breaks at curve points; returns slopes, intercepts, breaks."""
    n_segments = max(1, min(n_segments, len(x) - 1))
    interior = x[1:-1]
    exhaustive = math.comb(len(interior), n_segments - 1) <= _MAX_EXHAUSTIVE_FITS
    if exhaustive or n_segments == 2:
        breaks = [float(x[0]), float(x[-1])]
        if not exhaustive:  # one inner break among thousands of points: all of them at once
            breaks.insert(1, float(interior[_best_break(x, y)]))
        else:
            best: tuple[float, list[float]] | None = None
            for inner in itertools.combinations(interior, n_segments - 1):
                tried = [float(x[0]), *map(float, inner), float(x[-1])]
                ssr = _fit_with_breaks(x, y, tried)[0]
                if best is None or ssr < best[0] - 1e-15:
                    best = (ssr, tried)
            assert best is not None
            breaks = best[1]
        at_breaks = _fit_with_breaks(x, y, breaks)[1]
        b = np.asarray(breaks)
        slopes = np.diff(at_breaks) / np.diff(b)
        intercepts = at_breaks[:-1] - slopes * b[:-1]
        return list(map(float, slopes)), list(map(float, intercepts)), breaks
    import pwlf  # imports scipy: only a fit with too many breaks to try them all needs it

    with host_generators():  # pwlf seeds numpy's global generator; keep the user's stream as it was
        model = pwlf.PiecewiseLinFit(x, y, seed=0)
        model.fitfast(n_segments, pop=4)
    return list(map(float, model.slopes)), list(map(float, model.intercepts)), list(map(float, model.fit_breaks))


def _compute_tradeoff(stats: ModuleOpStats, n_segments: int, backend: str) -> ModuleTradeoff:
    candidates, stored = recompute_units(stats, backend)
    total_memory = sum(effective_memory(stats))
    total_runtime = float(sum(recompute_costs(stats, backend)))
    order = sorted(candidates, key=lambda u: (-u.msps, u.ops[0]))
    result = ModuleTradeoff(total_memory=total_memory, total_runtime=total_runtime, stored=stored, order=order)
    if total_memory == 0 or not order:
        result.curve = [(0.0, 0.0)]
        return result
    mem = np.cumsum([0] + [u.memory for u in order]) / total_memory
    run = np.cumsum([0.0] + [u.runtime for u in order]) / total_runtime if total_runtime > 0 else np.zeros(len(mem))
    result.curve = [(float(a), float(b)) for a, b in zip(mem, run, strict=True)]
    slopes, intercepts, breaks = _fit_lines(mem, run, n_segments)
    # Shift the fit up so that it is nowhere below the curve: the MILP must not underestimate recompute. Both
    # are linear between the curve's points and the fit's kinks, so checking at those points is exact.
    a, b = np.asarray(slopes), np.asarray(intercepts)
    kinks = [(b[j] - b[i]) / (a[i] - a[j]) for i in range(len(a)) for j in range(i + 1, len(a)) if a[i] != a[j]]
    xs = np.concatenate([mem, [k for k in kinks if 0.0 < k < mem[-1]]])
    deficit = float(np.max(np.interp(xs, mem, run) - np.max(np.outer(xs, a) + b, axis=1)))
    if deficit > 0:
        intercepts = [b + deficit for b in intercepts]
    result.slopes, result.intercepts, result.breaks = slopes, intercepts, breaks
    return result


def module_tradeoff(stats: ModuleOpStats, n_segments: int = 2, backend: str = "sac") -> ModuleTradeoff:
    """The greedy trade-off curve of a module and its fit with ``n_segments`` lines, reproducibly.

    The result is shared between calls with equal stats: treat it as read-only.

    Args:
        stats: The module's op statistics.
        n_segments: Lines of the piecewise-linear fit (fewer when the curve has fewer points).
        backend: The backend whose recompute costs the curve is of
            (:func:`~lightning_sac.solver.recompute.recompute_costs`).
    """
    if n_segments < 1:
        raise ValueError(f"n_segments must be at least 1, got {n_segments}.")
    # Identical blocks of a deep model have identical stats: they share one fit.
    # The costs stand for the runtimes and the op graph that decides what a recompute skips.
    key = repr((stats.memory, recompute_costs(stats, backend), stats.view_like_ops, stats.rand_ops, stats.inplace_ops))
    key += repr((stats.stateful_ops, stats.reads_before_overwrite, stats.force_store_random))
    key += repr((stats.recompute_stop, stats.output_ops, stats.output_saved_inside, n_segments))
    if key not in _CACHE:
        if len(_CACHE) >= 1024:
            _CACHE.clear()
        _CACHE[key] = _compute_tradeoff(stats, n_segments, backend)
    return _CACHE[key]
