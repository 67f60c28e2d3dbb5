"""What a fit writes to TensorBoard, read back from its event files: lines of the peaks, wrapped text, tick labels.

The peaks are runs of their own (one tag, one colour each); every series must be a line, two points or more per
fit, of the plan's and the measured step's numbers. The plan's text wraps where a code block would be cut, and
the figures' tick labels read apart however narrow their range.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from tensorboard.plugin_util import markdown_to_safe_html
from tensorboard.plugins.custom_scalar import layout_pb2
from test_callback import module
from test_report import peak_points, read

from lightning_sac import AutoSAC, Plan
from lightning_sac.plan import ModuleDecision
from lightning_sac.plan.table import LEGEND
from lightning_sac.report import PEAKS, TAG, PeakSeries, plan_markdown
from lightning_sac.report.figures import distinct_ticks, tick_decimals

GIB = 2**30
STEPS, EVERY = 5, 2


@pytest.fixture(scope="module")
def fit(tmp_path_factory):  # noqa: ANN201
    """A short fit with AutoSAC and a TensorBoard logger: its callback and log dir."""
    logger = TensorBoardLogger(tmp_path_factory.mktemp("tb"), name="run")
    cb = AutoSAC(budget_gb=1.0, log_figures=False)  # slack: a plan without checkpoints, measured all the same
    pl.Trainer(
        max_steps=STEPS,
        log_every_n_steps=EVERY,
        accelerator="cpu",
        devices=1,
        callbacks=[cb],
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(module())
    return cb, Path(logger.log_dir)


def test_each_peak_is_a_line_of_the_plans_and_the_measured_numbers(fit):
    cb, logdir = fit
    assert cb.plan is not None and cb.measured is not None
    points = peak_points(logdir)
    assert set(points) == {"budget", "predicted", "measured"}  # on the CPU no cuda_max_allocated
    last = STEPS - 1
    # The budget and the prediction: the plan's step, the measured step (1), every 2 steps (1, 3) and the last.
    for name, value in (("budget", cb.plan.budget_bytes), ("predicted", cb.plan.predicted_peak_bytes)):
        assert [s for s, _ in points[name]] == [0, 1, 3, last]
        assert [v for _, v in points[name]] == pytest.approx([value / GIB] * 4, rel=1e-7)  # float32 in TensorBoard
    # The measured peak where it was measured (the second optimizer step), and held to the fit's last step.
    assert points["measured"] == [(s, pytest.approx(cb.measured.peak_bytes / GIB, rel=1e-7)) for s in (1, last)]
    assert all(len(p) >= 2 for p in points.values())
    # The writer's own run holds no peak: the peaks are read in one chart, whose layout names their tag. The
    # lines have a point wherever Lightning logs the loss.
    acc = read(logdir)
    assert not [t for t in acc.Tags()["scalars"] if t.startswith(TAG)]
    assert {e.step for e in acc.Scalars("train_loss")} == {1, 3} <= {s for s, _ in points["budget"]}
    layout = layout_pb2.Layout.FromString(acc.Tensors("custom_scalars__config__")[-1].tensor_proto.string_val[0])
    ((chart,),) = [c.chart for c in layout.category if c.title == TAG]
    assert list(chart.multiline.tag) == [PEAKS]
    text = acc.Tensors(f"{TAG}/measured/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert text.startswith("measured peak per device at step 1:")


class Recorder:
    """A writer that records ``add_scalars`` calls, (step, run, value), and takes the rest without a trace."""

    def __init__(self) -> None:
        self.points: list[tuple[int, str, float]] = []

    def add_scalars(self, tag: str, values: dict[str, float], step: int) -> None:
        assert tag == PEAKS
        self.points += [(step, k, v) for k, v in values.items()]

    def add_text(self, *args: object) -> None:
        pass

    add_custom_scalars = flush = add_text


def test_series_points_without_duplicates_and_cuda_peak_where_measured():
    plan = Plan(budget_bytes=GIB, device="cpu", predicted_peak_bytes=GIB // 2)
    writer, series = Recorder(), PeakSeries()
    series.plan(writer, plan, None, 0, figures=False)
    assert writer.points == [(0, "budget", 1.0), (0, "predicted", 0.5)]
    writer.points.clear()
    for step in range(6):
        series.step_end(writer, plan, step, every_n=3)  # steps 2 and 5
    assert writer.points == [(2, "budget", 1.0), (2, "predicted", 0.5), (5, "budget", 1.0), (5, "predicted", 0.5)]
    writer.points.clear()
    series.fit_end(writer, plan, 5, cuda_max_allocated_bytes=GIB // 4)
    # The lines have their point at 5 already; nothing was measured: the CUDA peak alone, a measurement of its own.
    assert writer.points == [(5, "cuda_max_allocated", 0.25)]
    every_n_zero = PeakSeries()
    every_n_zero.step_end(writer, plan, 0, every_n=0)  # log_every_n_steps=0: Lightning logs nothing, nor do we
    assert writer.points == [(5, "cuda_max_allocated", 0.25)]


def plan_with(fqns: list[str]) -> Plan:
    decisions = {f: ModuleDecision(discard_ratio=0.5, op_policy=[], freed_bytes=2**20, recompute_ms=1.0) for f in fqns}
    return Plan(
        budget_bytes=GIB,
        device="cpu",
        predicted_peak_bytes=GIB // 2,
        unconstrained_peak_bytes=GIB,
        decisions=decisions,
        solver_status="Optimal",
    )


@pytest.mark.parametrize("fqns", [["", "blocks.0.attn_proj"], []])
def test_plan_text_wraps_its_legend_and_summary(fqns):
    plan = plan_with(fqns)
    text = plan_markdown(plan)
    html = markdown_to_safe_html(text)  # as TensorBoard's TEXT tab renders it
    lines = plan.table().splitlines()
    table = lines[: max((i + 1 for i, line in enumerate(lines) if set(line) == {"-"}), default=0)]
    # The table alone is preformatted (columns aligned); every line under it is a paragraph, which wraps.
    assert html.count("<pre>") == (1 if fqns else 0)
    if fqns:
        pre = html[html.index("<pre>") : html.index("</pre>")]
        assert "&lt;root&gt;" in pre and "blocks.0.attn_proj" in pre and LEGEND not in pre
    paragraphs = html[html.rindex("</pre>") if fqns else 0 :].count("<p>")
    assert paragraphs == len(lines) - len(table) >= 3
    # Read as written: no character of the plan's text became markup (underscores, a <root> tag).
    assert "<em>" not in html and "<strong>" not in html
    for line in lines[len(table) :]:
        assert line.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;") in html


@pytest.mark.parametrize(
    ("ticks", "labels"),
    [
        ([0.332, 0.3325, 0.333, 0.3335, 0.334], ["0.3320", "0.3325", "0.3330", "0.3335", "0.3340"]),
        ([0.332, 0.333, 0.334], ["0.332", "0.333", "0.334"]),
        ([0.0, 20.0, 40.0], ["0", "20", "40"]),
        ([59.5, 60.0, 60.5, 61.0], ["59.5", "60.0", "60.5", "61.0"]),
        ([0.1 + 0.2, 0.4], ["0.3", "0.4"]),  # float noise is no digit of a tick
    ],
)
def test_tick_decimals_print_every_tick_apart_and_as_its_value(ticks, labels):
    d = tick_decimals(ticks)
    assert [f"{t:.{d}f}" for t in ticks] == labels


@pytest.mark.parametrize(("lo", "hi"), [(0.332, 0.334), (0.3331, 0.3332), (79.9, 80.1), (0.0, 25.0)])
def test_figure_ticks_are_distinct_on_narrow_ranges(lo, hi):
    fig = Figure()
    ax = fig.add_subplot()
    ax.plot([0, 1], [lo, hi])
    distinct_ticks(ax.yaxis)
    FigureCanvasAgg(fig).draw()
    ticks = [t for t in ax.get_yticks() if lo <= t <= hi]
    shown = [t.get_text() for t in ax.get_yticklabels() if lo <= t.get_position()[1] <= hi]
    assert len(shown) >= 2 and len(set(shown)) == len(shown)
    # Each label is its tick, to a millionth of the spacing.
    spacing = ticks[1] - ticks[0]
    assert all(abs(float(s) - t) < 1e-6 * spacing for s, t in zip(shown, ticks, strict=True))
