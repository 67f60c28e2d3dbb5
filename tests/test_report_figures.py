"""The figures' numbers read back (figure data and the matplotlib artists drawn from it), and the scalar series.

The plans are for 4 devices: a figure that drew any curve for one device would give other numbers.
"""

from __future__ import annotations

import pytest
import torch
from conftest import gpt_profile
from matplotlib.backends.backend_agg import FigureCanvasAgg
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_report import peak_points
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile
from torch.utils.tensorboard import SummaryWriter

from lightning_sac import solve_plan
from lightning_sac.dryrun.measured import memory_timeline
from lightning_sac.plan.table import plan_unit
from lightning_sac.report import TAG, log_measured
from lightning_sac.report.figure_data import module_memory, step_memory
from lightning_sac.report.figures import (
    measured_timeline_figure,
    module_memory_figure,
    step_memory_figure,
    tradeoff_figure,
)
from lightning_sac.solver.memory_model import ddp_bucket_bytes, device_bytes
from lightning_sac.solver.tradeoff import module_tradeoff

GIB = 2**30
WORLD = 4


@pytest.fixture(scope="module")
def profile():  # noqa: ANN201
    return gpt_profile()


def plain_peak(profile, world: int, sharding: str) -> int:  # noqa: ANN001
    """The plain step's peak on one device, straight from the profile's timeline."""
    bucket = ddp_bucket_bytes(profile, world)
    return max(device_bytes(e.peak_after or e.at, world, sharding, bucket) for e in profile.timeline)


def plan_for(profile, sharding: str):  # noqa: ANN001, ANN201
    return solve_plan(profile, 0.75 * plain_peak(profile, WORLD, sharding) / GIB, world_size=WORLD, sharding=sharding)


def lines(fig, unit_size: int) -> dict[str, list[int]]:  # noqa: ANN001
    """The figure's curves by the start of their legend label, in bytes (bytes / 2**20 or 2**30 round-trip)."""
    (ax,) = fig.axes
    out = {}
    for line in ax.get_lines():
        label = line.get_label()
        if label.startswith(("without plan", "with plan")):
            out[label.split(":")[0]] = [round(y * unit_size) for y in line.get_ydata()]
    return out


@pytest.mark.parametrize("sharding", ["sharded", "replicated"])
def test_step_memory_curves_are_per_device_with_the_plans_world_size_and_sharding(profile, sharding):
    plan = plan_for(profile, sharding)
    assert plan.world_size == WORLD and plan.sharding == sharding and plan.decisions
    per_device = plain_peak(profile, WORLD, sharding)
    one_device = plain_peak(profile, 1, "replicated")
    # Sharding divides parameters, gradients and optimizer state by 4; replication adds DDP's gradient buckets.
    assert (per_device < one_device) if sharding == "sharded" else (per_device > one_device)
    fig = step_memory_figure(profile, plan)
    unit = plan_unit(plan)  # the plan table's unit: MiB for this model
    assert fig.axes[0].get_ylabel() == f"{unit.name} per device"
    curves = lines(fig, unit.size)
    data = step_memory(profile, plan)
    assert curves == {"without plan": data.without, "with plan": data.with_plan}
    assert (data.world_size, data.sharding) == (WORLD, sharding)
    assert max(curves["without plan"]) == per_device == plan.unconstrained_peak_bytes
    # The legend's peak is the curve's own, and the budget line the plan's.
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert f"without plan: peak {unit(per_device)}" in labels and f"budget {unit(plan.budget_bytes)}" in labels
    # Before any module's forward ends nothing is checkpointed: both curves agree, on the plan's devices.
    bucket = ddp_bucket_bytes(profile, WORLD)
    first = profile.timeline[0]
    expected_first = device_bytes(first.peak_after or first.at, WORLD, sharding, bucket)
    assert curves["with plan"][0] == curves["without plan"][0] == expected_first
    one_device = device_bytes(first.peak_after or first.at, 1, "replicated", ddp_bucket_bytes(profile, 1))
    assert expected_first != one_device
    # A planned step is never above the plain one, and stays within the budget at every boundary.
    assert all(w <= p for w, p in zip(curves["with plan"], curves["without plan"], strict=True))
    assert max(curves["with plan"]) <= plan.budget_bytes < max(curves["without plan"])


def retained(profile, fqn: str) -> int:  # noqa: ANN001
    m = profile.modules[fqn]
    post, pre = m.memory["post_forward"], m.memory["pre_forward"]
    return max(0, post["activation"] - pre["activation"] - m.output_bytes)


