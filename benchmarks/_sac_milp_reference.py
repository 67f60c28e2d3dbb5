"""PyTorch's module-level SAC MILP (``torch.distributed._tools.sac_ilp.sac_milp``) fed with our profile's numbers.

Three pieces, all driven by ``solver_speed.py``:

* :func:`torch_graph_from_profile` turns a :class:`~lightning_sac.dryrun.data.ModelProfile` into torch's
  ``ilp_utils.Graph`` (through torch's own ``parse_module_info``), one ``ModStats`` per module that ran, with
  our memory snapshots, runtimes and trade-off fits in torch's fields;
* :func:`run_torch_sac_milp` calls torch's ``sac_milp`` (PuLP + CBC) unchanged, recording the PuLP problem it
  builds so that the unrounded objective and the raw decisions can be read back;
* :func:`highs_sac_milp` is our own HiGHS formulation of exactly the same MILP (same feasible set and objective
  on integer points), and :func:`evaluate_torch_model` re-evaluates any decision under torch's model, so both
  solvers' answers are checked by one independent piece of arithmetic.

Torch's MILP, per module ``i`` in forward pre-order (memory in GiB, runtime in ms)::

    d_i   = ACM_i r_i - (ACM_i - IA_i) y_i                 (discarded activations; ACM = sac_memory, IA = act_fw)
    m_i   = TA_i + AG_i - sum_{j before i in fw post-order} d_j + (P_root + TG_i) / world_size
    max_i m_i <= budget
    r_i <= y_i,  r_i >= (ACM_i - IA_i) / ACM_i y_i,  y_i = 0 for leaves,  y_i + y_j <= 1 for ancestor/descendant
    rct_i = ACT_i max(0, max_s slope_s r_i + intercept_s) if y_i else 0
    minimize sum_i rct_i

Our HiGHS version keeps those semantics and only writes them tighter: ``d``, ``a``, ``m`` and ``max_m`` are
substituted out, leaves (``y = 0``) get no columns, the big-M linearisation of ``rct`` becomes the perspective
form ``rct_i >= ACT_i (slope_s r_i + intercept_s y_i)`` (identical at ``y`` in {0, 1}, tighter in between), and
of the memory rows that share the same set of preceding candidates only the largest constant is kept (all
``d_j >= 0``, so rows whose constant is already within the budget are dropped too).
"""

from __future__ import annotations

import bisect
import copy
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import highspy
import numpy as np
from torch.distributed._tools.ilp_utils import Graph, parse_module_info

from lightning_sac.dryrun.data import ModelProfile
from lightning_sac.solver.highs import new_highs
from lightning_sac.solver.tradeoff import module_tradeoff

__all__ = [
    "MilpResult",
    "evaluate_torch_model",
    "highs_sac_milp",
    "read_pulp_solution",
    "run_torch_sac_milp",
    "torch_graph_from_profile",
    "torch_unconstrained_peak",
]

GIB = 2**30


@dataclass
class MilpResult:
    """One solve of torch's MILP.

    Attributes:
        status: ``"optimal"``, ``"infeasible"`` or the solver's own status word.
        objective_ms: Unrounded objective (sum of ``rct``), ms; ``nan`` without a solution.
        decisions: Node index -> discard ratio ``r`` of every module with ``y = 1``.
        seconds: Wall time of the whole call (model building included).
        solver_seconds: Time the solver itself reported, when it does.
        reported_ms: What the solver's own API returned as objective (torch rounds it to 0.01 ms).
        gap: Relative gap the solver proved (HiGHS only; ``nan`` for CBC, whose gap PuLP does not report).
    """

    status: str
    objective_ms: float = math.nan
    decisions: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0
    solver_seconds: float = math.nan
    reported_ms: float = math.nan
    gap: float = math.nan


def _torch_fqn(root_name: str, fqn: str) -> str:
    # torch's MemTracker names the root after its class and prefixes every other fqn with it; its ancestor test
    # (``name_ancestor + "." in name_descendant``) relies on that: with our root fqn "" the root would not be seen
    # as an ancestor of "wte" and the pre-order scan that fills ``ad_matrix`` would stop right there.
    return root_name if fqn == "" else f"{root_name}.{fqn}"


