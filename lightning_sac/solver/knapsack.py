"""Which ops of one module to save under selective checkpointing: an exact 0/1 knapsack, and the greedy order."""

from __future__ import annotations

import math

import highspy

from lightning_sac.dryrun import ModuleOpStats
from lightning_sac.solver.highs import new_highs
from lightning_sac.solver.recompute import recompute_costs
from lightning_sac.solver.tradeoff import effective_memory, module_tradeoff, recompute_units

__all__ = [
    "TITAN_MATMULS",
    "greedy_op_policy",
    "least_kept_policy",
    "optimal_op_policy",
    "torchtitan_op_policy",
    "torchtitan_saves",
]

SAVE, RECOMPUTE = 1, 0
# The matrix products torchtitan's op-level SAC counts (torchtitan_saves): a linear with a bias runs addmm.
TITAN_MATMULS = frozenset({"aten.mm.default", "aten.addmm.default"})

# Identical blocks of a deep model ask the same knapsack (same stats, same budget): one HiGHS run serves them all.
_CACHE: dict[tuple[object, ...], list[int]] = {}


def _check_budget(memory_budget: float) -> None:
    if not 0.0 <= memory_budget <= 1.0:
        raise ValueError(
            f"memory_budget is the fraction of the module's op memory that may stay saved, in [0, 1]; "
            f"got {memory_budget}."
        )


def _min_budget(stats: ModuleOpStats) -> float:
    memory = effective_memory(stats)
    total = sum(memory)
    _, stored = recompute_units(stats)
    return 0.0 if total == 0 else sum(u.memory for u in stored) / total


def optimal_op_policy(stats: ModuleOpStats, memory_budget: float, backend: str = "sac") -> list[int]:
    """Save the ops that maximize saved runtime while their memory stays within ``memory_budget``.

    A 0/1 knapsack solved exactly with HiGHS. View-like ops are recomputed; each in-place op takes its parent's
    decision and is saved when it is its own parent; an op reading a tensor before an in-place op overwrites it
    takes its maker's decision; stateful ops are saved; random ops are all saved or all
    recomputed (all saved when ``stats.force_store_random``). Memory is
    :func:`~lightning_sac.solver.tradeoff.effective_memory`.

    Args:
        stats: The module's op statistics.
        memory_budget: Fraction of the module's op memory that may stay saved, in ``[0, 1]``.
        backend: The backend whose recompute costs are weighed
        (:func:`~lightning_sac.solver.recompute.recompute_costs`).

    Returns:
        One decision per op: 1 = save, 0 = recompute.

    Raises:
        ValueError: ``memory_budget`` is outside ``[0, 1]`` or below what must be saved regardless.
    """
    _check_budget(memory_budget)
    memory = effective_memory(stats)
    costs = recompute_costs(stats, backend)
    # Everything the knapsack below reads; HiGHS runs single-threaded with a fixed seed, so an equal key gives
    # an equal model and answer.
    key = (
        memory_budget,
        len(stats.func_names),
        tuple(memory),
        tuple(costs),
        tuple(stats.view_like_ops),
        tuple(stats.inplace_ops),
        tuple(stats.rand_ops),
        stats.force_store_random,
        tuple(stats.stateful_ops),
        tuple(stats.reads_before_overwrite),
    )
    if key not in _CACHE:
        if len(_CACHE) >= 1024:
            _CACHE.clear()
        _CACHE[key] = _solve_knapsack(stats, memory_budget, memory, costs)
    return list(_CACHE[key])


