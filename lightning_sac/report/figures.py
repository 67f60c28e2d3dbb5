"""Matplotlib figures of a plan: trade-off curves, memory per module, memory across the step, measured timeline.

Each function returns a ``matplotlib.figure.Figure`` built with the object API (no global pyplot state), so
figures can be made from any thread and handed to TensorBoard's ``add_figure``. The numbers come from
:mod:`lightning_sac.report.figure_data`.

Memory is in the unit of the plan table (:mod:`lightning_sac.plan.table`): MiB or GiB by size, with the
same decimals as the console, so the two read alike.

TensorBoard shows an image scaled to the width of its card, about 400 to 500 pixels: figures are 640 pixels
wide with 12 to 15 point text, so that text stays legible in the card, and legends sit below the axes, where
they cover no curve.
"""

from __future__ import annotations

from typing import Any

from lightning_sac.dryrun import TIMELINE_CATEGORIES, MemoryTimeline, ModelProfile
from lightning_sac.plan import ByteUnit, Plan, plan_unit
from lightning_sac.report.figure_data import ModuleBars, measured_unit, module_memory, step_memory
from lightning_sac.solver import ModuleTradeoff

__all__ = [
    "measured_timeline_figure",
    "module_memory_figure",
    "step_memory_figure",
    "tradeoff_figure",
]

_TITLE, _LABEL, _TICK, _LEGEND = 15, 14, 12, 12


def _figure(width: float = 6.4, height: float = 4.8) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _style(ax: Any) -> None:
    ax.tick_params(labelsize=_TICK)
    ax.grid(alpha=0.3)


def _legend_below(fig: Any, axes: list[Any], ncol: int) -> Any:
    """One legend for ``axes`` below them, outside the plot area."""
    handles, labels = [], []
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    return fig.legend(handles, labels, loc="outside lower center", ncol=ncol, fontsize=_LEGEND, frameon=False)


def _per_device(plan: Plan) -> str:
    if plan.world_size == 1:
        return "one device"
    return f"one of {plan.world_size} devices, {plan.sharding}"


def tradeoff_figure(fqn: str, tradeoff: ModuleTradeoff, discard: float | None = None) -> Any:
    """The module's greedy trade-off curve, its piecewise-linear fit, and the chosen discard ratio."""
    fig = _figure()
    ax = fig.add_subplot()
    xs = [100 * x for x, _ in tradeoff.curve]
    ys = [100 * y for _, y in tradeoff.curve]
    ax.plot(xs, ys, "o-", label="greedy curve", color="tab:blue", markersize=4, linewidth=2)
    grid = [i / 100 * tradeoff.max_discard for i in range(101)]
    ax.plot(
        [100 * g for g in grid],
        [100 * tradeoff.fit(g) for g in grid],
        "--",
        label="fit (never below)",
        color="tab:orange",
        linewidth=2,
    )
    if discard is not None:
        ax.axvline(100 * discard, color="tab:red", linewidth=2, label=f"chosen: {100 * discard:.1f}% discarded")
    ax.set_xlabel("activation memory discarded (%)", fontsize=_LABEL)
    ax.set_ylabel(f"recomputed (% of {tradeoff.total_runtime:.3g} ms)", fontsize=_LABEL)
    ax.set_title(f"{_short(fqn or '<root>', 28)}: {tradeoff.total_memory / 2**20:.1f} MiB", fontsize=_TITLE)
    _style(ax)
    _legend_below(fig, [ax], ncol=2)
    return fig


def _short(name: str, width: int) -> str:
    """``name``, or its tail behind an ellipsis when longer than ``width``: the tail tells modules apart."""
    return name if len(name) <= width else "…" + name[-(width - 1) :]


def _bars(ax: Any, bars: ModuleBars, names: list[str], unit: ByteUnit, with_legend: bool) -> None:
    """Stacked bars per entry of ``bars``: without the plan on the left of each pair, with it on the right."""
    import numpy as np

    x = np.arange(len(bars.fqns))
    stacks = (
        ("parameters", bars.parameters, "darkgreen"),
        ("gradients", bars.gradients, "mediumblue"),
        ("optimizer state", bars.optimizer_state, "goldenrod"),
    )
    for offset, with_plan in ((-0.2, False), (0.2, True)):
        bottom = np.zeros(len(x))
        for label, values, color in stacks:
            height = np.asarray(values, dtype=float) / unit.size
            ax.bar(x + offset, height, 0.38, bottom=bottom, color=color, label=label if with_legend else None)
            bottom += height
        acts = np.asarray(bars.activations_with if with_plan else bars.activations_without, dtype=float) / unit.size
        label = "activations with plan" if with_plan else "activations without plan"
        ax.bar(
            x + offset,
            acts,
            0.38,
            bottom=bottom,
            color="red",
            alpha=1.0 if with_plan else 0.4,
            label=label if with_legend else None,
        )
    ax.set_xticks(x, names, rotation=35, ha="right", rotation_mode="anchor")
    _style(ax)


