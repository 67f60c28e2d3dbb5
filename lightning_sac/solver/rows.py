"""The MILP of :func:`~lightning_sac.solver.milp.solve_plan`: its variables, and its rows, in MiB.

Per candidate a binary ``y`` (checkpointed?), a discard ratio ``r`` and its recompute cost (the trade-off fit's
lines); one row per pair of nested candidates; and one memory row per moment of the step
(:mod:`lightning_sac.solver.memory_model`), through a running variable per distinct set of absent candidates and
kept inputs (:func:`memory_rows`). :class:`Milp` builds it once for every limit it is solved at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import highspy
import numpy as np

from lightning_sac.solver.candidates import Candidate
from lightning_sac.solver.memory_model import Kept, MemoryConstraint

__all__ = ["MIB", "Milp", "add_candidates", "clean", "memory_rows", "related_pairs"]

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
) -> np.ndarray:
    """Add the memory rows and return their indices; a recompute's transient is its bound, or its line (``bound``).

    Each row is ``base - sum(freed) + sum(kept) + transient <= limit_mib`` (a number, or a variable), where a
    checkpointed candidate frees ``retained - (1 - r) * ACM`` (0 when not checkpointed: ``ACM * r - (ACM - retained)
    * y``, linear). The candidates absent and the inputs kept change at few moments of the step, while at most
    moments most of the model's candidates are absent: ``- sum(freed) + sum(kept)`` is a continuous variable per
    distinct set of them, tied to that of the moment before by a row of what changed between the two (in the order
    of the step). A memory row then holds that variable and its transient, not a term per absent candidate: an
    80-layer model's MILP has 1/50 of the entries it would have, and HiGHS solves it about 20 times faster. The rows
    and variables go to HiGHS in one call each.
    """
    by_fqn = {c.fqn: c for c in cands}
    names = frozenset(by_fqn)
    # Per candidate, the entries of ``-freed``: r's ``-ACM`` and y's ``ACM - retained``, in MiB.
    negated_freed = {}
    for c in cands:
        acm = c.tradeoff.total_memory
        negated_freed[c.fqn] = ((r[c.fqn].index, -clean(acm / MIB)), (y[c.fqn].index, clean((acm - c.retained) / MIB)))

    kept_of: dict[Kept, Kept] = {}  # consecutive moments share one

    def held_key(con: MemoryConstraint) -> tuple[frozenset[str], Kept]:
        """What of ``con`` the variable stands for: its absent candidates and kept inputs among ``cands``."""
        absent = con.absent if con.absent <= names else con.absent & names
        if con.kept not in kept_of:
            kept: dict[tuple[str, ...], int] = {}
            for holders, b in con.kept:
                if among := tuple(j for j in holders if j in names):
                    kept[among] = kept.get(among, 0) + b
            kept_of[con.kept] = tuple(sorted(kept.items()))
        return absent, kept_of[con.kept]

    rows = _Rows()
    # An input several candidates keep counts once: a variable at least each holder's y (the MILP keeps it at
    # their largest, since it only adds memory), one per set of holders.
    shared = sorted({hs for con in constraints for hs, _ in held_key(con)[1] if len(hs) > 1})
    first_shared = h.getNumCol()
    keeps = {holders: first_shared + i for i, holders in enumerate(shared)}
    if shared:
        h.addVars(len(shared), np.zeros(len(shared)), np.ones(len(shared)))
        for holders, column in keeps.items():
            for j in holders:
                rows.add({column: 1.0, y[j].index: -1.0}, 0.0, highspy.kHighsInf)

    def keeper(holders: tuple[str, ...]) -> int:
        return y[holders[0]].index if len(holders) == 1 else keeps[holders]

    first = h.getNumCol()
    held: dict[tuple[frozenset[str], Kept], int] = {}  # (absent, kept) -> its column
    last_absent: frozenset[str] = frozenset()
    last_kept: dict[tuple[str, ...], int] = {}
    for con in sorted(constraints, key=lambda c: c.at):
        key = held_key(con)
        if key in held or key == (frozenset(), ()):
            continue
        absent, kept = key[0], dict(key[1])
        change: dict[int, float] = {}
        for sign, js in ((1.0, absent - last_absent), (-1.0, last_absent - absent)):
            for j in js:
                for col, v in negated_freed[j]:
                    change[col] = change.get(col, 0.0) + sign * v
        for holders in kept.keys() | last_kept.keys():
            if (d := kept.get(holders, 0) - last_kept.get(holders, 0)) != 0:
                col = keeper(holders)
                change[col] = change.get(col, 0.0) + d / MIB
        column = first + len(held)
        entries = {column: 1.0} | ({column - 1: -1.0} if held else {})
        rows.add(entries | {col: -v for col, v in change.items() if clean(v)}, 0.0, 0.0)
        held[key] = column
        last_absent, last_kept = absent, kept
    variable = not isinstance(limit_mib, (int, float))
    limited: list[int] = []  # the memory rows, among ``rows``
    for con in constraints:
        entries = {}
        key = held_key(con)
        if key in held:
            entries[held[key]] = 1.0
        if con.recompute in by_fqn:
            c, j = by_fqn[con.recompute], con.recompute
            if bound:
                entries[y[j].index] = c.transient / MIB
            else:
                base, slope = c.transient_line
                entries[y[j].index], entries[r[j].index] = clean(base / MIB), clean(slope / MIB)
        if not entries:
            continue  # constant rows are checked before solving
        limited.append(len(rows.lower))
        if variable:
            rows.add(entries | {limit_mib.index: -1.0}, -highspy.kHighsInf, -con.base / MIB)
        else:
            rows.add(entries, -highspy.kHighsInf, limit_mib - con.base / MIB)
    if held:
        h.addVars(len(held), np.full(len(held), -highspy.kHighsInf), np.full(len(held), highspy.kHighsInf))
    first_row = h.getNumRow()
    rows.pass_to(h)
    return first_row + np.asarray(limited, dtype=np.int32)


class _Rows:
    """Rows gathered for one ``addRows`` call: bounds, and entries by row (zero entries left out)."""

    def __init__(self) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.starts: list[int] = []
        self.index: list[int] = []
        self.value: list[float] = []

    def add(self, entries: dict[int, float], lower: float, upper: float) -> None:
        self.starts.append(len(self.index))
        for col, v in entries.items():
            if v != 0.0:
                self.index.append(col)
                self.value.append(v)
        self.lower.append(lower)
        self.upper.append(upper)

    def pass_to(self, h: highspy.Highs) -> None:
        if self.lower:
            h.addRows(
                len(self.lower),
                np.asarray(self.lower, dtype=np.float64),
                np.asarray(self.upper, dtype=np.float64),
                len(self.index),
                np.asarray(self.starts, dtype=np.int32),
                np.asarray(self.index, dtype=np.int32),
                np.asarray(self.value, dtype=np.float64),
            )


@dataclass
class Milp:
    """The MILP of :func:`~lightning_sac.solver.milp.solve_plan`: the least recompute within a memory limit.

    Built once, at its first limit, and handed to HiGHS again for each other limit: only the bounds of its memory rows
    change with it.

    Args:
        cands: The candidates.
        constraints: The memory constraints.
        costs: ``(fixed_ms, factor, whole_ms)`` of :func:`add_candidates`.
        bound: Whether a recompute's transient is its bound (:func:`memory_rows`).
    """

    cands: list[Candidate]
    constraints: list[MemoryConstraint]
    costs: tuple[dict[str, float], dict[str, float], dict[str, float]]
    bound: bool
    _built: tuple[highspy.HighsModel, dict[str, int], dict[str, int], np.ndarray, np.ndarray] | None = None

    def at(self, limit_mib: float, h: highspy.Highs) -> tuple[dict[str, int], dict[str, int]]:
        """Pass the MILP with the memory limit ``limit_mib`` to ``h``; the columns of each candidate's y and r."""
        if self._built is None:
            y, r, rc = add_candidates(h, self.cands, *self.costs)
            rows = memory_rows(h, self.cands, self.constraints, y, r, 0.0, bound=self.bound)
            h.setObjective(h.qsum(rc), highspy.ObjSense.kMinimize)
            upper = np.asarray(h.getLp().row_upper_, dtype=np.float64)[rows]
            columns = ({j: v.index for j, v in y.items()}, {j: v.index for j, v in r.items()})
            self._built = (h.getModel(), *columns, rows, upper)
        model, y_cols, r_cols, rows, upper = self._built
        h.passModel(model)
        # (-base) + limit: the bound memory_rows gives at this limit, to the bit
        for i, bound in zip(rows.tolist(), (upper + limit_mib).tolist(), strict=True):
            h.changeRowBounds(i, -highspy.kHighsInf, bound)
        return y_cols, r_cols