def _solve_knapsack(stats: ModuleOpStats, memory_budget: float, memory: list[int], costs: list[float]) -> list[int]:
    n = len(stats.func_names)
    # A budget read off a point of the trade-off curve can land a hair below that point's bytes in floating
    # point (8388607.99999999 for 8 MiB); flooring that would drop a whole unit.
    capacity = math.floor(memory_budget * sum(memory) + 1e-6)
    h = new_highs(time_limit_s=10.0, mip_gap=0.0)
    x = [h.addBinary() for _ in range(n)]
    for i in stats.view_like_ops:
        h.addConstr(x[i] == RECOMPUTE)
    for op, head in stats.inplace_ops:
        h.addConstr(x[op] == (SAVE if op == head else x[head]))
    for a, b in zip(stats.rand_ops, stats.rand_ops[1:], strict=False):
        h.addConstr(x[a] == x[b])
    if stats.force_store_random:
        for i in stats.rand_ops:
            h.addConstr(x[i] == SAVE)
    for i in stats.stateful_ops:
        h.addConstr(x[i] == SAVE)
    for reader, maker in stats.reads_before_overwrite:
        h.addConstr(x[reader] == x[maker])
    h.addConstr(h.qsum(memory[i] * x[i] for i in range(n)) <= capacity)
    # Ties (e.g. free ops) go to saving: a tiny reward per saved op keeps the answer unique and stable.
    h.maximize(h.qsum((costs[i] + 1e-9) * x[i] for i in range(n)))
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        raise ValueError(
            f"memory_budget {memory_budget:.4f} is below the {_min_budget(stats):.4f} of this module's op memory "
            "that must stay saved (in-place ops on inputs, forced random ops). Use a larger budget."
        )
    if status != highspy.HighsModelStatus.kOptimal:
        raise RuntimeError(f"HiGHS could not solve the op knapsack: {h.modelStatusToString(status)}.")
    return [round(v) for v in h.vals(x)]


def least_kept_policy(stats: ModuleOpStats, backend: str = "sac") -> list[int]:
    """The policy that keeps the least of the module's op memory: everything recomputed but what must be saved.

    What must be saved (stateful ops such as BatchNorm's, in-place writes to tensors from outside the module,
    forced random ops; see :func:`~lightning_sac.solver.tradeoff.recompute_units`) may hold memory, so a budget of 0
    can be infeasible; this one never is.
    """
    return optimal_op_policy(stats, _min_budget(stats), backend)


def torchtitan_saves(op_name: str, matmuls: int) -> bool:
    """Whether torchtitan's op-level SAC saves an op's output: the rule of :func:`torchtitan_op_policy`, one op.

    It saves every other matrix product of a call (the 1st, 3rd, ...; ``mm``, and ``addmm`` for a linear layer
    with a bias), attention's kernels and ``max``, and recomputes the rest. A runtime policy (the peer itself, in
    ``benchmarks/_peers.py``) and the priced one share this rule.

    Args:
        op_name: The op overload's name, as ``str(op)`` gives it (``"aten.mm.default"``).
        matmuls: How many of :data:`TITAN_MATMULS` the call has run so far, this op included.
    """
    if op_name in TITAN_MATMULS:
        return matmuls % 2 == 1
    return ("scaled_dot_product" in op_name and "backward" not in op_name) or op_name == "aten.max.default"


def torchtitan_op_policy(stats: ModuleOpStats) -> list[int]:
    """The per-op policy torchtitan's op-level SAC gives a transformer block: a peer's choice, to price it.

    Each op as :func:`torchtitan_saves` says. Views are recomputed whatever the policy; ops the module must save
    (stateful ones) stay saved, as in any policy (:func:`least_kept_policy`).
    """
    policy, matmuls = [], 0
    views, stateful = set(stats.view_like_ops), set(stats.stateful_ops)
    for i, name in enumerate(stats.func_names):
        matmuls += name in TITAN_MATMULS
        policy.append(int((torchtitan_saves(name, matmuls) and i not in views) or i in stateful))
    return policy


def greedy_op_policy(stats: ModuleOpStats, memory_budget: float, backend: str = "sac") -> list[int]:
    """Recompute units in the greedy MSPS order until at most ``memory_budget`` of the op memory stays saved.

    Same constraints and return value as :func:`optimal_op_policy`; no solver, so never better than it.
    """
    _check_budget(memory_budget)
    tradeoff = module_tradeoff(stats, backend=backend)
    policy = [SAVE] * len(stats.func_names)
    for i in stats.view_like_ops:
        policy[i] = RECOMPUTE
    saved = tradeoff.total_memory
    limit = memory_budget * tradeoff.total_memory
    for unit in tradeoff.order:
        if saved <= limit:
            break
        for i in unit.ops:
            policy[i] = RECOMPUTE
        saved -= unit.memory
    if saved > limit:
        raise ValueError(
            f"memory_budget {memory_budget:.4f} is below the {_min_budget(stats):.4f} of this module's op memory "
            "that must stay saved (in-place ops on inputs, forced random ops). Use a larger budget."
        )
    return policy
