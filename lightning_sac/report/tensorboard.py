"""TensorBoard panels of a plan: figures, the plan and its single values as text, and the peaks as series.

The peaks are one chart: TensorBoard colours lines by run, not by tag, so the budget, the predicted and the
measured peak are each a run of their own (``add_scalars``: the runs ``lightning_sac_peak_gib_budget``,
``..._predicted``, ``..._measured`` beside the writer's, with one tag, ``lightning_sac/peak_gib``). The Time
Series dashboard then draws them in one card in three colours, and the ``lightning_sac`` chart of the Custom
Scalars dashboard shows the same. During a fit (:class:`PeakSeries`) the budget and the prediction are lines: a
point at each plan's step, at the measured step, every ``log_every_n_steps`` optimizer steps and at the fit's
last step. The measured peak has a point at the step measured and, so that it reads as a line beside them, its
value again at the fit's last step: the latest measurement, not a new one (the ``measured`` text names the step).

Values that do not change over a fit (the peak without the plan, the recompute time, the solver's status) are
in the ``plan`` text panel: the plan table as the console prints it, its legend and summary as wrapped
paragraphs; every number is per device.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

from lightning_sac.dryrun import MemoryTimeline, ModelProfile
from lightning_sac.plan import Plan, device_peak, plan_unit, reserve_bytes, reserve_note
from lightning_sac.report.figure_data import measured_unit, top_modules
from lightning_sac.solver import module_tradeoff

__all__ = ["PEAKS", "TAG", "PeakSeries", "log_measured", "log_peaks", "log_plan", "measured_markdown", "plan_markdown"]

#: Prefix of every tag lightning-sac writes.
TAG = "lightning_sac"
#: The tag of the peak series, each written to its own run (see the module docstring).
PEAKS = f"{TAG}/peak_gib"
_GIB = 2**30
_CHART = "peak memory per device (GiB): budget, predicted, measured"
_RULE = re.compile(r"^-+$")
_MARKDOWN = re.compile(r"([\\`*_{}\[\]#+!|])")


def _paragraph(line: str) -> str:
    """``line`` as markdown text that reads as written: markdown's characters escaped, ``<`` kept as text."""
    return _MARKDOWN.sub(r"\\\1", line).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def plan_markdown(plan: Plan) -> str:
    """The plan table as the console prints it (:meth:`Plan.table`), as markdown that wraps in the TEXT tab.

    The per-module table stays a code block (columns aligned, as narrow as its module names); the lines under it
    (the legend and the plan's single values: budget, peaks with and without the plan, recompute, step time,
    world size and sharding, solver) are wrapped paragraphs, which a code block would cut at the card's edge.
    """
    lines = plan.table().splitlines()
    # The table ends at its last rule; a plan without decisions has none and is all summary.
    end = max((i + 1 for i, line in enumerate(lines) if _RULE.match(line)), default=0)
    blocks = [f"```\n{chr(10).join(lines[:end])}\n```"] if end else []
    return "\n\n".join(blocks + [_paragraph(line) for line in lines[end:]])


def measured_markdown(peak_bytes: int, step: int, plan: Plan | None = None, budget_bytes: int | None = None) -> str:
    """One line: the measured peak at ``step`` beside the budget and the prediction it is read against.

    With a plan, every figure is the device total the budget bounds, the plan's reserve named inside it, as the
    plan table and the console's verdict state a peak.
    """
    if plan is None:
        unit = measured_unit(peak_bytes, budget_bytes)
        text = f"measured peak per device at step {step}: **{unit(peak_bytes)}**"
        return text + (f", budget {unit(budget_bytes)}." if budget_bytes is not None else ".")
    unit, reserve = plan_unit(plan, [peak_bytes]), reserve_bytes(plan)
    note = reserve_note(plan, unit)
    text = f"measured peak per device at step {step}: **{device_peak(plan, peak_bytes, unit)}**"
    text += f" ({note})" if note else ""
    predicted = plan.predicted_peak_bytes + reserve
    error = (peak_bytes + reserve - predicted) / predicted if predicted else 0.0
    return text + f", predicted {unit(predicted)} for {plan.device} ({error:+.1%})."


def _layout(writer: Any) -> None:
    # The peaks in one chart of the Custom Scalars dashboard: one tag, one run (and colour) per series.
    writer.add_custom_scalars({TAG: {_CHART: ["Multiline", [PEAKS]]}})


