"""``solve_plan``: which modules to checkpoint, and how much of each to discard, at the least recompute."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import highspy

from lightning_sac.adapters import sac_sees_outputs
from lightning_sac.dryrun import ModelProfile, profile_fingerprint, routing_bound_bytes
from lightning_sac.errors import BudgetError
from lightning_sac.plan import ModuleDecision, Plan, StepFragmentation, check_backend, device_reserve
from lightning_sac.solver.candidates import Candidate, budget_error, find_candidates, op_stats
from lightning_sac.solver.decisions import Found, alternative_plans, lowest_plan, plan_decisions, plan_peak, whole_costs
from lightning_sac.solver.highs import IntegerStart, integer_start, new_highs
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
from lightning_sac.solver.rows import Milp

__all__ = ["solve_plan"]

_GIB = 2**30
# Rows are in MiB (lightning_sac.solver.rows); HiGHS's feasibility tolerance (1e-7) is then well under a byte. A
# KiB of margin keeps the plan's peak within the budget after rounding.
_MARGIN_MIB = 1 / 1024
#: Up to how many candidate modules :func:`solve_plan` also tries a finer trade-off fit (a second solve).
REFINE_CANDIDATES = 64
# How often a plan whose own figures exceed the budget is solved again under a lower limit.
_TIGHTEN_ROUNDS = 3
# How often the plan is solved again with the fragmentation its own allocations replay to, and how much of the room
# an estimate must exceed a kept plan's own fragmentation by for another solve (replays vary by tens of percent
# between near-equal plans: a smaller excess buys little recompute for a whole MILP).
_FRAGMENTATION_ROUNDS = 3
_RESOLVE_SHARE = 0.02


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
    descendant. Each chosen module's discard ratio becomes an exact op policy (:func:`optimal_op_policy`). On a
    CUDA target the budget also holds the device's reserve (:mod:`lightning_sac.plan.reserve`), whose fragmentation
    is the planned step's own (:mod:`lightning_sac.plan.fragmentation`): the plan is solved with an estimate, its
    allocations replayed, and solved again with its own figure, a few rounds; only a plan whose tensors and own
    fragmentation fit is kept.

    The MILP prices each module with its trade-off fit, while the plan's figures are its policies' own: the plan of
    the least fitted recompute need not be the plan of the least recompute, and a higher budget could get a plan
    that recomputes more than a lower budget's. So each solve also weighs full activation checkpointing of the
    model's repeated blocks, and the refining solves (``refine``, a model of at most :data:`REFINE_CANDIDATES`
    candidate modules: the finer fit, with and without masks) the MILP's plans at two lower limits (which fit
    this budget too), each plan by its own figures; the least predicted step is kept (the MILP's on a tie;
    :func:`~lightning_sac.solver.decisions.alternative_plans`). Without refining (a larger model, where those
    solves would cost more than the planning itself, or ``refine=False``) a higher budget can still get a plan
    its figures rate slower.

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
    # One replay per plan, shared by the solves below (lightning_sac.plan.fragmentation).
    fragmentation = StepFragmentation(profile, world_size, sharding)
    plan, n_candidates = _solve(profile, budget_gb, n_segments, *args, masks, fragmentation)
    if plan.decisions:
        fits = [n_segments, n_segments + 1] if refine and n_candidates <= REFINE_CANDIDATES else [n_segments]
        # A masked random unit still reruns the ops around its draws; where keeping the noise itself is cheap, a
        # plan without masks can be the faster one.
        tries = [(n, m) for m in dict.fromkeys((masks, False)) for n in fits][1:]
        for n, m in tries:
            # The finer fit's plans at lower limits (alternative_plans): it misranks plans less than the coarser.
            try:
                other, _ = _solve(profile, budget_gb, n, *args, m, fragmentation, lower_limits=n > n_segments)
            except BudgetError:
                # Near the minimum, another fit's least plan can lie above the budget the first fit's met: that
                # fit has no plan to offer, and the minimum the first fit reported stays reachable.
                continue
            if other.predicted_step_ms < plan.predicted_step_ms:
                plan = other
    if profile.routing:  # mixture-of-experts layers: what an uneven routing can add (dryrun/values/moe_routing.py)
        activation = {c["module"]: profile.modules[c["module"]].activation_bytes for c in profile.routing}
        policies = {fqn: (d.op_policy, d.freed_bytes) for fqn, d in plan.decisions.items()}
        plan.routing_layers = len(profile.routing)
        plan.routing_bound_bytes = routing_bound_bytes(profile.routing, activation, policies)
    plan.solver_seconds = time.perf_counter() - start
    return plan


@dataclass
class _Search:
    """The MILP at the least recompute for a bound on the tensors' peak, with each chosen policy checked."""

    profile: ModelProfile
    cands: list[Candidate]
    constraints: list[MemoryConstraint]
    backend: str
    per_op_us: list[float]
    measured: dict[str, list[float] | None]
    masks: bool
    fixed_ms: dict[str, float]
    factor: dict[str, float]
    whole_ms: dict[str, float]
    time_limit_s: float = 30.0
    mip_gap: float = 1e-2
    start: IntegerStart | None = None
    milps: dict[bool, Milp] = field(default_factory=dict)  # per bound, built at its first solve

    def __call__(self, budget: int) -> Found | None:
        """The decisions, their tensors' peak, HiGHS's status and gap; ``None`` when no plan fits ``budget`` bytes.

        First with each recompute's transient as a line in its discard ratio (close to what the chosen policy
        holds), then with the all-recompute figure; each solved again with its limit lowered by what the chosen
        policies' own figures exceeded the budget by (a line is an estimate). Each solve after the first starts
        from the candidates the last one checkpointed (:func:`~lightning_sac.solver.highs.integer_start`).
        """
        cands, constraints = self.cands, self.constraints
        limit = budget / _MIB - _MARGIN_MIB
        if constant_floor(constraints) > budget:
            return None
        for bound in (False, True):
            tighten = 0.0
            if bound not in self.milps:
                self.milps[bound] = Milp(cands, constraints, (self.fixed_ms, self.factor, self.whole_ms), bound)
            for _ in range(_TIGHTEN_ROUNDS):
                h = new_highs(time_limit_s=self.time_limit_s, mip_gap=self.mip_gap)
                y, r = self.milps[bound].at(limit - tighten, h)
                if self.start is not None:  # after the model: changing it drops a start
                    h.setSolution(len(self.start[0]), *self.start)
                h.solve()
                status = h.getModelStatus()
                if status == highspy.HighsModelStatus.kInfeasible:
                    break
                if status not in (highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kTimeLimit):
                    raise RuntimeError(f"HiGHS could not solve the plan: {h.modelStatusToString(status)}.")
                if h.getInfo().primal_solution_status == 0:
                    raise RuntimeError(
                        f"HiGHS found no plan within time_limit_s={self.time_limit_s}; raise the time limit."
                    )
                self.start = integer_start(h)
                value = h.getSolution().col_value
                chosen = {c.fqn: value[r[c.fqn]] for c in cands if value[y[c.fqn]] > 0.5}
                decisions = plan_decisions(
                    self.profile, cands, chosen, self.backend, self.per_op_us, self.measured, self.masks
                )
                peak = plan_peak(self.profile, constraints, decisions, self.backend)
                if peak <= budget:
                    return decisions, peak, h.modelStatusToString(status), float(h.getInfo().mip_gap)
                tighten += (peak - budget) / _MIB + _MARGIN_MIB
        return None


