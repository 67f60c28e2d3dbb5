"""TensorBoard panels of a plan: figures, the plan and its single values as text, and the peaks as series.

Scalars are kept to what reads as a series: ``measured_peak_gib`` at each step AutoSAC measures, and beside it
``budget_gib`` and ``predicted_peak_gib`` at each step a plan is made or measured, so that one custom chart
(``lightning_sac`` in the Custom Scalars dashboard) shows the measured peak against the lines of the budget and
the prediction. Values that do not change over a fit (the peak without the plan, the recompute time, the
solver's status) are in the ``plan`` text panel, the plan table as the console prints it; every number is per
device.
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning_sac.dryrun import MemoryTimeline, ModelProfile
from lightning_sac.plan import Plan, plan_unit
from lightning_sac.report.figure_data import measured_unit, top_modules
from lightning_sac.solver import module_tradeoff

__all__ = ["TAG", "log_measured", "log_plan", "measured_markdown", "plan_markdown"]

#: Prefix of every tag lightning-sac writes.
TAG = "lightning_sac"
_GIB = 2**30


def plan_markdown(plan: Plan) -> str:
    """The plan table as the console prints it (:meth:`Plan.table`), as a markdown code block.

    One rendering: the per-module table, its legend and the plan's single values (budget, peaks with and
    without the plan, recompute, step time, world size and sharding, solver) read the same in both places.
    """
    return f"```\n{plan.table()}\n```"


def measured_markdown(peak_bytes: int, step: int, plan: Plan | None = None, budget_bytes: int | None = None) -> str:
    """One line: the measured peak at ``step`` beside the budget and the prediction it is read against."""
    budget = plan.budget_bytes if plan is not None else budget_bytes
    unit = plan_unit(plan, [peak_bytes]) if plan is not None else measured_unit(peak_bytes, budget)
    text = f"measured peak per device at step {step}: **{unit(peak_bytes)}**"
    if budget is not None:
        text += f", budget {unit(budget)}"
    if plan is not None:
        predicted = plan.predicted_peak_bytes
        error = (peak_bytes - predicted) / predicted if predicted else 0.0
        text += f", predicted {unit(predicted)} for {plan.device} ({error:+.1%})"
    return text + "."


def _layout(writer: Any) -> None:
    # One chart with the budget, the predicted and the measured peak, so a glance tells whether the plan held.
    peaks = ["budget_gib", "predicted_peak_gib", "measured_peak_gib", "cuda_max_allocated_gib"]
    writer.add_custom_scalars({TAG: {"peak memory per device (GiB)": ["Multiline", [f"{TAG}/{t}" for t in peaks]]}})


def _log_lines(writer: Any, step: int, budget_bytes: int | None, predicted_bytes: int | None) -> None:
    """The budget and the prediction at ``step``: points of the lines the measured peak is read against."""
    if budget_bytes is not None:
        writer.add_scalar(f"{TAG}/budget_gib", budget_bytes / _GIB, step)
    if predicted_bytes is not None:
        writer.add_scalar(f"{TAG}/predicted_peak_gib", predicted_bytes / _GIB, step)


def log_plan(
    writer: Any, plan: Plan, profile: ModelProfile | None = None, *, step: int = 0, figures: bool = True, top: int = 8
) -> None:
    """Write the plan's panels to a ``SummaryWriter``.

    Scalars (GiB, stored as float32 by TensorBoard) ``budget_gib`` and ``predicted_peak_gib`` at ``step``;
    text ``plan`` with the plan table and its single values (:func:`plan_markdown`); with a profile and
    ``figures``, the trade-off figure of each checkpointed module and of the top remaining candidates (``top``
    in all), memory per module, and memory across the step against the budget.
    """
    _layout(writer)
    _log_lines(writer, step, plan.budget_bytes, plan.predicted_peak_bytes)
    writer.add_text(f"{TAG}/plan", plan_markdown(plan), step)
    if figures and profile is not None and _have_matplotlib():
        from lightning_sac.report import figures as f

        for fqn in top_modules(profile, plan, top):
            stats = profile.modules[fqn].op_stats
            if stats is None:
                continue
            decision = plan.decisions.get(fqn)
            tradeoff = module_tradeoff(stats, backend=plan.backend)
            fig = f.tradeoff_figure(fqn, tradeoff, decision.discard_ratio if decision else None)
            writer.add_figure(f"{TAG}/tradeoff/{fqn or '<root>'}", fig, step)
        writer.add_figure(f"{TAG}/memory_per_module", f.module_memory_figure(profile, plan, top), step)
        writer.add_figure(f"{TAG}/memory_across_step", f.step_memory_figure(profile, plan), step)
    writer.flush()


def log_measured(
    writer: Any,
    timeline: MemoryTimeline,
    *,
    step: int = 0,
    budget_bytes: int | None = None,
    figures: bool = True,
    plan: Plan | None = None,
) -> None:
    """Write a measured step at ``step``, one point of the ``measured_peak_gib`` series per measured step.

    Beside it, at the same step, ``budget_gib`` (from ``plan`` or ``budget_bytes``) and, with ``plan``,
    ``predicted_peak_gib``; the text ``measured`` with the three numbers; with ``figures``, the stacked memory
    timeline.
    """
    _layout(writer)
    writer.add_scalar(f"{TAG}/measured_peak_gib", timeline.peak_bytes / _GIB, step)
    budget = plan.budget_bytes if plan is not None else budget_bytes
    _log_lines(writer, step, budget, plan.predicted_peak_bytes if plan is not None else None)
    writer.add_text(f"{TAG}/measured", measured_markdown(timeline.peak_bytes, step, plan, budget), step)
    if figures and _have_matplotlib():
        from lightning_sac.report.figures import measured_timeline_figure

        writer.add_figure(f"{TAG}/measured_timeline", measured_timeline_figure(timeline, budget), step)
    writer.flush()


_WARNED: list[bool] = []


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        if not _WARNED:
            _WARNED.append(True)
            warnings.warn("lightning-sac: matplotlib is not installed, so no figures are logged.", stacklevel=3)
        return False
    return True
