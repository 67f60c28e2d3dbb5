"""Solver speed: PyTorch's module-level SAC MILP (PuLP + CBC) against the same MILP on HiGHS, and our ``solve_plan``.

For each GPT depth, one ``profile_model`` profile (meta-device model, fake tensors, H100-SXM roofline, AdamW)
is turned into torch's ``ilp_utils.Graph`` (``_sac_milp_reference.torch_graph_from_profile``: our memory
snapshots, runtimes and trade-off fits in torch's ``ModStats`` fields). At several budgets, fractions of the
unconstrained peak of *torch's* memory model, the benchmark then solves:

* ``CBC``: torch's own ``torch.distributed._tools.sac_ilp.sac_milp`` (PuLP + CBC, ``gapRel=0.05`` as torch
  hard-codes it). Its time limit is torch's 180 s unless ``--cbc-time-limit`` lowers it (default 30 s, so that
  the run takes minutes): a capped run is marked ``*`` and its time is then a lower bound of CBC's.
* ``HiGHS``: our own formulation of exactly that MILP (``_sac_milp_reference.highs_sac_milp``) with HiGHS at a
  relative gap of 1e-4, and again at torch's 0.05 (``@5%``).
* ``plan``: our real ``lightning_sac.solve_plan`` at the same budget in GiB. Its memory model is different (every
  timeline interval, optimizer state included), so its objective is shown for information only: the exact
  recompute of its op policies, and the MILP's fitted value ``sum ACT * fit(discard)`` of its decisions.

Both solutions of torch's MILP are re-evaluated under torch's model by one independent function
(``evaluate_torch_model``), which checks that the two formulations coincide (feasible at the budget, same
objective arithmetic). Times are wall times of the whole call (model building included), best of ``--repeats``;
a run longer than ``--repeat-cutoff`` seconds is not repeated. ``solve_plan`` runs with its trade-off cache
cleared each time, as a first call in a process would.

Goals (from the issue): equal objective within 1% where the models coincide, HiGHS at most 0.5 of CBC's time,
and ``solve_plan`` on the 32-block profile under 2 s.

Run from the repository root (needs ``pip install pulp``)::

    python benchmarks/solver_speed.py
    python benchmarks/solver_speed.py --depths 8 --repeats 1 --budgets 0.9 0.6
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_ROOT, _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
from _sac_milp_reference import (  # noqa: E402
    MilpResult,
    evaluate_torch_model,
    highs_sac_milp,
    run_torch_sac_milp,
    torch_graph_from_profile,
    torch_unconstrained_peak,
)

import lightning_sac.solver.tradeoff as tradeoff_module  # noqa: E402
from lightning_sac import BudgetError, profile_model, solve_plan  # noqa: E402
from lightning_sac.demos import GPT, GPTConfig  # noqa: E402
from lightning_sac.dryrun.data import ModelProfile  # noqa: E402
from lightning_sac.solver.tradeoff import module_tradeoff  # noqa: E402

GOAL_OBJECTIVE_REL = 0.01
GOAL_TIME_RATIO = 0.5
GOAL_PLAN_DEPTH = 32
GOAL_PLAN_SECONDS = 2.0
_GIB = 2**30


@dataclass
class PlanResult:
    status: str
    seconds: float
    recompute_ms: float = math.nan
    fitted_ms: float = math.nan
    modules: int = 0


@dataclass
class Row:
    fraction: float
    budget_gib: float
    cbc: MilpResult
    cbc_capped: bool
    highs: MilpResult
    highs5: MilpResult
    plan: PlanResult
    checks: list[str] = field(default_factory=list)


def _best_of(args: argparse.Namespace, fn: Callable[..., Any], *fn_args: Any, **fn_kwargs: Any) -> Any:
    """Call ``fn`` up to ``args.repeats`` times and keep the fastest result (results carry their ``seconds``).

    A run longer than ``args.repeat_cutoff`` seconds is not repeated: a solve that slow will not turn fast.
    """
    best = None
    for _ in range(max(1, args.repeats)):
        gc.collect()
        result = fn(*fn_args, **fn_kwargs)
        if best is None or _seconds(result) < _seconds(best):
            best = result
        if _seconds(result) > args.repeat_cutoff:
            break
    return best


def _seconds(result: Any) -> float:
    return result[0].seconds if isinstance(result, tuple) else result.seconds


def _profile(depth: int, args: argparse.Namespace) -> tuple[ModelProfile, float]:
    cfg = GPTConfig(
        vocab_size=args.vocab,
        block_size=args.seq_len,
        n_layer=depth,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=0.1,
    )
    with torch.device("meta"):
        model = GPT(cfg)
    idx = torch.zeros(args.batch, args.seq_len, dtype=torch.long)
    start = time.perf_counter()
    profile = profile_model(
        model,
        (idx,),
        loss_fn=lambda out: out.sum(),
        optimizer_factory=lambda ps: torch.optim.AdamW(ps),
        device=args.device,
    )
    return profile, time.perf_counter() - start


def _cbc(graph: Any, budget: float, time_limit: float) -> tuple[MilpResult, bool]:
    """Torch's ``sac_milp``; with its CBC time limit replaced by ``time_limit`` when that is below torch's 180 s."""
    import pulp
    from torch.distributed._tools import sac_ilp

    def capped(**kwargs: Any) -> Any:
        kwargs["timeLimit"] = min(kwargs.get("timeLimit", time_limit), time_limit)
        return pulp.PULP_CBC_CMD(**kwargs)

    with mock.patch.object(sac_ilp, "PULP_CBC_CMD", capped):
        result, prob = run_torch_sac_milp(graph, budget)
    # PuLP reports "Optimal" for a run stopped on time with an incumbent; its solution status tells them apart.
    stopped = result.status == "optimal" and getattr(prob, "sol_status", 1) != pulp.LpSolutionOptimal
    stopped = stopped or result.solver_seconds >= 0.98 * time_limit
    return result, stopped


def _plan(profile: ModelProfile, budget: float, n_segments: int) -> PlanResult:
    tradeoff_module._CACHE.clear()  # a first call in a process fits every curve
    start = time.perf_counter()
    try:
        plan = solve_plan(profile, budget, n_segments=n_segments)
    except BudgetError:
        return PlanResult("infeasible", time.perf_counter() - start)
    seconds = time.perf_counter() - start
    fitted = 0.0
    for fqn, d in plan.decisions.items():
        stats = profile.modules[fqn].op_stats
        assert stats is not None
        t = module_tradeoff(stats, n_segments)
        fitted += t.total_runtime * max(0.0, t.fit(d.discard_ratio))
    return PlanResult(plan.solver_status, seconds, plan.predicted_recompute_ms, fitted, len(plan.decisions))


def _check(graph: Any, budget: float, name: str, res: MilpResult) -> list[str]:
    """Re-evaluate a solution under torch's model: feasible at the budget, objective as the solver says."""
    if math.isnan(res.objective_ms):
        return []
    peak, recompute, problems = evaluate_torch_model(graph, res.decisions)
    out = [f"{name}: {p}" for p in problems]
    if peak > budget * (1 + 1e-6):
        out.append(f"{name}: peak {peak:.6f} GiB over budget {budget:.6f} GiB")
    if abs(recompute - res.objective_ms) > 1e-6 * max(1.0, recompute):
        out.append(f"{name}: objective {res.objective_ms:.6f} ms but torch's model gives {recompute:.6f} ms")
    return out


