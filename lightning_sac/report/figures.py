"""Matplotlib figures of a plan: trade-off curves, memory per module, memory across the step, measured timeline.

Each function returns a ``matplotlib.figure.Figure`` built with the object API (no global pyplot state), so
figures can be made from any thread and handed to TensorBoard's ``add_figure``.
"""

from __future__ import annotations

from typing import Any

from lightning_sac.measure import TIMELINE_CATEGORIES, MemoryTimeline
from lightning_sac.plan import Plan
from lightning_sac.profiling.data import ModelProfile
from lightning_sac.solver.memory_model import activation_windows, ddp_bucket_bytes, device_bytes
from lightning_sac.solver.milp import find_candidates
from lightning_sac.tradeoff import ModuleTradeoff

__all__ = [
    "measured_timeline_figure",
    "module_memory_figure",
    "predicted_step_memory",
    "step_memory_figure",
    "top_modules",
    "tradeoff_figure",
]

_GIB = 2**30


def _figure(width: float = 7.0, height: float = 4.0) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def tradeoff_figure(fqn: str, tradeoff: ModuleTradeoff, discard: float | None = None) -> Any:
    """The module's greedy trade-off curve, its piecewise-linear fit, and the chosen discard ratio."""
    fig = _figure(5.5, 4.0)
    ax = fig.add_subplot()
    xs = [100 * x for x, _ in tradeoff.curve]
    ys = [100 * y for _, y in tradeoff.curve]
    ax.plot(xs, ys, "o-", label="greedy curve", color="tab:blue", markersize=3)
    grid = [i / 100 * tradeoff.max_discard for i in range(101)]
    ax.plot(
        [100 * g for g in grid],
        [100 * tradeoff.fit(g) for g in grid],
        "--",
        label="fit (never below)",
        color="tab:orange",
    )
    if discard is not None:
        ax.axvline(100 * discard, color="tab:red", label=f"chosen: {100 * discard:.1f}% discarded")
    ax.set_xlabel("activation memory discarded (%)")
    ax.set_ylabel(f"runtime recomputed (% of {tradeoff.total_runtime:.3f} ms)")
    ax.set_title(f"{fqn}: {tradeoff.total_memory / 2**20:.1f} MiB of op memory")
    ax.legend(loc="upper left", fontsize="small")
    return fig


def top_modules(profile: ModelProfile, plan: Plan, n: int) -> list[str]:
    """The checkpointed modules, then the other candidates with the most retained activation memory, ``n`` in all."""
    others = sorted((c for c in find_candidates(profile) if c.fqn not in plan.decisions), key=lambda c: -c.retained)
    return (list(plan.decisions) + [c.fqn for c in others])[: max(n, len(plan.decisions))]


def module_memory_figure(profile: ModelProfile, plan: Plan, n: int = 12) -> Any:
    """Predicted memory per module by category (GiB), without and with the plan, for the ``n`` largest modules."""
    import numpy as np

    fqns = top_modules(profile, plan, n)
    cats = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes")
    labels = ("parameters", "gradients", "optimizer state")
    without = {
        label: [getattr(profile.modules[f], c) / _GIB for f in fqns] for c, label in zip(cats, labels, strict=True)
    }
    retained = {c.fqn: c.retained for c in find_candidates(profile)}
    acts = [retained.get(f, 0) / _GIB for f in fqns]
    freed = [plan.decisions[f].freed_bytes / _GIB if f in plan.decisions else 0.0 for f in fqns]
    fig = _figure(max(7.0, 0.6 * len(fqns)), 4.5)
    ax = fig.add_subplot()
    x = np.arange(len(fqns))
    for offset, with_plan in ((-0.2, False), (0.2, True)):
        bottom = np.zeros(len(fqns))
        for (label, values), color in zip(without.items(), ("darkgreen", "mediumblue", "goldenrod"), strict=True):
            ax.bar(x + offset, values, 0.38, bottom=bottom, color=color, label=label if not with_plan else None)
            bottom += np.asarray(values)
        act = np.asarray(acts) - (np.asarray(freed) if with_plan else 0.0)
        ax.bar(
            x + offset,
            act,
            0.38,
            bottom=bottom,
            color="red",
            alpha=1.0 if with_plan else 0.45,
            label="activations with plan" if with_plan else "activations without plan",
        )
    ax.set_xticks(x, [f or "<root>" for f in fqns], rotation=45, ha="right", fontsize="small")
    ax.set_ylabel("memory (GiB)")
    ax.set_title("predicted memory per module: without (left) and with (right) the plan")
    ax.legend(fontsize="small")
    return fig


