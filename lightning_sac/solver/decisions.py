"""What a plan's chosen discard ratios become: exact op policies, with what they free and cost, and the peak."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from lightning_sac.dryrun import ModelProfile, ModuleOpStats
from lightning_sac.plan import ModuleDecision
from lightning_sac.solver.candidates import Candidate, find_candidates, forward_temporaries, op_stats
from lightning_sac.solver.highs import new_highs
from lightning_sac.solver.knapsack import optimal_op_policy, torchtitan_op_policy
from lightning_sac.solver.masks import masked_view, realize
from lightning_sac.solver.memory_model import (
    MemoryConstraint,
    constant_floor,
    memory_constraints,
    peak_with_plan,
    recompute_state_bytes,
)
from lightning_sac.solver.recompute import (
    overhead_ms,
    recompute_ms,
    recompute_transient,
    rerun_output_bytes,
    skipped_ops,
    whole_overhead_ms,
)
from lightning_sac.solver.rows import MIB, add_candidates, memory_rows
from lightning_sac.solver.tradeoff import effective_memory

__all__ = [
    "LOWER_SHARES",
    "Found",
    "PeerPlan",
    "alternative_plans",
    "lowest_plan",
    "past_the_stop_recomputed",
    "peer_choices",
    "peer_plans",
    "plan_decisions",
    "plan_peak",
    "policy_decisions",
    "whole_costs",
]

#: A plan as the MILP's search gives it: its decisions, its tensors' peak, HiGHS's status and gap.
Found = tuple[dict[str, ModuleDecision], int, str, float]
#: The lower limits :func:`alternative_plans` solves the MILP at: the budget less these shares of its distance from
#: the memory no plan frees (parameters, gradients, optimizer state: ``constant_floor``), which costs no solve.
LOWER_SHARES = (0.03, 0.1)


def whole_costs(
    profile: ModelProfile, cands: list[Candidate], backend: str, measured: dict[str, list[float] | None]
) -> dict[str, float]:
    """Per candidate whose most-discarding policy saves nothing: that policy's recompute and overhead, ms."""
    costs = {}
    for c in cands:
        if c.tradeoff.stored:  # it must save something: never a plain checkpoint
            continue
        stats = op_stats(profile, c.fqn)
        policy = optimal_op_policy(stats, 0.0, backend)
        overhead = whole_overhead_ms(stats, policy, backend, measured[c.fqn])
        if overhead is not None:
            costs[c.fqn] = recompute_ms(stats, policy, backend) + overhead
    return costs


def plan_peak(
    profile: ModelProfile, constraints: list[MemoryConstraint], decisions: dict[str, ModuleDecision], backend: str
) -> int:
    """The step's peak under ``decisions``, with each recompute's transient as its policy has it."""
    freed = {f: d.freed_bytes for f, d in decisions.items()}
    transient = {f: _transient(profile, f, d.op_policy, backend, d.masked_ops) for f, d in decisions.items()}
    return peak_with_plan(constraints, freed, transient)


def _transient(profile: ModelProfile, fqn: str, policy: list[int], backend: str, masked: list[int]) -> int:
    """What the recompute of ``fqn`` under ``policy`` (and ``masked`` draws) holds at once besides its activations."""
    stats = op_stats(profile, fqn)
    exact = recompute_transient(stats, policy, backend, masked)
    if exact is None:  # a profile without op lifetimes
        exact = forward_temporaries(profile.modules[fqn]) + rerun_output_bytes(stats, policy, backend)
    return exact + recompute_state_bytes(profile, fqn, backend)


def past_the_stop_recomputed(stats: ModuleOpStats, policy: list[int], backend: str) -> list[int]:
    """``policy`` with every op a SAC recompute never reaches recomputed, unless tied to another op's decision.

    SAC's recompute stops once it has saved again every tensor the forward saved (its early stop): the ops from there
    on never rerun, so saving one spares no work, and its output stays in the checkpoint's cache, unread, until the
    module's backward is over: a temporary the forward frees (a tensor-parallel linear's partial sums before their
    all-reduce, a residual branch's last matmul) is then held longer than the plan's figures say (65,536 bytes over
    the prediction, measured on a TP Llama), and the module's output longer than autograd holds it. Applied to the
    knapsack's answer, so the trade-off curves the MILP weighs are as before; only what the plan holds goes down.
    Ops tied to others (in place, random, stateful, read before a write) keep their decision.
    """
    if backend != "sac" or stats.recompute_stop is None:
        return policy
    tied = set(stats.rand_ops) | set(stats.stateful_ops)
    tied |= {i for pair in [*stats.inplace_ops, *stats.reads_before_overwrite] for i in pair}
    return [0 if i >= stats.recompute_stop and i not in tied else keep for i, keep in enumerate(policy)]