def _rel(a: float, b: float) -> float:
    return (a - b) / b if b else (0.0 if a == b else math.inf)


def _ms(res: MilpResult) -> str:
    return f"{res.objective_ms:.4f}" if not math.isnan(res.objective_ms) else res.status[:9]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 32], help="GPT blocks per model.")
    parser.add_argument(
        "--budgets",
        type=float,
        nargs="+",
        default=[0.9, 0.8, 0.7, 0.6, 0.5],
        help="Budgets as fractions of the unconstrained peak of torch's memory model.",
    )
    parser.add_argument("--repeats", type=int, default=3, help="Timed runs per solve; the best is reported.")
    parser.add_argument("--repeat-cutoff", type=float, default=5.0, help="Do not repeat a run longer than this, s.")
    parser.add_argument("--cbc-time-limit", type=float, default=30.0, help="CBC time limit, s (torch uses 180).")
    parser.add_argument("--n-segments", type=int, default=2, help="Lines of each trade-off fit.")
    parser.add_argument("--device", default="H100-SXM")
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args(argv)

    if importlib.util.find_spec("pulp") is None:
        print("This benchmark runs PyTorch's sac_milp, which needs PuLP (with its bundled CBC): pip install pulp")
        return 2
    import pulp

    logging.getLogger("torch.distributed._tools.sac_ilp").setLevel(logging.ERROR)  # its ACM < IA notices
    print(
        f"GPT n_embd={args.n_embd} n_head={args.n_head} T={args.seq_len} B={args.batch} vocab={args.vocab}, AdamW; "
        f"{args.device} roofline; torch {torch.__version__}, PuLP {pulp.__version__} (CBC gapRel 0.05, time limit "
        f"{args.cbc_time_limit:g} s), HiGHS gap 1e-4 and 0.05 (@5%), 1 thread each; best of {args.repeats} "
        f"(runs over {args.repeat_cutoff:g} s not repeated)"
    )
    all_rows: dict[int, list[Row]] = {}
    for depth in args.depths:
        profile, profile_s = _profile(depth, args)
        graph = torch_graph_from_profile(profile, args.n_segments)
        peak = torch_unconstrained_peak(graph)
        n_cand = sum(not n["is_leaf"] for n in graph.nodes)
        print()
        print(
            f"== {depth} blocks: profile {profile_s:.2f} s; torch graph {len(graph.nodes)} modules, {n_cand} "
            f"candidates; unconstrained peak: torch's model {peak:.3f} GiB, ours {profile.peak_bytes / _GIB:.3f} GiB "
            "(optimizer state, loss included)"
        )
        rows = []
        for fraction in args.budgets:
            budget = fraction * peak
            cbc, capped = _best_of(args, _cbc, graph, budget, args.cbc_time_limit)
            highs = _best_of(args, highs_sac_milp, graph, budget, mip_gap=1e-4)
            highs5 = _best_of(args, highs_sac_milp, graph, budget, mip_gap=0.05)
            plan = _best_of(args, _plan, profile, budget, args.n_segments)
            row = Row(fraction, budget, cbc, capped, highs, highs5, plan)
            for name, res in (("CBC", cbc), ("HiGHS", highs), ("HiGHS@5%", highs5)):
                row.checks += _check(graph, budget, name, res)
            if (cbc.status == "infeasible") != (highs.status == "infeasible"):
                row.checks.append(f"feasibility differs: CBC {cbc.status}, HiGHS {highs.status}")
            rows.append(row)
            print(
                f"   budget {budget:.3f} GiB done: CBC {cbc.seconds:.2f} s, HiGHS {highs.seconds:.3f} s, "
                f"plan {plan.seconds:.3f} s",
                flush=True,
            )
        all_rows[depth] = rows

        header = (
            f"{'budget':>6} {'GiB':>6} | {'CBC ms':>8} {'HiGHS ms':>9} {'rel diff':>8} {'@5% ms':>8} | "
            f"{'CBC s':>7} {'HiGHS s':>8} {'ratio':>6} {'@5% s':>7} {'ratio':>6} | "
            f"{'plan s':>7} {'plan ms':>8} {'fit ms':>8} {'n':>3} {'status':<18}"
        )
        print()
        print(header)
        print("-" * len(header))
        for r in rows:
            diff = _rel(r.highs.objective_ms, r.cbc.objective_ms)
            diff_s = f"{100 * diff:+.2f}%" if not math.isnan(diff) else "-"
            cbc_s = f"{r.cbc.seconds:.2f}{'*' if r.cbc_capped else ' '}"
            plan_ms = f"{r.plan.recompute_ms:.4f}" if not math.isnan(r.plan.recompute_ms) else "-"
            fit_ms = f"{r.plan.fitted_ms:.4f}" if not math.isnan(r.plan.fitted_ms) else "-"
            print(
                f"{r.fraction:>6.2f} {r.budget_gib:>6.3f} | {_ms(r.cbc):>8} {_ms(r.highs):>9} {diff_s:>8} "
                f"{_ms(r.highs5):>8} | {cbc_s:>7} {r.highs.seconds:>8.3f} {r.highs.seconds / r.cbc.seconds:>6.3f} "
                f"{r.highs5.seconds:>7.3f} {r.highs5.seconds / r.cbc.seconds:>6.3f} | {r.plan.seconds:>7.3f} "
                f"{plan_ms:>8} {fit_ms:>8} {r.plan.modules:>3} {r.plan.status:<18}"
            )
        for r in rows:
            for c in r.checks:
                print(f"  ! budget {r.budget_gib:.3f} GiB: {c}")
        print(
            "  rel diff = (HiGHS - CBC) / CBC at HiGHS gap 1e-4; ratio = HiGHS s / CBC s; * = CBC stopped at its time "
            "limit (its time is a lower bound); plan = solve_plan (exact op-policy recompute, fitted MILP value, "
            "modules checkpointed, HiGHS status)"
        )

    # ---- goals -----------------------------------------------------------------------------------------------
    rows = [r for rs in all_rows.values() for r in rs]
    solved = [r for r in rows if not math.isnan(r.cbc.objective_ms) and not math.isnan(r.highs.objective_ms)]
    diffs = [_rel(r.highs.objective_ms, r.cbc.objective_ms) for r in solved]
    within = sum(abs(d) <= GOAL_OBJECTIVE_REL for d in diffs)
    worse = [d for d in diffs if d > GOAL_OBJECTIVE_REL]
    better = [d for d in diffs if d < -GOAL_OBJECTIVE_REL]
    coincide = not any(r.checks for r in rows)
    obj_ok = coincide and not worse
    ratios = [r.highs.seconds / r.cbc.seconds for r in rows]
    ratios5 = [r.highs5.seconds / r.cbc.seconds for r in rows]
    time_ok = all(x <= GOAL_TIME_RATIO for x in ratios)
    plan_times = [r.plan.seconds for r in all_rows.get(GOAL_PLAN_DEPTH, [])]
    plan_ok = bool(plan_times) and max(plan_times) < GOAL_PLAN_SECONDS

    print()
    print(
        f"Objective (same MILP, {'solutions re-evaluated identically' if coincide else 'CHECKS FAILED, see !'}): "
        f"HiGHS within {100 * GOAL_OBJECTIVE_REL:g}% of CBC at {within}/{len(solved)} budgets"
        + (
            f", lower by {100 * -min(better):.2f}% at most at {len(better)} (CBC stopped at its gap/time limit)"
            if better
            else ""
        )
        + (f", HIGHER by up to {100 * max(worse):.2f}% at {len(worse)}" if worse else "")
        + f": {'HOLDS' if obj_ok else 'DOES NOT HOLD'}."
    )
    gaps = [r.highs.gap for r in solved if not math.isnan(r.highs.gap)]
    if gaps:
        print(f"  (HiGHS at gap 1e-4 proved each of its objectives within {100 * max(gaps):.4f}% of the optimum.)")
    print(
        f"Time: HiGHS / CBC at most {max(ratios):.4f} (gap 1e-4), {max(ratios5):.4f} (gap 0.05), goal <= "
        f"{GOAL_TIME_RATIO}: {'HOLDS' if time_ok else 'DOES NOT HOLD'}."
    )
    if plan_times:
        print(
            f"solve_plan on {GOAL_PLAN_DEPTH} blocks: {min(plan_times):.3f}-{max(plan_times):.3f} s over "
            f"{len(plan_times)} budgets, goal < {GOAL_PLAN_SECONDS:g} s: {'HOLDS' if plan_ok else 'DOES NOT HOLD'}."
        )
    else:
        print(f"solve_plan on {GOAL_PLAN_DEPTH} blocks: NOT EVALUATED (pass --depths ... {GOAL_PLAN_DEPTH}).")
    print(
        f"Goals: {'ALL HOLD' if obj_ok and time_ok and plan_ok else 'NOT ALL HOLD'} (objective {obj_ok}, "
        f"time {time_ok}, solve_plan {GOAL_PLAN_DEPTH} blocks < {GOAL_PLAN_SECONDS:g} s {plan_ok})."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