def torch_graph_from_profile(profile: ModelProfile, n_segments: int = 2) -> Graph:
    """Torch's ``Graph`` of the modules in our profile, with our numbers in torch's ``ModStats`` fields.

    Modules that ran at least once and appear in both forward orders become nodes (torch's ``parse_module_info``
    asserts one stats entry per pre-order name). A module is a checkpoint candidate (``is_leaf=False``, with its
    ``sac_*`` fields and fit) exactly when it is one of ours, i.e. :func:`lightning_sac.solver.milp.find_candidates`
    would keep it; every other module is treated the way torch treats modules without SAC statistics: ``is_leaf``
    with ``sac_*`` zero.
    """
    from lightning_sac.solver import find_candidates

    candidates = {c.fqn: c for c in find_candidates(profile, None, n_segments)}
    post = set(profile.forward_post_order)
    kept = [f for f in profile.forward_pre_order if f in post and profile.modules[f].calls >= 1]
    kept_set = set(kept)
    root_name = profile.modules[""].module_type if "" in profile.modules else "model"
    stats: list[dict[str, Any]] = []
    for fqn in kept:
        m = profile.modules[fqn]
        mem = m.memory
        cand = candidates.get(fqn)
        if cand is not None and m.op_stats is not None:
            t = module_tradeoff(m.op_stats, n_segments)
            sac = {
                "is_leaf": False,
                "sac_runtime": t.total_runtime,
                "sac_memory": t.total_memory,
                "n_segments": len(t.slopes),
                "slopes": list(t.slopes),
                "intercepts": list(t.intercepts),
                "breakpoints": list(t.breaks),
                "tradeoff_curve": OrderedDict(t.curve),
            }
        else:
            sac = {
                "is_leaf": True,
                "sac_runtime": 0.0,
                "sac_memory": 0,
                "n_segments": 0,
                "slopes": [],
                "intercepts": [],
                "breakpoints": [],
                "tradeoff_curve": OrderedDict(),
            }
        stats.append(
            {
                "fqn": _torch_fqn(root_name, fqn),
                "param_per_module": m.parameter_bytes,
                "grad_per_module": m.gradient_bytes,
                "grad_total": mem["pre_backward"]["gradient"],
                "act_fw_per_module": max(
                    0, mem["post_forward"]["activation"] - mem["pre_forward"]["activation"] - m.output_bytes
                ),
                "act_bw_per_module": max(0, mem["peak_backward"]["activation"]),
                "act_grad_per_module": mem["peak_backward"]["temporary"] - mem["pre_backward"]["temporary"],
                "act_total": mem["post_forward"]["activation"],
                "input_per_module": m.input_bytes,
                "output_per_module": m.output_bytes,
                "fw_runtime_per_module": m.forward_ms,
                "bw_runtime_per_module": m.backward_ms,
                **sac,
            }
        )
    order = {
        "fw_pre_order": [_torch_fqn(root_name, f) for f in kept],
        "fw_post_order": [_torch_fqn(root_name, f) for f in profile.forward_post_order if f in kept_set],
        "bw_pre_order": [_torch_fqn(root_name, f) for f in profile.backward_pre_order if f in kept_set],
        "bw_post_order": [_torch_fqn(root_name, f) for f in profile.backward_post_order if f in kept_set],
    }
    return parse_module_info({"mod_order": order, "mod_stats": stats})  # type: ignore[typeddict-item]


def _acm_ia(node: dict[str, Any]) -> tuple[float, float]:
    """ACM and IA of a node, bytes, with torch's override (ACM is raised to IA when below it)."""
    ia = float(node["act_fw_per_module"])
    acm = float(node["sac_memory"])
    if not node["is_leaf"] and acm < ia:
        acm = ia
    return acm, ia


def _memory_constants(graph: Graph, world_size: int) -> list[float]:
    """Per node, GiB: ``TA_i + AG_i + (P_root + TG_i) / world_size``, i.e. ``m_i`` with nothing discarded."""
    p_root = graph.nodes[0]["param_per_module"]
    return [
        (n["act_total"] + n["act_grad_per_module"]) / GIB + (p_root + n["grad_total"]) / GIB / world_size
        for n in graph.nodes
    ]


def torch_unconstrained_peak(graph: Graph, world_size: int = 1) -> float:
    """Torch's model's peak without checkpointing, GiB (``get_peak_memory_runtime_baseline`` / world size)."""
    return max(_memory_constants(graph, world_size))