def _added_ms(decisions: dict[str, ModuleDecision]) -> float:
    return sum(d.recompute_ms + d.overhead_ms for d in decisions.values())


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
    fragmentation: StepFragmentation,
    lower_limits: bool = False,
) -> tuple[Plan, int]:
    """One solve of :func:`solve_plan` with ``n_segments`` lines per trade-off fit; the plan and the candidates.

    ``lower_limits``: also weigh the MILP's plans at lower limits (full checkpointing is weighed in every solve).
    """
    start = time.perf_counter()
    check_backend(backend)
    if sharding not in ("replicated", "sharded"):
        raise ValueError(f"sharding must be 'replicated' or 'sharded', got {sharding!r}.")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}.")
    if not budget_gb > 0:
        raise ValueError(f"budget_gb must be positive, got {budget_gb}.")
    base = device_reserve(profile, world_size, fragmentation_bytes=0)
    # The step's tensors and the allocator's fragmentation get what the device holds for nothing else (see
    # lightning_sac.plan.reserve); the fragmentation depends on the plan (lightning_sac.plan.fragmentation).
    room = int(budget_gb * _GIB) - base.total
    # The caching allocator releases cached segments (and retries) only when the device itself runs out: below that,
    # it keeps them, whatever the budget. A step's fragmentation is then its replay's without a limit, and its least
    # need only where the device would run out (plan.fragmentation).
    device_room = int(profile.device.memory_gib * _GIB) - base.total
    cands = find_candidates(profile, candidates, n_segments, backend, masks)
    windows = {c.fqn: c.window for c in cands}
    constraints = memory_constraints(profile, windows, world_size=world_size, sharding=sharding, backend=backend)
    unconstrained = peak_with_plan(constraints, {}, {})
    # The model as it runs without a plan: with its KV caches on, when the profile ran without them.
    plain = unconstrained
    if profile.kv_cache_peak is not None:
        plain = device_model(profile, world_size, sharding)(0, profile.kv_cache_peak)
    frag = plain_frag = fragmentation({}, device_room - plain)
    plan = Plan(
        budget_bytes=int(budget_gb * _GIB),
        reserve=_reserve(profile, world_size, frag),
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
    if plain + frag <= room:
        plan.solver_seconds = time.perf_counter() - start
        return plan, len(cands)
    # From here on the plan runs the model as profiled: without KV caches in training.
    plan.kv_cache_off = bool(profile.kv_cache_off)
    plan.predicted_peak_bytes = unconstrained
    frag = fragmentation({}, device_room - unconstrained)
    plan.reserve = _reserve(profile, world_size, frag)
    if unconstrained + frag <= room:
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
    search = _Search(profile, cands, constraints, backend, per_op_us, measured, masks, fixed_ms, factor, whole_ms)
    search.time_limit_s, search.mip_gap = time_limit_s, mip_gap
    # The tensors' budget depends on the fragmentation and the fragmentation on the plan: solve with an estimate
    # (first the plain step's), replay the plan's own and solve again with it, a few rounds. A plan is kept only
    # when its tensors and its own fragmentation fit; until one does, the estimate only grows.
    kept: tuple[Found, int] | None = None
    tried: list[int] = []
    for _ in range(_FRAGMENTATION_ROUNDS):
        tried.append(frag)
        found = search(room - frag)
        if found is None:
            break
        own = fragmentation(found[0], device_room - found[1])
        if found[1] + own <= room and (kept is None or _added_ms(found[0]) < _added_ms(kept[0][0])):
            kept = (found, own)
        if own in tried or (kept is not None and frag - own <= _RESOLVE_SHARE * room):
            break
        frag = own
    if kept is None:
        # No plan of the MILP's fits: the plan of the least memory, if it does; a cheaper one at its fragmentation.
        own_fragmentation = lambda d, p: fragmentation(d, device_room - p)  # noqa: E731
        lowest = lowest_plan(profile, cands, constraints, backend, per_op_us, measured, masks, own_fragmentation)
        decisions, peak, own = lowest
        if peak + own > room:
            raise budget_error(profile, budget_gb, world_size, sharding, peak, plain, own, plain_frag)
        kept = ((decisions, peak, "Optimal (lowest peak)", 0.0), own)
        found = search(room - own) if own not in tried else None
        if found is not None and found[1] + (again := fragmentation(found[0], device_room - found[1])) <= room:
            kept = (found, again)
    # A plan the MILP's fits rank lower can recompute less by its own figures (alternative_plans); it keeps the
    # MILP's status, which says how the search ended.
    solves = lower_limits and len(cands) <= REFINE_CANDIDATES
    others = (search, room - kept[1], backend, per_op_us, measured, masks, solves)
    for d, p, *_ in alternative_plans(profile, cands, constraints, *others):
        if _added_ms(d) < _added_ms(kept[0][0]) and p + (f := fragmentation(d, device_room - p)) <= room:
            kept = ((d, p, *kept[0][2:]), f)
    (decisions, peak, status_text, gap), own = kept
    plan.decisions, plan.predicted_peak_bytes, plan.reserve = decisions, peak, _reserve(profile, world_size, own)
    plan.predicted_recompute_ms = sum(d.recompute_ms for d in plan.decisions.values())
    plan.predicted_overhead_ms = sum(d.overhead_ms for d in plan.decisions.values())
    plan.predicted_step_ms = profile.step_ms + plan.predicted_recompute_ms + plan.predicted_overhead_ms
    plan.solver_status, plan.solver_gap = status_text, gap
    plan.solver_seconds = time.perf_counter() - start
    return plan, len(cands)


def _reserve(profile: ModelProfile, world_size: int, fragmentation: int) -> dict[str, int]:
    reserve = device_reserve(profile, world_size, fragmentation_bytes=fragmentation)
    return reserve.to_dict() if reserve.total else {}