def plan_decisions(
    profile: ModelProfile,
    cands: list[Candidate],
    chosen: dict[str, float],
    backend: str,
    per_op_us: list[float],
    measured: dict[str, list[float] | None],
    masks: bool,
) -> dict[str, ModuleDecision]:
    """Each chosen candidate's discard ratio as an exact op policy, with what it frees and costs.

    With ``masks``, the policy is found on :func:`~lightning_sac.solver.masks.masked_view` and realized.
    """
    decisions = {}
    for c in cands:
        if c.fqn not in chosen:
            continue
        discard = min(max(chosen[c.fqn], c.min_discard), c.tradeoff.max_discard)
        stats = op_stats(profile, c.fqn)
        keep = max(0.0, min(1.0, 1.0 - discard))
        if not c.tradeoff.stored and discard >= c.tradeoff.max_discard - 1e-9:
            keep = 0.0  # the largest discard of a module that must save nothing: rounding must not save an op
        view = masked_view(stats, backend) if masks else stats
        found = past_the_stop_recomputed(stats, optimal_op_policy(view, keep, backend), backend)
        saved = sum(m for m, keep in zip(effective_memory(view), found, strict=True) if keep)
        if c.retained - saved <= 0:
            continue  # chosen at its minimum discard: wrapping it would cost time and free nothing
        policy, masked = realize(stats, found, backend) if masks else (found, [])
        decisions[c.fqn] = _priced(
            stats, policy, discard, c.retained - saved, backend, per_op_us, measured[c.fqn], masked
        )
    return decisions


def _priced(
    stats: ModuleOpStats,
    policy: list[int],
    discard: float,
    freed: int,
    backend: str,
    per_op_us: list[float],
    measured: list[float] | None,
    masked: list[int],
) -> ModuleDecision:
    """A module's decision under ``policy``: its recompute and overhead by the plan's figures."""
    return ModuleDecision(
        discard_ratio=discard,
        op_policy=policy,
        recompute_ms=recompute_ms(stats, policy, backend, masked),
        overhead_ms=overhead_ms(stats, policy, backend, per_op_us, measured, masked),
        freed_bytes=freed,
        op_names=list(stats.func_names),
        skipped_ops=skipped_ops(stats, policy) if backend == "sac" else [],
        masked_ops=masked,
    )


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
    h.addConstr(peak >= constant / MIB)
    memory_rows(h, cands, constraints, y, r, peak, bound=bound)
    h.minimize(peak)
    return h.val(peak) * MIB, {c.fqn: h.val(r[c.fqn]) for c in cands if h.val(y[c.fqn]) > 0.5}


def lowest_plan(
    profile: ModelProfile,
    cands: list[Candidate],
    constraints: list[MemoryConstraint],
    backend: str,
    per_op_us: list[float],
    measured: dict[str, list[float] | None],
    masks: bool,
    fragmentation: Callable[[dict[str, ModuleDecision], int], int] | None = None,
) -> tuple[dict[str, ModuleDecision], int, int]:
    """The plan of the least memory of the lowest-peak MILPs (lines and bounds), by its policies' own figures.

    Returns its decisions, its tensors' peak and its fragmentation (``fragmentation(decisions, peak)``, default 0):
    the plan whose sum of the two is the least.
    """
    best: tuple[dict[str, ModuleDecision], int, int] | None = None
    for bound in (False, True):
        _, lowest = _minimum_peak(cands, constraints, bound=bound)
        decisions = plan_decisions(profile, cands, lowest, backend, per_op_us, measured, masks)
        peak = plan_peak(profile, constraints, decisions, backend)
        frag = 0 if fragmentation is None else fragmentation(decisions, peak)
        if best is None or peak + frag < best[1] + best[2]:
            best = (decisions, peak, frag)
    assert best is not None
    return best


def peer_choices(profile: ModelProfile, cands: list[Candidate]) -> list[dict[str, float]]:
    """Full activation checkpointing, as discard ratios: each repeated block checkpointed whole.

    The blocks are the children of the model's longest ``ModuleList`` of one class (``model.layers.0``,
    ``model.layers.1``...: the most siblings named by their index, of one class; the first such list on a tie),
    each at its largest discard. Empty when the model has no such list or one of its blocks is no candidate.
    """
    lists: dict[tuple[str, str], list[str]] = {}  # (the list's fqn, the class) -> its blocks, in profile order
    for fqn, m in profile.modules.items():
        parent, _, index = fqn.rpartition(".")
        if index.isdigit():
            lists.setdefault((parent, m.module_type), []).append(fqn)
    if not lists:
        return []
    blocks = max(lists.values(), key=len)  # max keeps the first of the longest
    by_fqn = {c.fqn: c for c in cands}
    if len(blocks) < 2 or any(b not in by_fqn for b in blocks):
        return []
    return [{b: by_fqn[b].tradeoff.max_discard for b in blocks}]


