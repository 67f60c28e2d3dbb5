"""The MILP of :func:`~lightning_sac.solver.milp.solve_plan`: its variables, and its rows, in MiB.

Per candidate a binary ``y`` (checkpointed?), a discard ratio ``r`` and its recompute cost (the trade-off fit's
lines); one row per pair of nested candidates; and one memory row per moment of the step
(:mod:`lightning_sac.solver.memory_model`).
"""

from __future__ import annotations

from typing import Any

import highspy
from highspy.highs import highs_linear_expression

from lightning_sac.solver.candidates import Candidate
from lightning_sac.solver.memory_model import MemoryConstraint

__all__ = ["MIB", "add_candidates", "clean", "memory_rows", "related_pairs"]

MIB = 2**20


def clean(coefficient: float) -> float:
    """0 for a coefficient HiGHS would refuse (below 1e-9 in size), else the coefficient."""
    return 0.0 if abs(coefficient) < 1e-9 else coefficient


def add_candidates(
    h: highspy.Highs,
    cands: list[Candidate],
    fixed_ms: dict[str, float] | None = None,
    factor: dict[str, float] | None = None,
    whole_ms: dict[str, float] | None = None,
) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
    """Variables y (checkpoint?), r (discard ratio) and the recompute ms of each candidate, with the shared rows.

    ``fixed_ms`` is what wrapping a candidate costs whatever its policy (the backend's host overhead), and
    ``factor`` how much slower than the profile's op times its recompute runs (measured, default 1).
    ``whole_ms`` is what a candidate costs in all at its largest discard when that policy saves nothing and so
    runs as a plain checkpoint (:mod:`lightning_sac.apply.sac`); where that is cheaper than the fit says, a
    binary ``w`` (at most ``y``, forcing the largest discard) takes the difference off its cost.
    """
    fixed_ms, factor, whole_ms = fixed_ms or {}, factor or {}, whole_ms or {}
    y = {c.fqn: h.addBinary() for c in cands}
    r = {c.fqn: h.addVariable(lb=0.0, ub=1.0) for c in cands}
    rc = []
    # Costs in units of the largest module's runtime keep coefficients near 1 whatever the target's speed
    # (an H100 roofline gives microseconds); HiGHS refuses coefficients below 1e-9 rather than dropping them.
    unit = max((c.tradeoff.total_runtime for c in cands), default=1.0) or 1.0
    for c in cands:
        t = c.tradeoff
        h.addConstr(r[c.fqn] <= clean(t.max_discard) * y[c.fqn])
        h.addConstr(r[c.fqn] >= clean(c.min_discard) * y[c.fqn])
        cost = h.addVariable(lb=0.0)
        scale = t.total_runtime / unit * factor.get(c.fqn, 1.0)
        fixed = fixed_ms.get(c.fqn, 0.0) / unit
        saving = 0.0
        if c.fqn in whole_ms:
            at_max = max((s * t.max_discard + b for s, b in zip(t.slopes, t.intercepts, strict=True)), default=0.0)
            saving = clean(scale * at_max + fixed - whole_ms[c.fqn] / unit)
        w = None
        if saving > 0:
            w = h.addBinary()
            h.addConstr(w <= y[c.fqn])
            h.addConstr(r[c.fqn] >= clean(t.max_discard) * w)
        for slope, intercept in zip(t.slopes, t.intercepts, strict=True):
            line = clean(scale * slope) * r[c.fqn] + clean(scale * intercept + fixed) * y[c.fqn]
            h.addConstr(cost >= (line - saving * w if w is not None else line))
        rc.append(cost)
    for i, j in related_pairs(cands):
        h.addConstr(y[cands[i].fqn] + y[cands[j].fqn] <= 1)
    return y, r, rc


def related_pairs(cands: list[Candidate]) -> list[tuple[int, int]]:
    """Index pairs ``i < j`` of candidates one of which contains the other (``candidates.related``), in order.

    Found through each candidate's enclosing names instead of testing every pair: hundreds of candidates.
    """
    position = {c.fqn: i for i, c in enumerate(cands)}
    pairs = set()
    for j, c in enumerate(cands):
        parts = c.fqn.split(".") if c.fqn else []
        for outer in ["", *(".".join(parts[:k]) for k in range(1, len(parts)))]:
            i = position.get(outer)
            if i is not None and i != j:
                pairs.add((min(i, j), max(i, j)))
    return sorted(pairs)


def memory_rows(
    h: highspy.Highs,
    cands: list[Candidate],
    constraints: list[MemoryConstraint],
    y: Any,
    r: Any,
    limit_mib: Any,
    bound: bool = True,
) -> None:
    """The memory rows; a recompute's transient is its bound, or (``bound=False``) its line in the discard ratio.

    Each row is ``base - sum(freed) + sum(extras) <= limit_mib``, where a checkpointed candidate frees
    ``retained - (1 - r) * ACM`` (0 when not checkpointed: ``ACM * r - (ACM - retained) * y``, linear). Its
    entries are listed directly, in the order those operator expressions list them, and handed to highspy as one
    expression: it sums a variable's repeated entries in that order, so HiGHS gets the same model to the bit,
    without the hundreds of thousands of small expressions an 80-layer model's rows took to build.
    """
    by_fqn = {c.fqn: c for c in cands}
    # Per candidate, the entries of ``-freed``: r's ``-ACM`` and y's ``ACM - retained``, in MiB.
    negated_freed = {}
    for c in cands:
        acm = c.tradeoff.total_memory
        ri, yi = r[c.fqn].index, y[c.fqn].index
        negated_freed[c.fqn] = (ri, yi, -clean(acm / MIB), clean((acm - c.retained) / MIB))
    for con in constraints:
        idxs: list[int] = []
        vals: list[float] = []
        for j in con.absent:
            if j in by_fqn:
                ri, yi, rv, yv = negated_freed[j]
                idxs += (ri, yi)
                vals += (rv, yv)
        for j, b in con.kept:
            if j in by_fqn:
                idxs.append(y[j].index)
                vals.append(b / MIB)
        if con.recompute in by_fqn:
            c, j = by_fqn[con.recompute], con.recompute
            if bound:
                idxs.append(y[j].index)
                vals.append(c.transient / MIB)
            else:
                base, slope = c.transient_line
                idxs += (y[j].index, r[j].index)
                vals += (clean(base / MIB), clean(slope / MIB))
        if not idxs:
            continue  # constant rows are checked before solving
        row = highs_linear_expression()
        row.idxs, row.vals = idxs, vals
        row.constant = (con.base / MIB - 0.0) + 0.0  # as ``base - qsum(...) + qsum(...)`` accumulates it
        h.addConstr(row <= limit_mib)