def evaluate_torch_model(
    graph: Graph, decisions: dict[int, float], world_size: int = 1
) -> tuple[float, float, list[str]]:
    """Torch's model evaluated at a decision: ``(peak GiB, recompute ms, violated side constraints)``.

    ``decisions`` maps node index -> discard ratio for modules with ``y = 1``; the peak is ``max_i m_i`` and the
    recompute ``sum ACT_i max(0, max_s slope_s r_i + intercept_s)``, both exactly as in ``sac_milp``.
    """
    problems = []
    d = [0.0] * len(graph.nodes)
    recompute = 0.0
    for i, r in decisions.items():
        node = graph.nodes[i]
        if node["is_leaf"]:
            problems.append(f"leaf {node['fqn']} checkpointed")
            continue
        acm, ia = _acm_ia(node)
        if r < (acm - ia) / acm - 1e-6 or r > 1 + 1e-9:
            problems.append(f"{node['fqn']}: r={r:.6f} outside [{(acm - ia) / acm:.6f}, 1]")
        d[i] = (acm * r - (acm - ia)) / GIB
        fit = max((s * r + b for s, b in zip(node["slopes"], node["intercepts"], strict=True)), default=0.0)
        recompute += node["sac_runtime"] * max(0.0, fit)
    for i in decisions:
        for j in decisions:
            if i < j and graph.ad_matrix[i][j] == 1:
                problems.append(f"nested: {graph.nodes[i]['fqn']} and {graph.nodes[j]['fqn']}")
    constants = _memory_constants(graph, world_size)
    peak = 0.0
    for i, node in enumerate(graph.nodes):
        before = graph.fw_post_order[: node["pos_fw_post_order"]]
        freed = sum(d[graph.name2node[f]["index"]] for f in before)
        peak = max(peak, constants[i] - freed)
    return peak, recompute, problems


def run_torch_sac_milp(graph: Graph, budget_gib: float, world_size: int = 1) -> tuple[MilpResult, Any]:
    """Call torch's ``sac_milp`` (PuLP + CBC, ``gapRel=0.05``) and read its problem back.

    Returns the result and the PuLP problem it solved (to re-solve it with other CBC options). ``sac_milp``
    itself is not changed: its module-level ``LpProblem`` name is wrapped, for the duration of the call, by a
    subclass that only remembers the instance.
    """
    from torch.distributed._tools import sac_ilp

    problems: list[Any] = []

    class _Recorded(sac_ilp.LpProblem):  # type: ignore[misc,name-defined]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            problems.append(self)

    graph = copy.deepcopy(graph)  # sac_milp may overwrite sac_memory in place
    with mock.patch.object(sac_ilp, "LpProblem", _Recorded):
        start = time.perf_counter()
        decisions, reported, peak = sac_ilp.sac_milp(graph, budget_gib, world_size=world_size)
        seconds = time.perf_counter() - start
    prob = problems[-1]
    result = read_pulp_solution(prob, graph)
    result.seconds = seconds
    result.reported_ms = float(reported) if peak != -1 else math.nan
    return result, prob


def read_pulp_solution(prob: Any, graph: Graph) -> MilpResult:
    """Status, unrounded objective and ``{index: r}`` of a solved PuLP problem built by ``sac_milp``."""
    import pulp

    status = pulp.LpStatus[prob.status].lower()
    result = MilpResult(status=status, solver_seconds=float(getattr(prob, "solutionTime", math.nan)))
    if prob.status != 1:
        return result
    result.objective_ms = float(pulp.value(prob.objective))
    values = {v.name: v.varValue for v in prob.variables()}
    for i in range(len(graph.nodes)):
        y = values.get(f"y_{i}")
        if y is not None and round(y) == 1:
            result.decisions[i] = float(values.get(f"r_{i}") or 0.0)
    return result