def test_root_module_is_shown_apart_with_the_plans_effect(profile):
    plan = plan_for(profile, "sharded")
    freed = {f: d.freed_bytes for f, d in plan.decisions.items()}
    data = module_memory(profile, plan, n=12)
    assert "" not in data.modules.fqns and set(plan.decisions) <= set(data.modules.fqns)
    # Modules inside a checkpointed one are left out: the plan frees their activations as part of the parent's.
    assert not [f for f in data.modules.fqns for d in plan.decisions if f.startswith(d + ".")]
    for i, f in enumerate(data.modules.fqns):
        within = sum(b for d, b in freed.items() if d == f or d.startswith(f + "."))
        assert data.modules.activations_with[i] == retained(profile, f) - within
        assert data.modules.activations_without[i] == retained(profile, f)
    # The figure: the whole model on its own axis, and no root among the per-module bars.
    fig = module_memory_figure(profile, plan)
    whole, per_module = fig.axes
    unit = plan_unit(plan)
    labels = [t.get_text() for t in whole.get_xticklabels()]
    assert labels == [
        f"without plan\n{unit(plan.unconstrained_peak_bytes)}",
        f"with plan\n{unit(plan.predicted_peak_bytes)}",
    ]
    names = [t.get_text() for t in per_module.get_xticklabels()]
    assert names == data.modules.fqns and "" not in names and "<root>" not in names
    # The reason it is apart: the whole model's peak is taller than any module's bar.
    tallest = max(b.get_y() + b.get_height() for c in per_module.containers for b in c)
    assert tallest * unit.size < plan.predicted_peak_bytes


def stacked_tops(ax, unit_size: int) -> list[int]:  # noqa: ANN001
    """The top of each bar of ``ax``'s stacks, in bytes, per x position."""
    tops: dict[float, float] = {}
    for container in ax.containers:
        for bar in container:
            x = round(bar.get_x() + bar.get_width() / 2, 6)
            tops[x] = max(tops.get(x, 0.0), bar.get_y() + bar.get_height())
    return [round(tops[x] * unit_size) for x in sorted(tops)]


