"""``solve_plan``: which modules to checkpoint, and how much of each to discard, at the least recompute."""

from __future__ import annotations

import fnmatch
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import highspy

from lightning_sac.errors import BudgetError
from lightning_sac.plan import ModuleDecision, Plan, profile_fingerprint
from lightning_sac.profiling.data import ModelProfile, ModuleOpStats, ModuleProfile
from lightning_sac.recompute import (
    check_backend,
    fixed_overhead_ms,
    output_op,
    overhead_ms,
    recompute_ms,
    rerun_output_bytes,
)
from lightning_sac.solver.highs import new_highs
from lightning_sac.solver.knapsack import optimal_op_policy
from lightning_sac.solver.memory_model import (
    MemoryConstraint,
    activation_windows,
    constant_floor,
    memory_constraints,
    peak_with_plan,
)
from lightning_sac.tradeoff import ModuleTradeoff, effective_memory, module_tradeoff

__all__ = ["Candidate", "excluded_reason", "find_candidates", "solve_plan"]

_GIB = 2**30
_MIB = 2**20
# Rows are in MiB; HiGHS's feasibility tolerance (1e-7) is then well under a byte. A KiB of margin keeps
# the plan's peak within the budget after rounding.
_MARGIN_MIB = 1 / 1024


@dataclass(frozen=True)
class Candidate:
    """A module the solver may checkpoint.

    Attributes:
        fqn: The module.
        window: Timeline indices of its forward's end and its backward's start.
        retained: Activation bytes its forward leaves alive without checkpointing, its output excluded.
        transient: Bytes its forward's temporaries add on top when it is recomputed, and a second copy of its
            output when the backend reruns the output op (:func:`~lightning_sac.recompute.rerun_output_bytes`,
            counted as recomputed: the bound the solver plans with; a plan's prediction uses its policy's).
        tradeoff: Its trade-off curve and fit.
    """

    fqn: str
    window: tuple[int, int]
    retained: int
    transient: int
    tradeoff: ModuleTradeoff

    @property
    def min_discard(self) -> float:
        """Smallest discard ratio that frees anything: below it, SAC would keep more than autograd did."""
        acm = self.tradeoff.total_memory
        return max(0.0, (acm - self.retained) / acm) if acm else 1.0

    def freed(self, discard: float) -> float:
        """Bytes freed at a discard ratio: what autograd kept minus what the policy saves."""
        return self.retained - (1.0 - discard) * self.tradeoff.total_memory


def _matches(m: ModuleProfile, candidates: Sequence[Any] | None) -> bool:
    if candidates is None:
        return True
    for c in candidates:
        if isinstance(c, str) and fnmatch.fnmatchcase(m.fqn, c):
            return True
        if isinstance(c, type) and c.__name__ == m.module_type:
            return True
    return False


def excluded_reason(profile: ModelProfile, fqn: str) -> str | None:
    """Why module ``fqn`` must not be checkpointed by a plan, or ``None``.

    A module that runs under the model's own checkpointing, contains such a module or lies inside one, or
    whose forward opens a checkpoint region itself, would be recomputed twice under nested regions that the
    profile's op lists do not describe; one called with a KV cache that holds tokens would update it twice.
    """
    for own in profile.checkpointed_modules:
        if _related(own, fqn):
            return f"already checkpointed by the model ({own or '<root>'})"
    for caller in profile.checkpoint_callers:
        if fqn == caller or fqn == "" or caller.startswith(fqn + "."):
            return f"contains the model's own checkpointing ({caller or '<root>'})"
    for holder in profile.kv_cache_with_tokens:
        if _related(holder, fqn):
            return f"called with a KV cache that holds tokens ({holder or '<root>'})"
    return None


