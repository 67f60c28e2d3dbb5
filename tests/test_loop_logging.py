"""Logging in the training step: ``.item()`` reads and torchmetrics metrics do not stop AutoSAC's dry run.

A scalar read of a value derived from the weights gets a stand-in in the dry run and is listed in the profile
(op, module, source line); a torchmetrics metric of the module is not run in the dry run, and the user's metric
states are exactly as they were. The fit test measures the plain fit's peak P with the independent harness
(``fit_harness.BatchPeaks``), then fits with ``AutoSAC(budget_gb=0.8 * P)``: the fit completes with a non-empty
plan, its losses and metric values are the plain fit's, and every batch's measured peak is within the budget + 2%
(issue "AutoSAC in real training loops").
"""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fit_harness import BatchPeaks
from test_callback import trainer
from torch import nn
from torch.utils.data import DataLoader
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score, MulticlassPrecision
from zoo import bert, lm_batch

import lightning_sac.lightning.callback as callback_module
import lightning_sac.lightning.planning as planning_module
from lightning_sac import AutoSAC, ProfilingError, profile_model
from lightning_sac.devices import get_device_spec
from lightning_sac.dryrun.data import ModelProfile
from lightning_sac.lightning.fit_step import FitStepSettings, profile_lightning_step

GIB = 2**30
SLACK = 1.02  # the allowance over the budget for a measured batch peak
SCALAR_READ = "aten._local_scalar_dense.default"


def batches(n: int = 4) -> list[dict[str, torch.Tensor]]:
    """Keyword batches for a 3-class sequence classifier; the labels differ from batch to batch."""
    out = []
    for i in range(n):
        batch = lm_batch(128)
        batch["labels"] = (torch.arange(4) + i) % 3
        out.append(batch)
    return out


class LoggingClassifier(pl.LightningModule):
    """A fine-tuning module that logs as users do: ``loss.item()``, a metric called, a metric updated."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.acc = MulticlassAccuracy(num_classes=3)
        self.f1 = MulticlassF1Score(num_classes=3)
        self.losses: list[float] = []
        self.metric_values: list[tuple[float, float]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.model(**batch)
        self.log("loss", out.loss.item())
        preds = out.logits.argmax(-1)
        self.log("batch_acc", self.acc(preds, batch["labels"]))
        self.f1.update(preds, batch["labels"])
        self.log("f1", self.f1)
        return out.loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))
        self.metric_values.append((float(self.acc.compute()), float(self.f1.compute())))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(batches(), batch_size=None)


def fit(model: nn.Module, callbacks: list[Any], tmp_path: Any) -> tuple[LoggingClassifier, list[int]]:
    peaks = BatchPeaks()
    pl.seed_everything(0)
    module = LoggingClassifier(copy.deepcopy(model))
    trainer([*callbacks, peaks], tmp_path, max_steps=4).fit(module)
    return module, peaks.peaks


def test_item_logging_and_metrics_fit_the_budget_as_the_plain_fit_does(tmp_path, monkeypatch):
    model = bert().model
    plain, plain_peaks = fit(model, [], tmp_path)
    budget_gb = 0.8 * max(plain_peaks) / GIB
    sac = AutoSAC(budget_gb=budget_gb, measure=False, log_figures=False)
    told: list[str] = []
    for module in (callback_module, planning_module):  # AutoSAC's hooks, and its planning
        monkeypatch.setattr(module, "rank_zero_info", lambda message: told.append(message))
    planned, peaks = fit(model, [sac], tmp_path)

    assert sac.plan is not None and sac.plan.decisions and sac.profiled
    assert planned.losses == plain.losses and len(plain.losses) == 4
    # The metrics were fed exactly what the plain fit fed them: planning left their states alone.
    assert planned.metric_values == plain.metric_values
    assert len(set(plain.metric_values)) > 1  # the values move from batch to batch, so a corrupt state would show
    over = [(i, n / sac.plan.budget_bytes) for i, n in enumerate(peaks) if n > sac.plan.budget_bytes * SLACK]
    assert not over, f"batches above the budget + 2% (batch, peak / budget): {over}"

    # The profile lists each place a stand-in was used, pointing at this file's training_step.
    assert sac.profile is not None
    sites = {(s["kind"], s["op"], s["module"]): s for s in sac.profile.placeholders}
    assert set(sites) == {
        ("scalar", SCALAR_READ, ""),
        ("metric", "MulticlassAccuracy.forward", "acc"),
        ("metric", "MulticlassF1Score.update", "f1"),
    }
    for site in sites.values():
        assert site["source"].startswith(f"{__file__}:"), site
    assert sites[("scalar", SCALAR_READ, "")]["source"].endswith('self.log("loss", out.loss.item())')
    assert sites[("scalar", SCALAR_READ, "")]["value"] == "1.0"
    assert "self.acc(preds" in sites[("metric", "MulticlassAccuracy.forward", "acc")]["source"]
    # The user is told once, with the places.
    stand_ins = [m for m in told if "used stand-ins" in m]
    assert len(stand_ins) == 1 and "at 3 place(s)" in stand_ins[0]
    assert all(s["source"] in stand_ins[0] for s in sac.profile.placeholders)


class ItemLoggingNet(nn.Module):
    """A plain model whose block reads scalars of its activations, as logging and sanity checks do."""

    def __init__(self, log_norms: bool) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
        self.head = nn.Linear(64, 8)
        self.log_norms = log_norms
        self.norms: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(self.block(x))
        if self.log_norms:
            with torch.no_grad():
                self.norms.append(out.norm().item())  # logging only
                if torch.isnan(out).any():  # a check for trouble: the healthy answer is no
                    raise FloatingPointError("NaN outputs")
                self.norms.append(int((out > 0).sum()))
        return out


def test_profile_model_records_scalar_reads_of_weight_derived_values():
    x = torch.randn(32, 64)
    user = ItemLoggingNet(log_norms=True)
    profile = profile_model(user, (x,), optimizer_factory=torch.optim.Adam, device="cpu")
    silent = profile_model(ItemLoggingNet(log_norms=False), (x,), optimizer_factory=torch.optim.Adam, device="cpu")

    here = f"{__file__}:"
    assert [(s["kind"], s["op"], s["module"], s["value"]) for s in profile.placeholders] == [
        ("scalar", SCALAR_READ, "", "1.0"),
        ("scalar", SCALAR_READ, "", "False"),
        ("scalar", SCALAR_READ, "", "1"),
    ]
    sources = [s["source"] for s in profile.placeholders]
    assert all(s.startswith(here) for s in sources), sources
    assert sources[0].endswith("self.norms.append(out.norm().item())  # logging only")
    assert sources[1].endswith("if torch.isnan(out).any():  # a check for trouble: the healthy answer is no")
    # Logging-only reads change nothing the plan is made from; the model and its list are the user's own.
    assert profile.peak_bytes == silent.peak_bytes and profile.peak_breakdown == silent.peak_breakdown
    assert profile.modules["block"].op_stats == silent.modules["block"].op_stats
    assert user.norms == []
    assert ModelProfile.from_json(profile.to_json()).placeholders == profile.placeholders


class ReadsInBlock(nn.Module):
    """The read happens inside a submodule's forward: the site names that submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x)
        self.last = float(h.detach().mean())
        return h


