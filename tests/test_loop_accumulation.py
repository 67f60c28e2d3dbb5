"""Gradient accumulation: AutoSAC plans the micro-batch that holds the most, and a plan is made for one ``k``.

With ``accumulate_grad_batches = k`` Lightning sets the gradients to ``None`` only in the first micro-batch of a
cycle (after its forward, before its backward); every later micro-batch keeps them through its forward and adds
to them in its backward, and the optimizer steps after the k-th. The dry run profiles that last micro-batch, and
the fit test checks the plan on every micro-batch with the independent harness (``fit_harness.BatchPeaks``): the
plain fit's peak P, then ``AutoSAC(budget_gb=0.8 * P)``: the fit completes with a non-empty plan, its losses are
the plain fit's, and every batch's measured peak is within the budget + 2% (issue "AutoSAC in real training
loops").
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from fit_harness import BatchPeaks
from test_callback import trainer
from test_callback_real_models import Batches, HFModule
from torch.utils.data import DataLoader
from zoo import gpt2

from lightning_sac import AutoSAC
from lightning_sac.devices import get_device_spec
from lightning_sac.dryrun.data import ModelProfile

GIB = 2**30
SLACK = 1.02  # the allowance over the budget for a measured batch peak


class AccumulatingModule(HFModule):
    """The Hugging Face fine-tuning module, with enough batches for several accumulation cycles."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Batches(6), batch_size=None)


class Profiled(pl.Callback):
    """Stops the fit after AutoSAC's dry run: only the profile is wanted."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.should_stop = True


def profile_for(model: torch.nn.Module, k: int, tmp_path: Path) -> ModelProfile:
    """AutoSAC's profile of the step of a fit with ``accumulate_grad_batches=k`` (a budget that needs no plan)."""
    sac = AutoSAC(budget_gb=100, measure=False, log_figures=False)
    pl.seed_everything(0)
    trainer([sac, Profiled()], tmp_path, max_steps=1, accumulate_grad_batches=k).fit(AccumulatingModule(model))
    assert sac.profile is not None
    return sac.profile


def test_accumulating_micro_batch_keeps_every_gradient_through_backward(tmp_path):
    model = gpt2().model
    one, two = profile_for(copy.deepcopy(model), 1, tmp_path), profile_for(copy.deepcopy(model), 2, tmp_path)
    grads = one.modules[""].gradient_bytes  # every parameter's gradient, allocator-rounded
    assert grads == two.modules[""].gradient_bytes > 0
    # The step is the same op for op but for Lightning's `loss / k` (a one-element tensor and its free event):
    # align the timelines by event and compare the live bytes at each.
    events = [[(e.kind, e.name) for e in p.timeline] for p in (one, two)]
    matcher = difflib.SequenceMatcher(a=events[0], b=events[1], autojunk=False)
    inserted = [events[1][j1:j2] for tag, _, _, j1, j2 in matcher.get_opcodes() if tag != "equal"]
    assert inserted == [[("free", "model")]]  # the scaled loss, freed at the end of the root module's backward
    scalar = get_device_spec("cpu").round_bytes(4)
    in_backward = False
    for i, j, size in matcher.get_matching_blocks():
        for a, b in zip(one.timeline[i : i + size], two.timeline[j : j + size], strict=True):
            in_backward = in_backward or (a.kind, a.name) == ("phase", "backward")
            extra = sum(b.at.values()) - sum(a.at.values())
            if not in_backward or a.kind == "phase":
                # Forward: k = 1 keeps the previous step's gradients through it too. At the optimizer step both
                # hold them all.
                assert extra == 0 or (a.kind, a.name) == ("phase", "backward"), (a.kind, a.name)
                continue
            # Backward: k = 1 set the gradients to None before it and holds those produced so far; the
            # accumulating micro-batch holds all of them (and, until the root's backward ends, its scaled loss).
            assert extra - (grads - a.at["gradient"]) in (0, scalar), (a.kind, a.name)
            assert b.at["gradient"] == grads
    # k = 1 peaks at the end of the forward, with the previous gradients alive; the accumulating micro-batch
    # holds up to every gradient more in backward, where activations are already being freed.
    assert one.peak_location == "forward:model"
    assert one.peak_bytes < two.peak_bytes <= one.peak_bytes + grads + scalar
    assert two.peak_location.startswith("backward:")
    assert two.input_signature[-1] == "accumulate_grad_batches=2" and one.input_signature == two.input_signature[:-1]


def fit(model: torch.nn.Module, callbacks: list[Any], tmp_path: Path) -> tuple[HFModule, list[int]]:
    peaks = BatchPeaks()
    module = AccumulatingModule(copy.deepcopy(model))
    pl.seed_everything(0)
    trainer([*callbacks, peaks], tmp_path, max_steps=3, accumulate_grad_batches=2).fit(module)
    return module, peaks.peaks


@pytest.mark.slow
def test_a_plan_holds_for_every_micro_batch_of_an_accumulating_fit(tmp_path):
    model = gpt2().model
    plain, plain_peaks = fit(model, [], tmp_path)
    assert len(plain_peaks) == 6  # three cycles of two micro-batches
    budget = 0.8 * max(plain_peaks)
    sac = AutoSAC(budget_gb=budget / GIB, measure=False, log_figures=False)
    planned, peaks = fit(model, [sac], tmp_path)
    assert sac.plan is not None and sac.plan.decisions and sac.profiled
    assert sac.plan.fingerprint != ""
    assert planned.losses == plain.losses and len(planned.losses) == 6
    for (name, p), q in zip(plain.named_parameters(), planned.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)
    assert len(peaks) == 6
    assert max(peaks) <= budget * SLACK, [round(p / budget, 4) for p in peaks]


def test_a_plan_made_for_one_accumulation_is_not_reused_for_another(tmp_path):
    model = gpt2().model
    path = tmp_path / "plan.json"
    sac = AutoSAC(budget_gb=0.012, plan_path=path, measure=False, log_figures=False)
    pl.seed_everything(0)
    trainer([sac, Profiled()], tmp_path, max_steps=1, accumulate_grad_batches=2).fit(
        AccumulatingModule(copy.deepcopy(model))
    )
    assert sac.profiled and path.exists()
    again = AutoSAC(budget_gb=0.012, plan_path=path, measure=False, log_figures=False)
    pl.seed_everything(0)
    trainer([again, Profiled()], tmp_path, max_steps=1, accumulate_grad_batches=2).fit(
        AccumulatingModule(copy.deepcopy(model))
    )
    assert not again.profiled  # the same loop: reused
    other = AutoSAC(budget_gb=0.012, plan_path=path, measure=False, log_figures=False)
    pl.seed_everything(0)
    with_k4 = trainer([other, Profiled()], tmp_path, max_steps=1, accumulate_grad_batches=4)
    with_k4.fit(AccumulatingModule(copy.deepcopy(model)))
    assert other.profiled  # planned again
    assert other.plan is not None and other.plan.fingerprint != again.plan.fingerprint  # type: ignore[union-attr]
