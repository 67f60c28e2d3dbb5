"""The module-level MILP and the per-module op knapsack, both solved with HiGHS."""

from lightning_sac.solver.knapsack import greedy_op_policy, optimal_op_policy
from lightning_sac.solver.milp import solve_plan

__all__ = ["greedy_op_policy", "optimal_op_policy", "solve_plan"]