def test_a_read_inside_a_submodule_names_it():
    model = nn.Sequential(nn.Linear(16, 16), ReadsInBlock())
    profile = profile_model(model, (torch.randn(4, 16),), device="cpu")
    assert [(s["op"], s["module"]) for s in profile.placeholders] == [(SCALAR_READ, "1")]
    assert profile.placeholders[0]["source"].endswith("self.last = float(h.detach().mean())")


def test_a_read_of_batch_values_is_exact_and_not_a_placeholder():
    class CountsLabels(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            n = int((y >= 0).sum())  # real: from the batch only
            return F.cross_entropy(self.fc(x)[:n], y[:n])

    profile = profile_model(CountsLabels(), (torch.randn(6, 8), torch.tensor([0, 1, 2, 0, -1, -1])), device="cpu")
    assert profile.placeholders == []


def test_dynamic_shape_ops_on_weight_derived_values_outside_metrics_still_stop_the_dry_run():
    # A made-up size for nonzero would profile another step (a router's selected rows): it is not guessed.
    class Router(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(8, 1)
            self.expert = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.expert(x[self.gate(x).squeeze(-1) > 0])

    with pytest.raises(ProfilingError, match="depends on the values") as info:
        profile_model(Router(), (torch.randn(6, 8),), device="cpu")
    assert info.value.op == "aten.index.Tensor" and info.value.module == ""


class MetricsEverywhere(LoggingClassifier):
    """Every way a metric is used in a step: called, updated, computed, in a collection, logged as an object."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.collection = MetricCollection({"precision": MulticlassPrecision(num_classes=3)}, prefix="train_")

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.model(**batch)
        preds, labels = out.logits.argmax(-1), batch["labels"]
        self.log("batch_acc", self.acc(preds, labels))
        self.f1.update(preds, labels)
        self.log("f1", self.f1.compute().item())
        self.log_dict(self.collection(preds, labels))
        return out.loss


def metric_state(module: pl.LightningModule) -> dict[str, Any]:
    """Every state of every metric of ``module``, and the counters torchmetrics keeps beside them."""
    from torchmetrics import Metric

    out: dict[str, Any] = {}
    for name, m in module.named_modules():
        if isinstance(m, Metric):
            for key in [*m._defaults, "_update_count", "_computed", "_forward_cache", "_is_synced"]:
                value = getattr(m, key)
                out[f"{name}.{key}"] = value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
    return out


def test_planning_leaves_the_users_metric_states_exactly_as_they_were(tmp_path):
    module = MetricsEverywhere(bert().model)
    # States from a real batch first, so that an untouched state is not just a default.
    trainer([], tmp_path, max_steps=1).fit(module)
    real = batches(1)[0]
    for m in (module.acc, module.f1, module.collection):
        m.update(torch.tensor([0, 2, 2, 1]), real["labels"])
    module.acc.compute()
    before = metric_state(module)
    assert int(before["acc._update_count"]) >= 1 and before["acc.tp"].sum() > 0

    settings = FitStepSettings(get_device_spec("cpu"))
    profile = profile_lightning_step(module.trainer, module, real, settings)

    after = metric_state(module)
    assert after.keys() == before.keys()
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert type(after[key]) is torch.Tensor and torch.equal(after[key], value), key
        else:
            assert after[key] == value, key
    # The metrics are the user's own, as they were: torchmetrics' methods, not the dry run's stand-ins.
    assert not any(name in m.__dict__ for m in module.modules() for name in ("forward", "log", "log_dict"))
    module.acc.update(torch.tensor([0, 1, 2, 0]), real["labels"])
    assert module.acc._update_count == before["acc._update_count"] + 1
    ops = [(s["op"], s["module"]) for s in profile.placeholders]
    assert ops == [
        ("MulticlassAccuracy.forward", "acc"),
        ("MulticlassF1Score.update", "f1"),
        ("MulticlassF1Score.compute", "f1"),
        (SCALAR_READ, ""),  # .item() of the compute's stand-in: fake, so a placeholder again
        ("MulticlassPrecision.forward", "collection.precision"),
    ]
    # The collection's call is traced to the user's line, not torchmetrics' loop over its members.
    assert profile.placeholders[-1]["source"].endswith("self.log_dict(self.collection(preds, labels))")


class SizedByWeights(nn.Module):
    """Allocates a buffer whose size is read from a weight-derived value: a decision, not logging."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        n = int(h.detach().abs().max().item())
        return h + h.new_zeros(1000 * n).sum()


def test_a_scalar_read_that_decides_what_is_computed_stops_the_dry_run():
    match = r"Module '1' calls aten\._local_scalar_dense.*computes something else .*strict=False"
    with pytest.raises(ProfilingError, match=match) as info:
        profile_model(nn.Sequential(nn.ReLU(), SizedByWeights()), (torch.randn(4, 8),), device="cpu")
    err = info.value
    assert (err.op, err.module) == (SCALAR_READ, "1")
    assert err.source is not None and err.source.endswith("n = int(h.detach().abs().max().item())")


class FiniteGuard(nn.Module):
    """Stops on a non-finite output, written both ways round: the healthy answer is False for one, True for the
    other, so one of the two dry runs raises and the other is the step."""

    def __init__(self, negated: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.negated = negated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        if self.negated:
            if not torch.isfinite(out).all():
                raise FloatingPointError("non-finite output")
        elif torch.isnan(out).any():
            raise FloatingPointError("NaN output")
        return out


@pytest.mark.parametrize(("negated", "answer"), [(False, "False"), (True, "True")], ids=["isnan", "not-isfinite"])
def test_a_check_for_trouble_profiles_the_step_that_goes_on(negated, answer, monkeypatch):
    import lightning_sac.dryrun.run as dry_run

    runs = []
    record_step = dry_run.record_step
    monkeypatch.setattr(dry_run, "record_step", lambda *a, **k: runs.append(1) or record_step(*a, **k))
    x = torch.randn(4, 16)
    profile = profile_model(FiniteGuard(negated), (x,), optimizer_factory=torch.optim.SGD, device="cpu")
    assert len(runs) == 2  # the step with each set of answers; the one that raised is not the profile
    assert [(s["module"], s["value"]) for s in profile.placeholders] == [("", answer)]
    plain = profile_model(nn.Sequential(nn.Linear(16, 16)), (x,), optimizer_factory=torch.optim.SGD, device="cpu")
    assert profile.peak_bytes == plain.peak_bytes


def test_without_stand_ins_the_step_is_dry_run_once(monkeypatch):
    import lightning_sac.dryrun.run as dry_run

    runs = []
    record_step = dry_run.record_step
    monkeypatch.setattr(dry_run, "record_step", lambda *a, **k: runs.append(1) or record_step(*a, **k))
    profile = profile_model(ItemLoggingNet(log_norms=False), (torch.randn(4, 64),), device="cpu")
    assert profile.placeholders == [] and len(runs) == 1