def highs_sac_milp(
    graph: Graph, budget_gib: float, world_size: int = 1, *, mip_gap: float = 1e-4, time_limit_s: float = 180.0
) -> MilpResult:
    """Torch's MILP on ``graph`` (see the module docstring), solved by HiGHS; model building is timed too."""
    start = time.perf_counter()
    nodes = graph.nodes
    cands = [i for i, n in enumerate(nodes) if not n["is_leaf"]]
    k = len(cands)
    col = {i: c for c, i in enumerate(cands)}  # y: c, r: k + c, rct: 2k + c
    acm_ia = {i: _acm_ia(nodes[i]) for i in cands}

    h = new_highs(time_limit_s=time_limit_s, mip_gap=mip_gap)
    inf = highspy.kHighsInf
    costs = np.concatenate([np.zeros(2 * k), np.ones(k)])
    lower = np.zeros(3 * k)
    upper = np.concatenate([np.ones(2 * k), np.full(k, inf)])
    h.addVars(3 * k, lower, upper)
    h.changeColsCost(3 * k, np.arange(3 * k, dtype=np.int32), costs)
    if k:
        h.changeColsIntegrality(
            k, np.arange(k, dtype=np.int32), np.full(k, highspy.HighsVarType.kInteger, dtype=np.uint8)
        )

    rows_lo: list[float] = []
    rows_hi: list[float] = []
    starts: list[int] = []
    index: list[int] = []
    value: list[float] = []

    def row(lo: float, hi: float, terms: list[tuple[int, float]]) -> None:
        starts.append(len(index))
        rows_lo.append(lo)
        rows_hi.append(hi)
        for j, v in terms:
            if v != 0.0:
                index.append(j)
                value.append(v)

    for c, i in enumerate(cands):
        node = nodes[i]
        acm, ia = acm_ia[i]
        row(-inf, 0.0, [(k + c, 1.0), (c, -1.0)])  # r <= y
        row(-inf, 0.0, [(c, (acm - ia) / acm), (k + c, -1.0)])  # r >= (ACM - IA) / ACM * y
        act = float(node["sac_runtime"])
        for s, b in zip(node["slopes"][: node["n_segments"]], node["intercepts"][: node["n_segments"]], strict=True):
            row(-inf, 0.0, [(k + c, act * s), (c, act * b), (2 * k + c, -1.0)])  # rct >= ACT (s r + b y)
    for a in range(k):
        for b in range(a + 1, k):
            if graph.ad_matrix[cands[a]][cands[b]] == 1:
                row(-inf, 1.0, [(a, 1.0), (b, 1.0)])

    # Memory: const_i - sum_{candidates j before i in fw post-order} d_j <= budget. The candidates before i are a
    # prefix of the candidates in post order, so rows with equally many of them differ only in the constant.
    constants = _memory_constants(graph, world_size)
    post_cands = [j for j in (graph.name2node[f]["index"] for f in graph.fw_post_order) if j in col]
    cand_pos = [nodes[j]["pos_fw_post_order"] for j in post_cands]  # increasing
    worst: dict[int, float] = {}
    for i, node in enumerate(nodes):
        n_before = bisect.bisect_left(cand_pos, node["pos_fw_post_order"])
        worst[n_before] = max(worst.get(n_before, -inf), constants[i])
    for n_before, const in sorted(worst.items()):
        if const <= budget_gib:
            continue  # every d_j >= 0: already satisfied
        terms = []
        for j in post_cands[:n_before]:
            acm, ia = acm_ia[j]
            # -d_j = -(ACM_j r_j - (ACM_j - IA_j) y_j)
            terms += [(k + col[j], -acm / GIB), (col[j], (acm - ia) / GIB)]
        row(-inf, budget_gib - const, terms)

    if starts:
        h.addRows(
            len(starts),
            np.asarray(rows_lo),
            np.asarray(rows_hi),
            len(index),
            np.asarray(starts, dtype=np.int32),
            np.asarray(index, dtype=np.int32),
            np.asarray(value),
        )
    h.run()
    status = h.getModelStatus()
    result = MilpResult(status=h.modelStatusToString(status).lower())
    if status == highspy.HighsModelStatus.kInfeasible:
        result.status = "infeasible"
    elif h.getInfo().primal_solution_status != 0:
        x = list(h.getSolution().col_value)
        result.objective_ms = float(sum(x[2 * k :]))
        result.decisions = {i: float(x[k + c]) for c, i in enumerate(cands) if x[c] > 0.5}
        result.reported_ms = float(h.getInfo().objective_function_value)
        result.gap = float(h.getInfo().mip_gap)
    result.seconds = time.perf_counter() - start
    result.solver_seconds = float(h.getRunTime())
    return result
