"""Matplotlib figures of a plan: trade-off curves, memory per module, memory across the step, measured timeline.

Each function returns a ``matplotlib.figure.Figure`` built with the object API (no global pyplot state), so
figures can be made from any thread and handed to TensorBoard's ``add_figure``. The numbers come from
:mod:`lightning_sac.report.figure_data`.

Memory is in the unit of the plan table (:mod:`lightning_sac.plan.table`): MiB or GiB by size, with the
same decimals as the console, so the two read alike.

TensorBoard shows an image scaled to the width of its card, about 400 to 500 pixels: figures are 640 to 800
pixels wide with 12 to 15 point text, so that text stays legible in the card, and legends sit below the axes,
where they cover no curve. Numeric tick labels have the fewest decimals that print every tick apart and as its
value (:func:`tick_decimals`): a narrow range such as 0.332 to 0.334 GiB gets four, never ``0.333, 0.333``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lightning_sac.dryrun import TIMELINE_CATEGORIES, MemoryTimeline, ModelProfile
from lightning_sac.plan import ByteUnit, Plan, plan_unit
from lightning_sac.report.figure_data import (
    ModuleBars,
    PeakComposition,
    measured_unit,
    module_memory,
    step_memory,
)
from lightning_sac.solver import ModuleTradeoff

__all__ = [
    "distinct_ticks",
    "measured_timeline_figure",
    "module_memory_figure",
    "step_memory_figure",
    "tick_decimals",
    "tradeoff_figure",
]

_TITLE, _LABEL, _TICK, _LEGEND = 15, 14, 12, 12


def _figure(width: float = 6.4, height: float = 4.8) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def tick_decimals(ticks: Sequence[float], most: int = 10) -> int:
    """The fewest decimals (up to ``most``) that print each of ``ticks`` apart from the others and as its value.

    "As its value": the printed tick differs from the tick by less than a millionth of the ticks' spacing, so that
    0.3325 is never printed as 0.333 beside a 0.333 of its own. A lone tick gets three significant digits.
    """
    values = sorted(set(ticks))
    if len(values) < 2:
        top = abs(values[0]) if values else 0.0
        return 0 if top == 0 else min(most, max(0, 2 - math.floor(math.log10(top))))
    spacing = min(b - a for a, b in zip(values, values[1:], strict=False))
    for decimals in range(most + 1):
        labels = [f"{v:.{decimals}f}" for v in values]
        exact = all(abs(float(label) - v) < 1e-6 * spacing for label, v in zip(labels, values, strict=True))
        if exact and len(set(labels)) == len(labels):
            return decimals
    return most


def distinct_ticks(axis: Any) -> None:
    """Label ``axis``'s ticks with :func:`tick_decimals` of the ticks it shows."""
    from matplotlib.ticker import Formatter

    class DistinctTicks(Formatter):
        decimals = 0

        def set_locs(self, locs: list[float]) -> None:
            super().set_locs(locs)
            lo, hi = sorted(axis.get_view_interval())
            # Only the ticks inside the view are drawn: those are the ones that must read apart.
            self.decimals = tick_decimals([t for t in locs if lo - 1e-9 * (hi - lo) <= t <= hi + 1e-9 * (hi - lo)])

        def __call__(self, x: float, pos: int | None = None) -> str:
            return f"{x:.{self.decimals}f}"

    axis.set_major_formatter(DistinctTicks())


def _style(ax: Any, *, numeric_x: bool = False) -> None:
    ax.tick_params(labelsize=_TICK)
    ax.grid(alpha=0.3)
    distinct_ticks(ax.yaxis)
    if numeric_x:
        distinct_ticks(ax.xaxis)


def _legend_below(fig: Any, axes: list[Any], ncol: int, order: Sequence[str] = ()) -> Any:
    """One legend for ``axes`` below them, outside the plot area; labels in ``order`` first, in that order."""
    handles: dict[str, Any] = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, h)
    rank = {label: i for i, label in enumerate(order)}
    labels = sorted(handles, key=lambda label: rank.get(label, len(rank)))
    return fig.legend(
        [handles[label] for label in labels],
        labels,
        loc="outside lower center",
        ncol=ncol,
        fontsize=_LEGEND,
        frameon=False,
    )


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
    _style(ax, numeric_x=True)
    _legend_below(fig, [ax], ncol=2)
    return fig


def _short(name: str, width: int) -> str:
    """``name``, or its tail behind an ellipsis when longer than ``width``: the tail tells modules apart."""
    return name if len(name) <= width else "…" + name[-(width - 1) :]


_COLORS = {
    "parameters": "darkgreen",
    "gradients": "mediumblue",
    "optimizer state": "goldenrod",
    "CUDA reserve": "silver",
}