def find_candidates(
    profile: ModelProfile, candidates: Sequence[Any] | None = None, n_segments: int = 2, backend: str = "sac"
) -> list[Candidate]:
    """Modules that can be checkpointed: with op stats, run once, with a backward, matching ``candidates``.

    Op stats exist for non-leaf modules and for leaves that run several allocating ops, such as ``nn.LSTM``.

    Modules that :func:`excluded_reason` names are left out.

    Args:
        profile: The profile.
        candidates: Module classes or fqn glob patterns (``"blocks.*"``); ``None`` allows every module.
        n_segments: Lines of each trade-off fit.
        backend: The backend the plan is for (what its recompute brings back).
    """
    if candidates is not None:
        bad = [c for c in candidates if not isinstance(c, (str, type))]
        if bad:
            raise TypeError(f"candidates must be module classes or fqn glob patterns, got {bad!r}.")
    windows = activation_windows(profile)
    found = []
    for fqn, m in profile.modules.items():
        if m.op_stats is None or m.calls != 1 or fqn not in windows or not _matches(m, candidates):
            continue
        if excluded_reason(profile, fqn) is not None:
            continue
        post, pre = m.memory["post_forward"], m.memory["pre_forward"]
        retained = max(0, post["activation"] - pre["activation"] - m.output_bytes)
        transient = _forward_temporaries(m)
        out = output_op(m.op_stats)
        # A free output op is always saved (the knapsack favours saving), so it is never rerun.
        if out is not None and (effective_memory(m.op_stats)[out] or out in m.op_stats.rand_ops):
            transient += rerun_output_bytes(m.op_stats, None, backend)
        tradeoff = module_tradeoff(m.op_stats, n_segments)
        if tradeoff.total_memory == 0 or retained == 0:
            continue  # nothing to free
        found.append(Candidate(fqn, windows[fqn], retained, transient, tradeoff))
    return found


def _more_candidates(profile: ModelProfile) -> str:
    """The end of a BudgetError's advice: how more modules could be checkpointed."""
    own = profile.checkpointed_modules or profile.checkpoint_callers
    if not own:
        return ", or allow more checkpoint candidates."
    names = ", ".join(f or "<root>" for f in own[:3]) + (", ..." if len(own) > 3 else "")
    text = (
        f". The model already checkpoints {len(own)} module(s) itself ({names}), and lightning-sac plans around "
        "them: it checkpoints no module that is, contains or lies inside one."
    )
    if profile.checkpointing_flags:
        return text + (
            " To let lightning-sac choose instead, turn Hugging Face's checkpointing off "
            "(model.gradient_checkpointing_disable()) or pass replace_existing=True (AutoSAC, profile_model)."
        )
    return text + " To let lightning-sac choose instead, remove the model's own torch.utils.checkpoint calls."


def _forward_temporaries(m: ModuleProfile) -> int:
    """Bytes the module's forward allocates and frees again: its recompute brings them back too."""
    return max(0, sum(m.memory["peak_forward"].values()) - sum(m.memory["post_forward"].values()))


def _op_stats(profile: ModelProfile, fqn: str) -> ModuleOpStats:
    stats = profile.modules[fqn].op_stats
    assert stats is not None  # candidates are modules with op stats
    return stats


def _clean(coefficient: float) -> float:
    return 0.0 if abs(coefficient) < 1e-9 else coefficient


def _related(a: str, b: str) -> bool:
    return a == "" or b == "" or b.startswith(a + ".") or a.startswith(b + ".")


def _build(
    h: highspy.Highs,
    cands: list[Candidate],
    fixed_ms: dict[str, float] | None = None,
    factor: dict[str, float] | None = None,
) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
    """Variables y (checkpoint?), r (discard ratio) and the recompute ms of each candidate, with the shared rows.

    ``fixed_ms`` is what wrapping a candidate costs whatever its policy (the backend's host overhead), and
    ``factor`` how much slower than the profile's op times its recompute runs (measured, default 1).
    """
    fixed_ms, factor = fixed_ms or {}, factor or {}
    y = {c.fqn: h.addBinary() for c in cands}
    r = {c.fqn: h.addVariable(lb=0.0, ub=1.0) for c in cands}
    rc = []
    # Costs in units of the largest module's runtime keep coefficients near 1 whatever the target's speed
    # (an H100 roofline gives microseconds); HiGHS refuses coefficients below 1e-9 rather than dropping them.
    unit = max((c.tradeoff.total_runtime for c in cands), default=1.0) or 1.0
    for c in cands:
        t = c.tradeoff
        h.addConstr(r[c.fqn] <= _clean(t.max_discard) * y[c.fqn])
        h.addConstr(r[c.fqn] >= _clean(c.min_discard) * y[c.fqn])
        cost = h.addVariable(lb=0.0)
        scale = t.total_runtime / unit * factor.get(c.fqn, 1.0)
        fixed = fixed_ms.get(c.fqn, 0.0) / unit
        for slope, intercept in zip(t.slopes, t.intercepts, strict=True):
            h.addConstr(cost >= _clean(scale * slope) * r[c.fqn] + _clean(scale * intercept + fixed) * y[c.fqn])
        rc.append(cost)
    for i, a in enumerate(cands):
        for b in cands[i + 1 :]:
            if _related(a.fqn, b.fqn):
                h.addConstr(y[a.fqn] + y[b.fqn] <= 1)
    return y, r, rc