def predicted_step_memory(profile: ModelProfile, plan: Plan | None) -> list[int]:
    """Predicted bytes on one device at each timeline event's peak, with ``plan`` applied (or without one)."""
    freed = {} if plan is None else {f: d.freed_bytes for f, d in plan.decisions.items()}
    windows = activation_windows(profile)
    world = plan.world_size if plan is not None else 1
    sharding = plan.sharding if plan is not None else "replicated"
    out = []
    bucket = ddp_bucket_bytes(profile)
    for k, e in enumerate(profile.timeline[:-1]):
        value = device_bytes(e.peak_after or e.at, world, sharding, bucket)
        for f, b in freed.items():
            if f in windows and windows[f][0] <= k < windows[f][1]:
                # What the checkpoint frees, less the inputs it keeps that the plain step has freed by now.
                value -= b - sum(n for at, n in profile.modules[f].freed_inputs if at <= k)
        out.append(value)
    return out


def step_memory_figure(profile: ModelProfile, plan: Plan) -> Any:
    """Predicted memory at every module boundary of forward and backward, without and with the plan (GiB)."""
    without = [b / _GIB for b in predicted_step_memory(profile, None)]
    with_plan = [b / _GIB for b in predicted_step_memory(profile, plan)]
    fig = _figure(8.0, 4.0)
    ax = fig.add_subplot()
    ax.plot(without, label=f"without plan (peak {plan.unconstrained_peak_bytes / _GIB:.3f} GiB)", color="grey")
    ax.plot(with_plan, label=f"with plan (peak {plan.predicted_peak_bytes / _GIB:.3f} GiB)", color="tab:blue")
    ax.axhline(plan.budget_bytes / _GIB, color="tab:red", linestyle="--", label=f"budget {plan.budget_gb:.3f} GiB")
    phases = [(k, e.name) for k, e in enumerate(profile.timeline[:-1]) if e.kind == "phase"]
    for k, name in phases:
        ax.axvline(k, color="black", linewidth=0.5)
        ax.text(k, ax.get_ylim()[1], f" {name}", va="top", fontsize="small")
    ax.set_xlabel("module boundary of the step (forward, backward, optimizer)")
    ax.set_ylabel("memory on one device (GiB)")
    ax.set_title(f"predicted memory across the step on {plan.device}")
    ax.legend(loc="lower center", fontsize="small")
    return fig


def measured_timeline_figure(timeline: MemoryTimeline, budget_bytes: int | None = None) -> Any:
    """A measured step's memory as a stacked area by PyTorch's memory profiler categories (GiB over ms)."""
    fig = _figure(8.0, 4.0)
    ax = fig.add_subplot()
    ms = [t / 1000 for t in timeline.times_us]
    stacks = [[b / _GIB for b in timeline.by_category[c]] for c in TIMELINE_CATEGORIES]
    ax.stackplot(ms, stacks, labels=[c.replace("_", " ") for c in TIMELINE_CATEGORIES], alpha=0.85)
    if budget_bytes is not None:
        ax.axhline(budget_bytes / _GIB, color="tab:red", linestyle="--", label="budget")
    ax.set_xlabel("time in the step (ms)")
    ax.set_ylabel("memory (GiB)")
    ax.set_title("measured memory of one training step with the plan")
    ax.legend(loc="upper left", fontsize="x-small", ncol=3)
    return fig
