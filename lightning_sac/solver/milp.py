"""``solve_plan``: which modules to checkpoint, and how much of each to discard, at the least recompute."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import highspy

from lightning_sac.adapters import sac_sees_outputs
from lightning_sac.dryrun import ModelProfile, profile_fingerprint, routing_bound_bytes
from lightning_sac.errors import BudgetError
from lightning_sac.plan import ModuleDecision, Plan, check_backend, device_reserve
from lightning_sac.solver.candidates import (
    Candidate,
    find_candidates,
    more_candidates_hint,
    op_stats,
)
from lightning_sac.solver.decisions import plan_decisions, plan_peak, whole_costs
from lightning_sac.solver.highs import new_highs
from lightning_sac.solver.masks import mask_fixed_ms, mask_unit
from lightning_sac.solver.memory_model import (
    MemoryConstraint,
    constant_floor,
    device_model,
    memory_constraints,
    peak_with_plan,
)
from lightning_sac.solver.recompute import fixed_overhead_ms
from lightning_sac.solver.rows import MIB as _MIB
from lightning_sac.solver.rows import add_candidates, memory_rows

__all__ = ["solve_plan"]

_GIB = 2**30
# Rows are in MiB (lightning_sac.solver.rows); HiGHS's feasibility tolerance (1e-7) is then well under a byte. A
# KiB of margin keeps the plan's peak within the budget after rounding.
_MARGIN_MIB = 1 / 1024
#: Up to how many candidate modules :func:`solve_plan` also tries a finer trade-off fit (a second solve).
REFINE_CANDIDATES = 64
# How often a plan whose own figures exceed the budget is solved again under a lower limit.
_TIGHTEN_ROUNDS = 3


def _minimum_peak(
    cands: list[Candidate], constraints: list[MemoryConstraint], bound: bool = True
) -> tuple[float, dict[str, float]]:
    """The lowest peak the MILP's figures reach, bytes, and the discard ratio of each candidate that plan checkpoints.

    A MILP minimizing the peak instead of the recompute.
    """
    h = new_highs(time_limit_s=30.0, mip_gap=1e-6)
    y, r, _ = add_candidates(h, cands)
    peak = h.addVariable(lb=0.0)
    constant = constant_floor(constraints)
    h.addConstr(peak >= constant / _MIB)
    memory_rows(h, cands, constraints, y, r, peak, bound=bound)
    h.minimize(peak)
    return h.val(peak) * _MIB, {c.fqn: h.val(r[c.fqn]) for c in cands if h.val(y[c.fqn]) > 0.5}


def _lowest_plan(
    profile: ModelProfile,
    cands: list[Candidate],
    constraints: list[MemoryConstraint],
    backend: str,
    per_op_us: list[float],
    measured: dict[str, list[float] | None],
    masks: bool,
) -> tuple[dict[str, ModuleDecision], int]:
    """The plan of the lowest peak by its policies' own figures, of the lowest-peak MILPs (lines and bounds)."""
    best: tuple[dict[str, ModuleDecision], int] | None = None
    for bound in (False, True):
        _, lowest = _minimum_peak(cands, constraints, bound=bound)
        decisions = plan_decisions(profile, cands, lowest, backend, per_op_us, measured, masks)
        peak = plan_peak(profile, constraints, decisions, backend)
        if best is None or peak < best[1]:
            best = (decisions, peak)
    assert best is not None
    return best


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
    refine: bool = True,
    masks: bool = True,
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
            (:mod:`lightning_sac.solver.recompute`).
        refine: On a model of at most :data:`REFINE_CANDIDATES` candidate modules, also solve with
            ``n_segments + 1`` lines per fit and keep the plan of the least predicted step (the first on a tie).
            The fits only approximate each module's trade-off curve, so another fit can find a plan that
            recomputes less within the same budget (on the demo GPT at torchtitan's peak, 4% less overhead);
            both plans are checked against the budget with their own figures.
        masks: Whether the SAC backend may keep a module's dropout noise as ``bool`` masks, copied back in
            recompute instead of drawn again (:mod:`lightning_sac.solver.masks`); when some module can, the plan
            is also solved without and the least predicted step kept. Not under ``torch.compile``, whose traced
            regions cannot run the copy: AutoSAC turns it off for a compiled model. Nor on torch before 2.12, whose
            selective-checkpoint policies never see the noise they would keep (``apply.sac.sac_sees_outputs``).

    Raises:
        BudgetError: The budget is below the minimum achievable peak.
        ValueError: Invalid ``world_size``, ``sharding``, ``budget_gb`` or ``backend``.
    """
    start = time.perf_counter()
    args = (world_size, sharding, candidates, time_limit_s, mip_gap, backend)
    maskable = any(mask_unit(m.op_stats) for m in profile.modules.values() if m.op_stats)
    masks = masks and backend == "sac" and sac_sees_outputs() and maskable
    plan, n_candidates = _solve(profile, budget_gb, n_segments, *args, masks)
    if plan.decisions:
        fits = [n_segments, n_segments + 1] if refine and n_candidates <= REFINE_CANDIDATES else [n_segments]
        # A masked random unit still reruns the ops around its draws; where keeping the noise itself is cheap, a
        # plan without masks can be the faster one.
        tries = [(n, m) for m in dict.fromkeys((masks, False)) for n in fits][1:]
        for n, m in tries:
            other, _ = _solve(profile, budget_gb, n, *args, m)
            if other.predicted_step_ms < plan.predicted_step_ms:
                plan = other
    if profile.routing:  # mixture-of-experts layers: what an uneven routing can add (dryrun/values/moe_routing.py)
        activation = {c["module"]: profile.modules[c["module"]].activation_bytes for c in profile.routing}
        policies = {fqn: (d.op_policy, d.freed_bytes) for fqn, d in plan.decisions.items()}
        plan.routing_layers = len(profile.routing)
        plan.routing_bound_bytes = routing_bound_bytes(profile.routing, activation, policies)
    plan.solver_seconds = time.perf_counter() - start
    return plan


def _solve(
    profile: ModelProfile,
    budget_gb: float,
    n_segments: int,
    world_size: int,
    sharding: str,
    candidates: Sequence[Any] | None,
    time_limit_s: float,
    mip_gap: float,
    backend: str,
    masks: bool,
) -> tuple[Plan, int]:
    """One solve of :func:`solve_plan` with ``n_segments`` lines per trade-off fit; the plan and the candidates."""
    start = time.perf_counter()
    check_backend(backend)
    if sharding not in ("replicated", "sharded"):
        raise ValueError(f"sharding must be 'replicated' or 'sharded', got {sharding!r}.")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}.")
    if not budget_gb > 0:
        raise ValueError(f"budget_gb must be positive, got {budget_gb}.")
    reserve = device_reserve(profile, world_size)
    # The step's tensors get what the device holds for nothing else (see lightning_sac.plan.reserve).
    budget = int(budget_gb * _GIB) - reserve.total
    cands = find_candidates(profile, candidates, n_segments, backend, masks)
    windows = {c.fqn: c.window for c in cands}
    constraints = memory_constraints(profile, windows, world_size=world_size, sharding=sharding)
    unconstrained = peak_with_plan(constraints, {}, {})
    # The model as it runs without a plan: with its KV caches on, when the profile ran without them.
    plain = unconstrained
    if profile.kv_cache_peak is not None:
        plain = device_model(profile, world_size, sharding)(0, profile.kv_cache_peak)
    plan = Plan(
        budget_bytes=int(budget_gb * _GIB),
        reserve=reserve.to_dict() if reserve.total else {},
        world_size=world_size,
        sharding=sharding,
        device=profile.device.name,
        backend=backend,
        unconstrained_peak_bytes=plain,
        predicted_peak_bytes=plain,
        predicted_step_ms=profile.step_ms,
        solver_status="Not needed",
        fingerprint=profile_fingerprint(profile),
        replaces_checkpointing=list(profile.replaced_checkpointing),
    )
    if plain <= budget:
        plan.solver_seconds = time.perf_counter() - start
        return plan, len(cands)
    # From here on the plan runs the model as profiled: without KV caches in training.
    plan.kv_cache_off = bool(profile.kv_cache_off)
    plan.predicted_peak_bytes = unconstrained
    if unconstrained <= budget:
        plan.solver_seconds = time.perf_counter() - start
        return plan, len(cands)  # switching the caches off is enough

    # A profile that measured neither (a roofline one) charges no overhead: zero per op.
    per_op_us = profile.backend_overhead_us.get(backend, [0.0, 0.0])
    measured = {c.fqn: profile.modules[c.fqn].measured_overhead.get(backend) for c in cands}
    fixed_ms = {c.fqn: fixed_overhead_ms(op_stats(profile, c.fqn), backend, per_op_us, measured[c.fqn]) for c in cands}
    factor = {fqn: m[1] for fqn, m in measured.items() if m}
    if masks:  # what a masked random unit reruns, left out of the view's curve (see solver.masks)
        for c in cands:
            fixed_ms[c.fqn] += factor.get(c.fqn, 1.0) * mask_fixed_ms(op_stats(profile, c.fqn), backend)
    whole_ms = whole_costs(profile, cands, backend, measured)
    limit = budget / _MIB - _MARGIN_MIB
    # First with each recompute's transient as a line in its discard ratio (close to what the chosen policy
    # holds), then with the all-recompute figure; each solved again with its limit lowered by what the chosen
    # policies' own figures exceeded the budget by (a line is an estimate). When none fits, the plan of the
    # lowest peak, if its own figures fit.
    status_text, gap = "", 0.0
    for bound in (False, True):
        tighten = 0.0
        for _ in range(_TIGHTEN_ROUNDS):
            h = new_highs(time_limit_s=time_limit_s, mip_gap=mip_gap)
            y, r, rc = add_candidates(h, cands, fixed_ms, factor, whole_ms)
            status = highspy.HighsModelStatus.kInfeasible
            if constant_floor(constraints) <= budget:
                memory_rows(h, cands, constraints, y, r, limit - tighten, bound=bound)
                h.minimize(h.qsum(rc))
                status = h.getModelStatus()
            if status == highspy.HighsModelStatus.kInfeasible:
                break
            if status not in (highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kTimeLimit):
                raise RuntimeError(f"HiGHS could not solve the plan: {h.modelStatusToString(status)}.")
            if h.getInfo().primal_solution_status == 0:
                raise RuntimeError(f"HiGHS found no plan within time_limit_s={time_limit_s}; raise the time limit.")
            chosen = {c.fqn: h.val(r[c.fqn]) for c in cands if h.val(y[c.fqn]) > 0.5}
            decisions = plan_decisions(profile, cands, chosen, backend, per_op_us, measured, masks)
            peak = plan_peak(profile, constraints, decisions, backend)
            if peak <= budget:
                plan.decisions, plan.predicted_peak_bytes = decisions, peak
                status_text, gap = h.modelStatusToString(status), float(h.getInfo().mip_gap)
                break
            tighten += (peak - budget) / _MIB + _MARGIN_MIB
        if status_text:
            break
    if not status_text:
        decisions, peak = _lowest_plan(profile, cands, constraints, backend, per_op_us, measured, masks)
        if peak > budget:
            kept = (
                f" (the tensors' {peak / _GIB:.3f} GiB plus {reserve.total / _GIB:.3f} GiB the device holds "
                f"besides: {reserve.describe()})"
            )
            raise BudgetError(
                f"A budget of {budget_gb:.3f} GiB per device is below the minimum achievable peak of "
                f"{(peak + reserve.total) / _GIB:.3f} GiB{kept if reserve.total else ''} (the unconstrained "
                f"peak is {(plain + reserve.total) / _GIB:.3f} GiB on {profile.device.name}, world size "
                f"{world_size}, {sharding}). Raise the budget, use a smaller "
                "batch or shorter sequences, "
                + (
                    "shard parameters, gradients and optimizer state over N devices (sharding='sharded', world_size=N)"
                    if sharding == "replicated"
                    else f"shard them over more devices (world_size above {world_size})"
                )
                + more_candidates_hint(profile),
                minimum_bytes=peak + reserve.total,
                unconstrained_bytes=plain + reserve.total,
            )
        plan.decisions, plan.predicted_peak_bytes = decisions, peak
        status_text, gap = "Optimal (lowest peak)", 0.0
    plan.predicted_recompute_ms = sum(d.recompute_ms for d in plan.decisions.values())
    plan.predicted_overhead_ms = sum(d.overhead_ms for d in plan.decisions.values())
    plan.predicted_step_ms = profile.step_ms + plan.predicted_recompute_ms + plan.predicted_overhead_ms
    plan.solver_status, plan.solver_gap = status_text, gap
    plan.solver_seconds = time.perf_counter() - start
    return plan, len(cands)
