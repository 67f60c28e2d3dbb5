"""TensorBoard panels of a plan: figures, scalars (GiB), the plan table as text, and one chart of the peaks."""

from __future__ import annotations

import warnings
from typing import Any

from lightning_sac.measure import MemoryTimeline
from lightning_sac.plan import Plan
from lightning_sac.profiling.data import ModelProfile
from lightning_sac.tradeoff import module_tradeoff

__all__ = ["TAG", "log_measured", "log_plan", "plan_markdown"]

#: Prefix of every tag lightning-sac writes.
TAG = "lightning_sac"
_GIB = 2**30


def plan_markdown(plan: Plan) -> str:
    """The plan table as markdown, with the predicted peak, recompute and solve time."""
    rows = ["| module | discard % | freed MiB | recompute ms |", "|---|---|---|---|"]
    rows += [
        f"| {fqn} | {100 * d.discard_ratio:.1f} | {d.freed_bytes / 2**20:.2f} | {d.recompute_ms:.3f} |"
        for fqn, d in plan.decisions.items()
    ] or ["| (no module needs checkpointing) | | | |"]
    rows.append("")
    rows.append(
        f"**{plan.device}**, budget {plan.budget_gb:.3f} GiB, world size {plan.world_size} ({plan.sharding}): "
        f"predicted peak {plan.predicted_peak_bytes / _GIB:.3f} GiB (without plan "
        f"{plan.unconstrained_peak_bytes / _GIB:.3f}), recompute {plan.predicted_recompute_ms:.3f} ms of a "
        f"{plan.predicted_step_ms:.3f} ms step, solved in {plan.solver_seconds:.2f} s ({plan.solver_status})."
    )
    return "\n".join(rows)


def _layout(writer: Any) -> None:
    # One chart with the budget, the predicted and the measured peak, so a glance tells whether the plan held.
    writer.add_custom_scalars(
        {
            TAG: {
                "peak memory (GiB)": [
                    "Multiline",
                    [f"{TAG}/budget_gib", f"{TAG}/predicted_peak_gib", f"{TAG}/measured_peak_gib"],
                ]
            }
        }
    )


def log_plan(
    writer: Any, plan: Plan, profile: ModelProfile | None = None, *, step: int = 0, figures: bool = True, top: int = 8
) -> None:
    """Write the plan's panels to a ``SummaryWriter``.

    Scalars (GiB, stored as float32 by TensorBoard): ``budget_gib``, ``predicted_peak_gib``,
    ``unconstrained_peak_gib``, ``predicted_recompute_ms``; text ``plan``; with a profile and ``figures``, the
    trade-off figure of each checkpointed module and of the top remaining candidates (``top`` in all), memory
    per module, and memory across the step against the budget.
    """
    _layout(writer)
    writer.add_scalar(f"{TAG}/budget_gib", plan.budget_bytes / _GIB, step)
    writer.add_scalar(f"{TAG}/predicted_peak_gib", plan.predicted_peak_bytes / _GIB, step)
    writer.add_scalar(f"{TAG}/unconstrained_peak_gib", plan.unconstrained_peak_bytes / _GIB, step)
    writer.add_scalar(f"{TAG}/predicted_recompute_ms", plan.predicted_recompute_ms, step)
    writer.add_text(f"{TAG}/plan", plan_markdown(plan), step)
    if figures and profile is not None and _have_matplotlib():
        from lightning_sac.report import figures as f

        for fqn in f.top_modules(profile, plan, top):
            stats = profile.modules[fqn].op_stats
            if stats is None:
                continue
            decision = plan.decisions.get(fqn)
            fig = f.tradeoff_figure(fqn, module_tradeoff(stats), decision.discard_ratio if decision else None)
            writer.add_figure(f"{TAG}/tradeoff/{fqn or '<root>'}", fig, step)
        writer.add_figure(f"{TAG}/memory_per_module", f.module_memory_figure(profile, plan, top), step)
        writer.add_figure(f"{TAG}/memory_across_step", f.step_memory_figure(profile, plan), step)
    writer.flush()


def log_measured(
    writer: Any, timeline: MemoryTimeline, *, step: int = 0, budget_bytes: int | None = None, figures: bool = True
) -> None:
    """Write a measured step: ``measured_peak_gib`` and, with ``figures``, its stacked memory timeline."""
    _layout(writer)
    writer.add_scalar(f"{TAG}/measured_peak_gib", timeline.peak_bytes / _GIB, step)
    if figures and _have_matplotlib():
        from lightning_sac.report.figures import measured_timeline_figure

        writer.add_figure(f"{TAG}/measured_timeline", measured_timeline_figure(timeline, budget_bytes), step)
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