def _freed_mib(c: Candidate, y: Any, r: Any) -> Any:
    # d = retained - (1 - r) * ACM when checkpointed, 0 otherwise; linear in (y, r).
    acm = c.tradeoff.total_memory
    return _clean(acm / _MIB) * r - _clean((acm - c.retained) / _MIB) * y


def _constraint_rows(
    h: highspy.Highs, cands: list[Candidate], constraints: list[MemoryConstraint], y: Any, r: Any, limit_mib: Any
) -> None:
    by_fqn = {c.fqn: c for c in cands}
    for con in constraints:
        terms = [_freed_mib(by_fqn[j], y[j], r[j]) for j in con.absent if j in by_fqn]
        extras = [b / _MIB * y[j] for j, b in con.kept if j in by_fqn]
        if con.recompute in by_fqn:
            extras.append(by_fqn[con.recompute].transient / _MIB * y[con.recompute])
        if not terms and not extras:
            continue  # constant rows are checked before solving
        h.addConstr(con.base / _MIB - h.qsum(terms) + h.qsum(extras) <= limit_mib)


def _minimum_peak(cands: list[Candidate], constraints: list[MemoryConstraint]) -> float:
    """The lowest peak any plan reaches, bytes (a MILP minimizing the peak instead of the recompute)."""
    h = new_highs(time_limit_s=30.0, mip_gap=1e-6)
    y, r, _ = _build(h, cands)
    peak = h.addVariable(lb=0.0)
    constant = constant_floor(constraints)
    h.addConstr(peak >= constant / _MIB)
    _constraint_rows(h, cands, constraints, y, r, peak)
    h.minimize(peak)
    return h.val(peak) * _MIB