def alternative_plans(
    profile: ModelProfile,
    cands: list[Candidate],
    constraints: list[MemoryConstraint],
    search: Callable[[int], Found | None],
    budget: int,
    backend: str,
    per_op_us: list[float],
    measured: dict[str, list[float] | None],
    masks: bool,
    solves: bool = True,
) -> Iterator[Found]:
    """Complete plans to weigh against the MILP's at ``budget`` bytes of tensors, each with its own exact figures.

    The MILP minimizes the trade-off fits' recompute, which only approximate the chosen policies' own (the fits lie
    above each module's curve by a varying margin, and a policy frees what its ops hold rather than the ratio asked
    for): a plan the MILP ranks above another can recompute more by the plan's own figures. So a plan the MILP finds
    under a lower limit, which fits ``budget`` too, can be the better one, and a higher budget could get a worse
    plan than a lower. Yielded: with ``solves``, the MILP's plans at the limits of :data:`LOWER_SHARES` (a search
    each; a limit below the least peak finds none); then the peer plans of :func:`peer_choices` (with status
    ``"peer"``), which cost no solve. Which fit is the caller's to check.
    """
    if solves:
        floor = constant_floor(constraints)
        for share in LOWER_SHARES:
            if (found := search(int(budget - share * max(0.0, budget - floor)))) is not None:
                yield found
    for chosen in peer_choices(profile, cands):
        decisions = plan_decisions(profile, cands, chosen, backend, per_op_us, measured, masks)
        yield decisions, plan_peak(profile, constraints, decisions, backend), "peer", 0.0


def policy_decisions(
    profile: ModelProfile,
    cands: list[Candidate],
    policies: Mapping[str, Sequence[int]],
    backend: str,
    per_op_us: list[float],
    measured: dict[str, list[float] | None],
) -> dict[str, ModuleDecision]:
    """Given op policies (one per candidate module), as decisions: what each frees and costs by the plan's figures."""
    by_fqn = {c.fqn: c for c in cands}
    decisions = {}
    for fqn, policy in policies.items():
        stats = op_stats(profile, fqn)
        memory = effective_memory(stats)
        saved = sum(m for m, keep in zip(memory, policy, strict=True) if keep)
        discard = 1.0 - saved / max(sum(memory), 1)
        freed = by_fqn[fqn].retained - saved
        decisions[fqn] = _priced(stats, list(policy), discard, freed, backend, per_op_us, measured[fqn], [])
    return decisions


def _rerun_all(stats: ModuleOpStats, decision: ModuleDecision, measured: list[float] | None) -> ModuleDecision:
    """``decision`` as torch's checkpoint runs it: its recompute stops early but skips no dead op (ours does).

    A selective policy's measured share of the rerun beyond the op times (``measured[1]``, see
    :func:`~lightning_sac.solver.recompute.overhead_ms`) applies to the dead ops too; a plain checkpoint's
    measured time is our rerun's whole, to which they add their op times.
    """
    if not decision.skipped_ops:
        return decision
    dead = sum(stats.runtimes[i] for i in decision.skipped_ops)
    factor = measured[1] if measured and any(decision.op_policy) else 1.0
    return replace(
        decision,
        recompute_ms=decision.recompute_ms + dead,
        overhead_ms=decision.overhead_ms + (factor - 1.0) * dead,
        skipped_ops=[],
    )


@dataclass(frozen=True)
class PeerPlan:
    """A peer's plan priced by the solver's own figures, as a plan of its would be.

    Attributes:
        decisions: The peer's policy of each module it wraps.
        peak_bytes: The step's tensors' peak under it.
        added_ms: What it adds to the step: recompute and the backend's host overhead.
    """

    decisions: dict[str, ModuleDecision]
    peak_bytes: int
    added_ms: float


def peer_plans(profile: ModelProfile, backend: str = "sac") -> dict[str, PeerPlan]:
    """What users run today, priced like a plan: ``"full AC"`` and ``"torchtitan op-SAC"`` of the repeated blocks.

    Full AC checkpoints each block of :func:`peer_choices` whole; torchtitan's op-level SAC gives each the policy
    of :func:`~lightning_sac.solver.knapsack.torchtitan_op_policy`. Both recompute as torch's checkpoint does: up
    to its early stop, every op not saved, the dead ones too (our backend skips those, :func:`skipped_ops`; a
    block whose dropout follows its last projection has one). At a peer's peak the solver's plan adds no more than
    the peer's ``added_ms`` (its own figures); a measured comparison shows whether they hold. Empty when the
    model has no repeated blocks that are all candidates.
    """
    cands = find_candidates(profile, None, backend=backend)
    constraints = memory_constraints(profile, {c.fqn: c.window for c in cands})
    per_op_us = profile.backend_overhead_us.get(backend, [0.0, 0.0])
    measured = {c.fqn: profile.modules[c.fqn].measured_overhead.get(backend) for c in cands}
    plans = {}
    for chosen in peer_choices(profile, cands):
        titan = {f: torchtitan_op_policy(op_stats(profile, f)) for f in chosen}
        for name, decisions in (
            ("full AC", plan_decisions(profile, cands, chosen, backend, per_op_us, measured, False)),
            ("torchtitan op-SAC", policy_decisions(profile, cands, titan, backend, per_op_us, measured)),
        ):
            decisions = {f: _rerun_all(op_stats(profile, f), d, measured[f]) for f, d in decisions.items()}
            added = sum(d.recompute_ms + d.overhead_ms for d in decisions.values())
            plans[name] = PeerPlan(decisions, plan_peak(profile, constraints, decisions, backend), added)
    return plans