def module_memory_figure(profile: ModelProfile, plan: Plan, n: int = 12) -> Any:
    """Predicted memory per device by category, without and with the plan, in the plan table's unit.

    The ``n`` largest modules on one axis, the whole model (the root module) apart on its own, since it holds
    every parameter and activation and would dwarf the rest.
    """
    data = module_memory(profile, plan, n)
    unit = plan_unit(plan)
    panels = [(data.model, ["whole model"], "whole model"), (data.modules, data.modules.fqns, "per module")]
    panels = [p for p in panels if p[0].fqns]
    fig = _figure(max(6.4, 0.55 * len(data.modules.fqns) + 2.2), 5.6)
    axes = fig.subplots(1, len(panels), width_ratios=[max(1, len(p[0].fqns)) for p in panels], squeeze=False)[0]
    for ax, (bars, names, title) in zip(axes, panels, strict=True):
        _bars(ax, bars, [_short(name, 22) for name in names], unit, with_legend=ax is axes[0])
        ax.set_title(title, fontsize=_LABEL)
    axes[0].set_ylabel(f"{unit.name} per device", fontsize=_LABEL)
    fig.suptitle(f"predicted memory, {_per_device(plan)}\nleft bar: without plan, right bar: with", fontsize=_TITLE)
    _legend_below(fig, list(axes), ncol=2)
    return fig


def step_memory_figure(profile: ModelProfile, plan: Plan) -> Any:
    """Predicted memory on one device across the step, without and with the plan, against the budget.

    Both curves use the plan's world size and sharding (:func:`~lightning_sac.report.figure_data.step_memory`);
    memory is in the unit of the plan table (:func:`~lightning_sac.plan.table.plan_unit`).
    """
    data = step_memory(profile, plan)
    unit = plan_unit(plan)
    fig = _figure(6.4, 5.0)
    ax = fig.add_subplot()
    without_label = f"without plan: peak {unit(plan.unconstrained_peak_bytes)}"
    ax.plot([b / unit.size for b in data.without], label=without_label, color="grey", linewidth=2)
    with_label = f"with plan: peak {unit(plan.predicted_peak_bytes)}"
    ax.plot([b / unit.size for b in data.with_plan], label=with_label, color="tab:blue", linewidth=2)
    budget_label = f"budget {unit(plan.budget_bytes)}"
    ax.axhline(plan.budget_bytes / unit.size, color="tab:red", linestyle="--", label=budget_label)
    # The phases as the x ticks: boundary numbers mean nothing to a reader, the phase they fall in does.
    for k, _ in data.phases:
        ax.axvline(k, color="black", linewidth=0.8)
    ax.set_xticks([k for k, _ in data.phases], [name for _, name in data.phases], ha="left")
    ax.set_xlabel("module boundaries of the step", fontsize=_LABEL)
    ax.set_ylabel(f"{unit.name} per device", fontsize=_LABEL)
    ax.set_title(f"predicted memory on {plan.device}, {_per_device(plan)}", fontsize=_TITLE)
    _style(ax)
    _legend_below(fig, [ax], ncol=2)
    return fig


def measured_timeline_figure(timeline: MemoryTimeline, budget_bytes: int | None = None) -> Any:
    """A measured step's memory as a stacked area by PyTorch's memory profiler categories, over ms."""
    unit = measured_unit(timeline.peak_bytes, budget_bytes)
    fig = _figure(6.4, 5.4)
    ax = fig.add_subplot()
    ms = [t / 1000 for t in timeline.times_us]
    stacks = [[b / unit.size for b in timeline.by_category[c]] for c in TIMELINE_CATEGORIES]
    ax.stackplot(ms, stacks, labels=[c.replace("_", " ") for c in TIMELINE_CATEGORIES], alpha=0.85)
    if budget_bytes is not None:
        ax.axhline(budget_bytes / unit.size, color="tab:red", linestyle="--", linewidth=2, label="budget")
    ax.set_xlabel("time (ms)", fontsize=_LABEL)
    ax.set_ylabel(unit.name, fontsize=_LABEL)
    ax.set_title(f"measured with the plan: peak {unit(timeline.peak_bytes)}", fontsize=_TITLE)
    _style(ax)
    _legend_below(fig, [ax], ncol=3)
    return fig