def solve_plan(
    profile: ModelProfile,
    budget_gb: float,
    *,
    world_size: int = 1,
    sharding: str = "replicated",
    candidates: Sequence[Any] | None = None,
    n_segments: int = 2,
    time_limit_s: float = 30.0,
    mip_gap: float = 1e-2,
    backend: str = "sac",
) -> Plan:
    """Choose the modules to checkpoint and the share of each one's activations to discard.

    Minimizes the predicted recompute time subject to the step's predicted peak on one device staying within
    ``budget_gb`` GiB, counting parameters, gradients and optimizer state (divided by ``world_size`` when
    sharded) and activations, activation gradients and temporaries at every module boundary (see
    :mod:`lightning_sac.solver.memory_model`). A module is never checkpointed together with an ancestor or
    descendant. Each chosen module's discard ratio becomes an exact op policy (:func:`optimal_op_policy`).

    Args:
        profile: Profile of the training step on the target device.
        budget_gb: Memory budget per device, GiB.
        world_size: Devices the step runs on.
        sharding: ``"replicated"`` (DDP) or ``"sharded"`` (FSDP).
        candidates: Module classes or fqn glob patterns allowed as checkpoint units; default every non-leaf one.
        n_segments: Lines of each module's trade-off fit.
        time_limit_s: HiGHS time limit.
        mip_gap: HiGHS relative gap. 1% is well below the error of the trade-off fits, and proving the last
            0.1% among near-identical blocks can take HiGHS tens of seconds on a 32-block model.
        backend: How the plan will be applied, ``"sac"`` or ``"graph"`` (:func:`~lightning_sac.apply_plan`).
            Memory is the same for both; the predicted recompute counts what that backend reruns
            (:mod:`lightning_sac.recompute`). The choice itself optimizes the ``"sac"`` cost, an upper bound
            of the graph backend's.

    Raises:
        BudgetError: The budget is below the minimum achievable peak.
        ValueError: Invalid ``world_size``, ``sharding``, ``budget_gb`` or ``backend``.
    """
    start = time.perf_counter()
    check_backend(backend)
    if sharding not in ("replicated", "sharded"):
        raise ValueError(f"sharding must be 'replicated' or 'sharded', got {sharding!r}.")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}.")
    if not budget_gb > 0:
        raise ValueError(f"budget_gb must be positive, got {budget_gb}.")
    budget = int(budget_gb * _GIB)
    cands = find_candidates(profile, candidates, n_segments, backend)
    windows = {c.fqn: c.window for c in cands}
    constraints = memory_constraints(profile, windows, world_size=world_size, sharding=sharding)
    unconstrained = peak_with_plan(constraints, {}, {})
    plan = Plan(
        budget_bytes=budget,
        world_size=world_size,
        sharding=sharding,
        device=profile.device.name,
        backend=backend,
        unconstrained_peak_bytes=unconstrained,
        predicted_peak_bytes=unconstrained,
        predicted_step_ms=profile.step_ms,
        solver_status="Not needed",
        fingerprint=profile_fingerprint(profile),
        replaces_checkpointing=list(profile.replaced_checkpointing),
        kv_cache_off=bool(profile.kv_cache_off),
    )
    if unconstrained <= budget:
        plan.solver_seconds = time.perf_counter() - start
        return plan

    h = new_highs(time_limit_s=time_limit_s, mip_gap=mip_gap)
    # A profile that measured neither (a roofline one) charges no overhead: zero per op.
    per_op_us = profile.backend_overhead_us.get(backend, [0.0, 0.0])
    measured = {c.fqn: profile.modules[c.fqn].measured_overhead.get(backend) for c in cands}
    fixed_ms = {c.fqn: fixed_overhead_ms(_op_stats(profile, c.fqn), backend, per_op_us, measured[c.fqn]) for c in cands}
    factor = {fqn: m[1] for fqn, m in measured.items() if m}
    y, r, rc = _build(h, cands, fixed_ms, factor)
    constant = constant_floor(constraints)
    status = highspy.HighsModelStatus.kInfeasible
    if constant <= budget:
        _constraint_rows(h, cands, constraints, y, r, budget / _MIB - _MARGIN_MIB)
        h.minimize(h.qsum(rc))
        status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        minimum = _minimum_peak(cands, constraints)
        raise BudgetError(
            f"A budget of {budget_gb:.3f} GiB per device is below the minimum achievable peak of "
            f"{minimum / _GIB:.3f} GiB (the unconstrained peak is {unconstrained / _GIB:.3f} GiB on "
            f"{profile.device.name}, world size {world_size}, {sharding}). Raise the budget, use a smaller batch or "
            f"shorter sequences, shard parameters and optimizer state (sharding='sharded'){_more_candidates(profile)}",
            minimum_bytes=int(math.ceil(minimum)),
            unconstrained_bytes=unconstrained,
        )
    if status not in (highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kTimeLimit):
        raise RuntimeError(f"HiGHS could not solve the plan: {h.modelStatusToString(status)}.")
    if h.getInfo().primal_solution_status == 0:
        raise RuntimeError(f"HiGHS found no plan within time_limit_s={time_limit_s}; raise the time limit.")

    by_fqn = {c.fqn: c for c in cands}
    for fqn in [c.fqn for c in cands if h.val(y[c.fqn]) > 0.5]:
        c = by_fqn[fqn]
        discard = min(max(h.val(r[fqn]), c.min_discard), c.tradeoff.max_discard)
        stats = _op_stats(profile, fqn)
        policy = optimal_op_policy(stats, max(0.0, min(1.0, 1.0 - discard)))
        memory = effective_memory(stats)
        saved = sum(m for m, keep in zip(memory, policy, strict=True) if keep)
        if c.retained - saved <= 0:
            continue  # chosen at its minimum discard: wrapping it would cost time and free nothing
        plan.decisions[fqn] = ModuleDecision(
            discard_ratio=discard,
            op_policy=policy,
            recompute_ms=recompute_ms(stats, policy, backend),
            overhead_ms=overhead_ms(stats, policy, backend, per_op_us, measured[fqn]),
            freed_bytes=c.retained - saved,
            op_names=list(stats.func_names),
        )
    freed = {f: d.freed_bytes for f, d in plan.decisions.items()}
    # The recompute brings back an output copy only where the chosen policy reruns the output op.
    transient = {
        fqn: _forward_temporaries(profile.modules[fqn])
        + rerun_output_bytes(_op_stats(profile, fqn), d.op_policy, backend)
        for fqn, d in plan.decisions.items()
    }
    plan.predicted_peak_bytes = peak_with_plan(constraints, freed, transient)
    plan.predicted_recompute_ms = sum(d.recompute_ms for d in plan.decisions.values())
    plan.predicted_overhead_ms = sum(d.overhead_ms for d in plan.decisions.values())
    plan.predicted_step_ms = profile.step_ms + plan.predicted_recompute_ms + plan.predicted_overhead_ms
    plan.solver_status = h.modelStatusToString(status)
    plan.solver_gap = float(h.getInfo().mip_gap)
    plan.solver_seconds = time.perf_counter() - start
    return plan