@pytest.mark.parametrize(("sharding", "device"), [("sharded", None), ("replicated", "A100-80GB")])
def test_whole_model_bar_is_the_peak_its_parts_add_up_to(profile, sharding, device):
    """The whole model's bars: parameters, gradients, optimizer state, activations and reserve make the peak."""
    plan = plan_for(profile, sharding)
    if device is not None:  # a CUDA plan: the budget keeps a reserve for the context, workspaces, fragmentation
        profile = gpt_profile(device)
        slack = solve_plan(profile, 80.0, world_size=WORLD, sharding=sharding)
        # 85% of the tensors: this GPT's floor on 4 replicated A100 ranks is about 76% of them.
        budget = sum(slack.reserve.values()) + 0.85 * slack.unconstrained_peak_bytes
        plan = solve_plan(profile, budget / GIB, world_size=WORLD, sharding=sharding)
        assert plan.reserve and plan.decisions
    data = module_memory(profile, plan)
    reserve = sum(plan.reserve.values())
    for peak, expected in ((data.without, plan.unconstrained_peak_bytes), (data.with_plan, plan.predicted_peak_bytes)):
        assert peak is not None
        parts = [peak.parameters, peak.gradients, peak.optimizer_state, peak.activations]
        assert all(p >= 0 for p in parts) and sum(parts) == peak.peak_bytes == expected
        assert peak.reserve == reserve and peak.total == expected + reserve
        # Every part is there: the model's state (sharded by 4 or not) and the activations at the peak.
        root = profile.modules[""]
        share = -(-root.parameter_bytes // WORLD) if sharding == "sharded" else root.parameter_bytes
        assert peak.parameters >= share and peak.optimizer_state > 0 and peak.activations > 0
    assert data.with_plan.activations < data.without.activations  # what the plan frees
    assert data.with_plan.parameters == data.without.parameters
    # The figure draws exactly those bytes: each bar's top is its device total, the budget line the plan's.
    fig = module_memory_figure(profile, plan)
    whole = fig.axes[0]
    unit = plan_unit(plan, [data.without.total, data.with_plan.total])
    tops = stacked_tops(whole, unit.size)
    assert tops == [pytest.approx(data.without.total, abs=2), pytest.approx(data.with_plan.total, abs=2)]
    (budget,) = [line for line in whole.get_lines() if line.get_label().startswith("budget")]
    assert round(budget.get_ydata()[0] * unit.size) == plan.budget_bytes
    assert data.with_plan.total <= plan.budget_bytes < data.without.total
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert ("CUDA reserve" in legend) == bool(reserve)


def step_timeline(batch: int):  # noqa: ANN201
    """A real MLP training step's memory, profiled by torch.profiler."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    x = torch.randn(batch, 256)
    options = {"profile_memory": True, "record_shapes": True, "with_stack": True}
    with torch_profile(activities=[ProfilerActivity.CPU], **options) as p:
        model(x).square().mean().backward()
    return memory_timeline(p)


def test_measured_peak_is_logged_as_a_series_of_the_measured_steps(tmp_path, profile):
    plan = plan_for(profile, "sharded")
    small, large = step_timeline(64), step_timeline(512)
    assert small.peak_bytes < large.peak_bytes
    writer = SummaryWriter(tmp_path)
    log_measured(writer, small, step=3, plan=plan, figures=False)
    log_measured(writer, large, step=7, plan=plan, figures=False)
    writer.close()
    points = peak_points(tmp_path)
    # TensorBoard stores float32: the values equal the peaks to float32 precision.
    assert [s for s, _ in points["measured"]] == [3, 7]
    assert [v for _, v in points["measured"]] == pytest.approx(
        [small.peak_bytes / GIB, large.peak_bytes / GIB], rel=1e-7
    )
    # The budget and the prediction at the same steps: lines the measured points are read against.
    for name, value in (("budget", plan.budget_bytes), ("predicted", plan.predicted_peak_bytes)):
        assert [s for s, _ in points[name]] == [3, 7]
        assert [v for _, v in points[name]] == pytest.approx([value / GIB] * 2, rel=1e-7)
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    text = acc.Tensors(f"{TAG}/measured/text_summary")[-1].tensor_proto.string_val[0].decode()
    unit = plan_unit(plan, [large.peak_bytes])
    shown = f"{unit(large.peak_bytes)} of {unit(plan.budget_bytes)} budget"
    assert f"measured peak per device at step 7: **{shown}**" in text


def overlaps(a, b) -> bool:  # noqa: ANN001
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_a_gpu_plan_s_peaks_are_device_totals_with_the_reserve_inside(tmp_path):
    # The budget holds the CUDA reserve: the predicted and measured series add it to the tensors, so that the three
    # lines read against each other as the plan table states them.
    from lightning_sac import Plan

    mib = 2**20
    reserve = {"context_bytes": 709 * mib, "blas_workspace_bytes": 64 * mib}
    plan = Plan(budget_bytes=2 * GIB, device="H100-SXM", predicted_peak_bytes=GIB, reserve=reserve)
    timeline = step_timeline(64)
    writer = SummaryWriter(tmp_path)
    log_measured(writer, timeline, step=1, plan=plan, figures=False)
    writer.close()
    points = peak_points(tmp_path)
    kept = 773 * mib
    assert points["budget"] == [(1, pytest.approx(2.0))]
    assert points["predicted"] == [(1, pytest.approx((GIB + kept) / GIB, rel=1e-7))]
    assert points["measured"] == [(1, pytest.approx((timeline.peak_bytes + kept) / GIB, rel=1e-7))]
    acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    acc.Reload()
    text = acc.Tensors(f"{TAG}/measured/text_summary")[-1].tensor_proto.string_val[0].decode()
    unit = plan_unit(plan, [timeline.peak_bytes])
    assert f"**{unit(timeline.peak_bytes + kept)} of 2.000 GiB budget** ({unit(kept)} CUDA reserve included)" in text


def test_figures_are_legible_at_thumbnail_size_with_legends_off_the_curves(profile):
    plan = plan_for(profile, "sharded")
    fqn = next(iter(plan.decisions))
    stats = profile.modules[fqn].op_stats
    figures = {
        "tradeoff": tradeoff_figure(fqn, module_tradeoff(stats), plan.decisions[fqn].discard_ratio),
        "memory_per_module": module_memory_figure(profile, plan),
        "memory_across_step": step_memory_figure(profile, plan),
        "measured_timeline": measured_timeline_figure(step_timeline(64), plan.budget_bytes),
    }
    for name, fig in figures.items():
        width, height = fig.get_size_inches() * fig.dpi
        # TensorBoard scales an image to its card, about 400-500 px: no wider than 800 px keeps text >= 60%.
        assert width <= 800 and height <= 600, (name, width, height)
        FigureCanvasAgg(fig).draw()
        renderer = fig.canvas.get_renderer()
        assert fig.legends and all(not ax.get_legend() for ax in fig.axes), name
        legend = fig.legends[0].get_window_extent(renderer)
        for ax in fig.axes:
            assert not overlaps(legend, ax.get_window_extent(renderer)), name
        # Every text drawn is at least 11 points; the legend and tick labels are read in the thumbnail.
        sizes = [t.get_fontsize() for t in fig.findobj(lambda o: hasattr(o, "get_fontsize")) if t.get_text()]
        assert min(sizes) >= 11, (name, min(sizes))
        # Nothing drawn leaves the image (the tight box of what is drawn, in inches; 0.01 in of rounding).
        tight = fig.get_tightbbox(renderer)
        w, h = fig.get_size_inches()
        assert tight.x0 >= -0.01 and tight.y0 >= -0.01 and tight.x1 <= w + 0.01 and tight.y1 <= h + 0.01, name