def _bars(ax: Any, bars: ModuleBars, names: list[str], unit: ByteUnit) -> None:
    """Stacked bars per entry of ``bars``: without the plan on the left of each pair, with it on the right."""
    import numpy as np

    x = np.arange(len(bars.fqns))
    stacks = (
        ("parameters", bars.parameters),
        ("gradients", bars.gradients),
        ("optimizer state", bars.optimizer_state),
    )
    for offset, with_plan in ((-0.2, False), (0.2, True)):
        bottom = np.zeros(len(x))
        for label, values in stacks:
            height = np.asarray(values, dtype=float) / unit.size
            ax.bar(x + offset, height, 0.38, bottom=bottom, color=_COLORS[label], label=label)
            bottom += height
        acts = np.asarray(bars.activations_with if with_plan else bars.activations_without, dtype=float) / unit.size
        label = "activations with plan" if with_plan else "activations without plan"
        ax.bar(x + offset, acts, 0.38, bottom=bottom, color="red", alpha=1.0 if with_plan else 0.4, label=label)
    ax.set_xticks(x, names, rotation=35, ha="right", rotation_mode="anchor")
    _style(ax)


_PARTS = ("parameters", "gradients", "optimizer state", "activations without plan", "activations with plan")


def _peak_bars(ax: Any, peaks: tuple[PeakComposition, PeakComposition], plan: Plan, unit: ByteUnit) -> None:
    """The whole model at the step's peak, without and with the plan, parts stacked, against the budget.

    Each bar's x label is its device total: the tensors' peak and the CUDA reserve, the parts it stacks.
    """
    names = []
    for x, peak in enumerate(peaks):
        with_plan = x == 1
        parts: list[tuple[str, int, dict[str, Any]]] = [
            ("parameters", peak.parameters, {}),
            ("gradients", peak.gradients, {}),
            ("optimizer state", peak.optimizer_state, {}),
            (_PARTS[3 + with_plan], peak.activations, {"color": "red", "alpha": 1.0 if with_plan else 0.4}),
            ("CUDA reserve", peak.reserve, {"hatch": "//", "edgecolor": "grey"}),
        ]
        bottom = 0.0
        for label, nbytes, style in parts:
            if nbytes:
                style = {"color": _COLORS.get(label), **style}
                ax.bar(x, nbytes / unit.size, 0.6, bottom=bottom, label=label, **style)
                bottom += nbytes / unit.size
        names.append(f"{'with' if with_plan else 'without'} plan\n{unit(peak.total)}")
    budget = f"budget {unit(plan.budget_bytes)}"
    ax.axhline(plan.budget_bytes / unit.size, color="tab:red", linestyle="--", linewidth=2, label=budget)
    ax.set_xticks(range(len(peaks)), names)
    ax.set_xlim(-0.6, len(peaks) - 0.4)
    _style(ax)


def module_memory_figure(profile: ModelProfile, plan: Plan, n: int = 12) -> Any:
    """Predicted memory per device by category, without and with the plan, in the plan table's unit.

    The whole model on its own axis, as what the device holds at the step's peak (parameters, gradients,
    optimizer state, activations and the CUDA reserve, adding up to the plan's peak, against the budget); the
    ``n`` largest modules on the other, each with the activations its forward leaves alive.
    """
    data = module_memory(profile, plan, n)
    peaks = (data.without, data.with_plan) if data.without and data.with_plan else None
    unit = plan_unit(plan, [p.total for p in peaks or ()])
    n_modules = len(data.modules.fqns)
    # Widths in inches: the whole model's two bars and their labels, then 0.42 inch per module pair; at most 7.2
    # inches, since TensorBoard scales the image to its card and wider means smaller text.
    ratios = [2.4] * bool(peaks) + [0.42 * n_modules + 0.6] * bool(n_modules)
    fig = _figure(min(7.2, max(6.4, sum(ratios) + 0.8)), 6.0)
    axes = list(fig.subplots(1, len(ratios), width_ratios=ratios, squeeze=False)[0])
    if peaks:
        _peak_bars(axes[0], peaks, plan, unit)
        axes[0].set_title("whole model at its peak", fontsize=_LABEL)
    if n_modules:
        _bars(axes[-1], data.modules, [_short(name, 22) for name in data.modules.fqns], unit)
        axes[-1].set_title("per module: activations kept", fontsize=_LABEL)
    axes[0].set_ylabel(f"{unit.name} per device", fontsize=_LABEL)
    fig.suptitle(f"predicted memory, {_per_device(plan)}\nleft bar: without plan, right bar: with", fontsize=_TITLE)
    _legend_below(fig, axes, ncol=2, order=(*_PARTS, "CUDA reserve"))
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
    _style(ax, numeric_x=True)
    _legend_below(fig, [ax], ncol=3)
    return fig
