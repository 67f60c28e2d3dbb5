"""The solver: each module's memory/recompute trade-off, and the MILP (HiGHS) that picks the plan.

Takes a :class:`~lightning_sac.dryrun.ModelProfile` and a budget; gives a :class:`~lightning_sac.plan.Plan`, with
the recompute each backend runs for it and what a sharded rank holds.
"""

from __future__ import annotations

from lightning_sac.solver.candidates import find_candidates
from lightning_sac.solver.decisions import PeerPlan, peer_plans
from lightning_sac.solver.knapsack import (
    TITAN_MATMULS,
    greedy_op_policy,
    least_kept_policy,
    optimal_op_policy,
    torchtitan_op_policy,
    torchtitan_saves,
)
from lightning_sac.solver.memory_model import activation_windows, ddp_bucket_bytes, device_model
from lightning_sac.solver.milp import solve_plan
from lightning_sac.solver.recompute import recompute_ms, skipped_ops
from lightning_sac.solver.tradeoff import ModuleTradeoff, module_tradeoff

__all__ = [
    "TITAN_MATMULS",
    "ModuleTradeoff",
    "PeerPlan",
    "activation_windows",
    "ddp_bucket_bytes",
    "device_model",
    "find_candidates",
    "greedy_op_policy",
    "least_kept_policy",
    "module_tradeoff",
    "optimal_op_policy",
    "peer_plans",
    "recompute_ms",
    "skipped_ops",
    "solve_plan",
    "torchtitan_op_policy",
    "torchtitan_saves",
]
