"""TensorBoard panels, read back with TensorBoard's EventAccumulator: tags, images and scalar values."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from conftest import gpt_profile
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_callback import CONFIG, module, tight_budget_gb  # noqa: F401 - shared test model
from torch.utils.tensorboard import SummaryWriter

from lightning_sac import AutoSAC, solve_plan
from lightning_sac.cli.main import main
from lightning_sac.dryrun.measured import peak_from_events
from lightning_sac.report import PEAKS, TAG, log_plan
from lightning_sac.report.figure_data import top_modules

GIB = 2**30


def read(logdir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(logdir), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def peak_points(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """The peak series by name (``budget``, ``predicted``, ...): each is a run of its own under ``logdir``."""
    prefix = PEAKS.replace("/", "_") + "_"
    runs = sorted(d for d in logdir.iterdir() if d.is_dir() and d.name.startswith(prefix))
    return {d.name.removeprefix(prefix): [(e.step, e.value) for e in read(d).Scalars(PEAKS)] for d in runs}


def scalar(logdir: Path, name: str) -> float:
    """The latest point of the peak series ``name``."""
    return peak_points(logdir)[name][-1][1]


@pytest.fixture(scope="module")
def planned():  # noqa: ANN201
    profile = gpt_profile()
    return profile, solve_plan(profile, profile.peak_bytes * 0.7 / GIB)


def test_plan_panels(tmp_path, planned):
    profile, plan = planned
    writer = SummaryWriter(tmp_path)
    log_plan(writer, plan, profile, top=5)
    writer.close()
    acc = read(tmp_path)
    tops = top_modules(profile, plan, 5)
    expected = {f"{TAG}/tradeoff/{f or '<root>'}" for f in tops} | {
        f"{TAG}/memory_per_module",
        f"{TAG}/memory_across_step",
    }
    assert set(acc.Tags()["images"]) == expected
    assert len(expected) == len(tops) + 2 and set(plan.decisions) <= set(tops)
    # TensorBoard stores scalars as float32: equal to the plan's numbers to float32 precision; one run each.
    assert peak_points(tmp_path) == {
        "budget": [(0, pytest.approx(plan.budget_bytes / GIB, rel=1e-7))],
        "predicted": [(0, pytest.approx(plan.predicted_peak_bytes / GIB, rel=1e-7))],
    }
    # Single values are text, not lone dots: the plan table as the console prints it, summary lines included.
    assert acc.Tags()["scalars"] == []
    text = acc.Tensors(f"{TAG}/plan/text_summary")[0].tensor_proto.string_val[0].decode()
    assert all(fqn in text for fqn in plan.decisions)
    assert "custom_scalars__config__" in acc.Tags()["tensors"]


def test_figures_off_logs_no_images(tmp_path, planned):
    profile, plan = planned
    writer = SummaryWriter(tmp_path)
    log_plan(writer, plan, profile, figures=False)
    writer.close()
    acc = read(tmp_path)
    assert acc.Tags()["images"] == [] and scalar(tmp_path, "predicted") > 0


@pytest.mark.slow  # about 10 s: the matrix tier (tests/test_tensorboard_events.py reads the same tags quickly)
def test_fit_logs_plan_and_measured_step_to_the_trainers_tensorboard(tmp_path):
    cb = AutoSAC(budget_gb=tight_budget_gb())
    logger = TensorBoardLogger(tmp_path, name="run")
    pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        callbacks=[cb],
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(module())
    acc = read(Path(logger.log_dir))
    assert cb.plan is not None and cb.plan.decisions and cb.measured is not None
    measured = cb.measured.peak_bytes  # the second step's window (fit_measure), within the two profiled steps
    assert measured < peak_from_events(cb.measured.events, cb.measured.baseline_bytes).peak_bytes
    # One measured step, the fit's last: one point of the measured series.
    points = peak_points(Path(logger.log_dir))
    (point,) = points["measured"]
    assert point == (1, pytest.approx(measured / GIB, rel=1e-7))  # the second optimizer step, as Lightning logs
    assert points["predicted"][-1] == (1, pytest.approx(cb.plan.predicted_peak_bytes / GIB, rel=1e-7))
    assert f"{TAG}/measured_timeline" in acc.Tags()["images"]
    # The second planned step (AdamW's state exists, as predicted), measured independently, lands near the
    # prediction: within the 10% the profiler is held to.
    assert measured == pytest.approx(cb.plan.predicted_peak_bytes, rel=0.10)


def test_without_a_tensorboard_logger_writes_its_own(tmp_path):
    pl.Trainer(
        max_steps=1,
        accelerator="cpu",
        devices=1,
        callbacks=[AutoSAC(budget_gb=1.0, log_figures=False)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    ).fit(module())
    acc = read(tmp_path / "lightning_sac_logs")
    assert scalar(tmp_path / "lightning_sac_logs", "budget") == pytest.approx(1.0) and acc.Tags()["images"] == []


def test_the_measured_step_gets_one_verdict_line_over_budget_a_warning(caplog):
    cb = AutoSAC(budget_gb=1.0)
    from lightning_sac import Plan

    cb.plan = Plan(budget_bytes=GIB, device="cpu", predicted_peak_bytes=GIB // 2)
    over = r"peak 1\.500 GiB of 1\.000 GiB budget, predicted 0\.500 GiB: OVER BUDGET by 0\.500 GiB"
    with pytest.warns(UserWarning, match=over):
        cb.compare_measured(3 * GIB // 2, "cpu", target_is_cuda=False)
    with caplog.at_level(logging.INFO), warnings.catch_warnings():
        warnings.simplefilter("error")  # within budget: information, no warning
        cb.compare_measured(GIB * 3 // 4, "cpu", target_is_cuda=False)
    verdicts = [r.getMessage() for r in caplog.records if "AutoSAC measured" in r.getMessage()]
    assert verdicts == [
        "AutoSAC measured the first planned step: peak 0.750 GiB of 1.000 GiB budget, predicted 0.500 GiB: within "
        "budget, 0.250 GiB to spare."
    ]


def test_the_verdict_states_the_device_total_with_the_reserve_named_inside(caplog):
    from lightning_sac import Plan

    cb = AutoSAC(budget_gb=1.0)
    reserve = {"context_bytes": GIB // 8, "blas_workspace_bytes": GIB // 8}  # a quarter of the budget kept
    cb.plan = Plan(budget_bytes=GIB, device="H100-SXM", predicted_peak_bytes=GIB // 2, reserve=reserve)
    with caplog.at_level(logging.INFO), warnings.catch_warnings():
        warnings.simplefilter("error")
        cb.compare_measured(GIB * 5 // 8, "cuda", target_is_cuda=True)  # 0.625 + 0.25 = 0.875 of 1
    verdicts = [r.getMessage() for r in caplog.records if "AutoSAC measured" in r.getMessage()]
    assert verdicts == [
        "AutoSAC measured the first planned step: peak 0.875 GiB of 1.000 GiB budget (0.250 GiB CUDA reserve "
        "included), predicted 0.750 GiB: within budget, 0.125 GiB to spare."
    ]
    # The tensors alone would fit (0.875 GiB); with the reserve they do not.
    with pytest.warns(UserWarning, match=r"peak 1\.125 GiB of 1\.000 GiB budget .*OVER BUDGET by 0\.125 GiB"):
        cb.compare_measured(GIB * 7 // 8, "cuda", target_is_cuda=True)


def test_report_command_writes_panels_without_training(tmp_path: Any, capsys):
    plan_json, profile_json, out = tmp_path / "plan.json", tmp_path / "profile.json", tmp_path / "tb"
    argv = ["plan", "lightning_sac.demos:gpt_example", "--budget-gb", "20", "--device", "A100-80GB"]
    assert main([*argv, "--json", str(plan_json), "--profile-json", str(profile_json)]) == 0
    assert main(["report", str(plan_json), "--profile", str(profile_json), "--out", str(out)]) == 0
    assert "tensorboard --logdir" in capsys.readouterr().out
    acc = read(out)
    assert f"{TAG}/memory_across_step" in acc.Tags()["images"]
    assert scalar(out, "budget") == pytest.approx(20.0)