def log_plan(
    writer: Any, plan: Plan, profile: ModelProfile | None = None, *, step: int = 0, figures: bool = True, top: int = 8
) -> None:
    """Write the plan's panels to a ``SummaryWriter``.

    The budget and the predicted peak at ``step`` (:func:`log_peaks`); text ``plan`` with the plan table and
    its single values (:func:`plan_markdown`); with a profile and
    ``figures``, the trade-off figure of each checkpointed module and of the top remaining candidates (``top``
    in all), memory per module, and memory across the step against the budget.
    """
    _layout(writer)
    reserve = reserve_bytes(plan)
    log_peaks(writer, step, budget_bytes=plan.budget_bytes, predicted_bytes=plan.predicted_peak_bytes, reserve=reserve)
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
    """Write a measured step at ``step``: a point of the measured peak's series (:func:`log_peaks`).

    Beside it, at the same step, the budget (from ``plan`` or ``budget_bytes``) and, with ``plan``, the
    predicted peak; the text ``measured`` with the three numbers; with ``figures``, the stacked memory timeline.
    """
    budget = plan.budget_bytes if plan is not None else budget_bytes
    predicted = plan.predicted_peak_bytes if plan is not None else None
    _layout(writer)
    reserve = reserve_bytes(plan) if plan is not None else 0
    measured = timeline.peak_bytes
    log_peaks(writer, step, budget_bytes=budget, predicted_bytes=predicted, measured_bytes=measured, reserve=reserve)
    writer.add_text(f"{TAG}/measured", measured_markdown(timeline.peak_bytes, step, plan, budget), step)
    if figures and _have_matplotlib():
        from lightning_sac.report.figures import measured_timeline_figure

        writer.add_figure(f"{TAG}/measured_timeline", measured_timeline_figure(timeline, budget), step)
    writer.flush()


def log_peaks(
    writer: Any,
    step: int,
    *,
    budget_bytes: int | None = None,
    predicted_bytes: int | None = None,
    measured_bytes: int | None = None,
    cuda_max_allocated_bytes: int | None = None,
    reserve: int = 0,
) -> None:
    """One point at ``step`` of each peak given, in GiB (float32 in TensorBoard), each in its own run.

    ``reserve`` (a plan's :func:`~lightning_sac.plan.reserve_bytes`) is added to the predicted and the measured
    tensors, so that they are the device totals the budget bounds; ``cuda_max_allocated`` is the allocator's own.

    The runs are ``budget``, ``predicted``, ``measured`` and ``cuda_max_allocated`` under the tag
    :data:`PEAKS`, so that TensorBoard draws them in one chart, one colour each (:func:`log_plan` and
    :func:`log_measured` write the layout of the Custom Scalars chart that shows them).
    """
    peaks = {
        "budget": budget_bytes,
        "predicted": None if predicted_bytes is None else predicted_bytes + reserve,
        "measured": None if measured_bytes is None else measured_bytes + reserve,
        "cuda_max_allocated": cuda_max_allocated_bytes,
    }
    writer.add_scalars(PEAKS, {k: v / _GIB for k, v in peaks.items() if v is not None}, step)


class PeakSeries:
    """The points of a fit's peak series, so that each is a line in TensorBoard (see the module docstring).

    A fit calls :meth:`plan` for each plan it applies, :meth:`step_end` after each optimizer step,
    :meth:`measured` for the measured step and :meth:`fit_end` once; steps are optimizer steps counted from 0,
    the index Lightning logs ``train_loss`` under. Writing four scalars every ``log_every_n_steps`` steps costs
    microseconds.

    Attributes:
        measured_bytes: The latest measured peak, ``None`` before one.
    """

    def __init__(self) -> None:
        self.measured_bytes: int | None = None
        self._measured_step = -1
        self._lines_step = -1  # the latest step the budget and the prediction have a point at

    def plan(self, writer: Any, plan: Plan, profile: ModelProfile | None, step: int, *, figures: bool) -> None:
        """The plan's panels at ``step`` (:func:`log_plan`), the points of its budget and prediction included."""
        log_plan(writer, plan, profile, step=step, figures=figures)
        self._lines_step = step

    def step_end(self, writer: Any, plan: Plan, step: int, every_n: int) -> None:
        """After optimizer step ``step``: the budget and the prediction, every ``every_n`` steps (0: never)."""
        if every_n > 0 and (step + 1) % every_n == 0 and step > self._lines_step:
            predicted, reserve = plan.predicted_peak_bytes, reserve_bytes(plan)
            log_peaks(writer, step, budget_bytes=plan.budget_bytes, predicted_bytes=predicted, reserve=reserve)
            self._lines_step = step

    def measured(
        self,
        writer: Any,
        plan: Plan,
        step: int,
        timeline: MemoryTimeline,
        *,
        figures: bool,
        cuda_max_allocated_bytes: int | None = None,
    ) -> None:
        """The measured step ``step`` (:func:`log_measured`), with ``torch.cuda.max_memory_allocated`` on CUDA."""
        log_measured(writer, timeline, step=step, plan=plan, figures=figures)
        if cuda_max_allocated_bytes is not None:
            log_peaks(writer, step, cuda_max_allocated_bytes=cuda_max_allocated_bytes)
        self.measured_bytes, self._measured_step = timeline.peak_bytes, step
        self._lines_step = max(self._lines_step, step)

    def fit_end(self, writer: Any, plan: Plan, step: int, *, cuda_max_allocated_bytes: int | None = None) -> None:
        """The fit's last step ``step``: each series' last point, where it has none yet (see the module docstring)."""
        lines = step > self._lines_step
        later = step > self._measured_step
        log_peaks(
            writer,
            step,
            budget_bytes=plan.budget_bytes if lines else None,
            predicted_bytes=plan.predicted_peak_bytes if lines else None,
            measured_bytes=self.measured_bytes if later else None,
            cuda_max_allocated_bytes=cuda_max_allocated_bytes if later else None,
            reserve=reserve_bytes(plan),
        )
        self._lines_step = max(self._lines_step, step)
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
