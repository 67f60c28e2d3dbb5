"""Values the dry run has and values it has not: output shapes decided by the batch, host reads of the weights'.

``aten._ctc_loss`` returns ``log_alpha`` of ``(batch, T, 2 * max(target_lengths) + 1)``; the target lengths are
counted from the labels, real in the dry run, so the op's output size comes from them (dryrun/values/value_shapes.py):
a CTC model planned and trained, exact bytes for such an op. A detector's matcher reads its predictions on the host
(``.numpy()`` for scipy): the error names the read, and within ``host_read_stand_ins()`` the detector is planned and
trains as the plain model (dryrun/values/host_reads.py).
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from test_real_models import Reference, measured_planned_peak, reference, train_planned, two_steps
from torch import nn
from zoo import FAMILIES

from lightning_sac import (
    AutoSAC,
    ProfilingError,
    host_read_stand_ins,
    profile_model,
    solve_plan,
)
from lightning_sac.dryrun.measured import measure_training_step

GIB = 2**30


@pytest.mark.slow  # a long real-model cell: the matrix tier (the mechanism's unit tests are quick)
def test_ctc_model_plain_prediction_matches_a_real_step():
    ref = reference("wav2vec2_ctc")
    predicted = ref.profile.plain_peak_bytes
    assert abs(predicted - ref.plain_peak) <= 0.02 * ref.plain_peak, (predicted, ref.plain_peak)


def plan_at_80_percent_holds(ref: Reference, backend: str) -> None:
    """A plan at 80% of the peak trains as the plain model, within 2% above its prediction and below the plain peak."""
    plan = solve_plan(ref.profile, 0.8 * ref.profile.peak_bytes / GIB, backend=backend)
    assert plan.decisions
    train_planned(ref, plan)
    measured = measured_planned_peak(ref, plan)
    assert measured <= 1.02 * plan.predicted_peak_bytes, (measured, plan.predicted_peak_bytes)
    assert measured <= ref.plain_peak, (measured, ref.plain_peak)


@pytest.mark.slow  # a cell of the real-model matrix, as in test_real_models.py
@pytest.mark.parametrize("backend", ["sac", "graph"])
def test_ctc_model_plan_at_80_percent_holds_and_trains_as_the_plain_model(backend):
    plan_at_80_percent_holds(reference("wav2vec2_ctc"), backend)


class CTCHead(nn.Module):
    """A linear CTC head on features; the loss's target lengths are counted from padded labels, as users do."""

    def __init__(self, features: int = 16, classes: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(features, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        log_probs = self.proj(x).log_softmax(-1).transpose(0, 1)  # (T, batch, classes)
        mask = labels >= 0
        target_lengths = mask.sum(-1)
        input_lengths = torch.full((x.shape[0],), x.shape[1], dtype=torch.long)
        return F.ctc_loss(log_probs, labels.masked_select(mask), input_lengths, target_lengths, reduction="sum")


def _ctc_batch(longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, 16, generator=g)
    labels = torch.randint(1, 8, (3, 12), generator=g)
    labels[0, longest:] = -100
    labels[1, 4:] = -100
    labels[2, 7:] = -100
    return x, labels


def _op_bytes(profile, name: str = "aten._ctc_loss.default") -> int:
    stats = profile.modules[""].op_stats
    return next(b for f, b in zip(stats.func_names, stats.memory, strict=True) if f == name)


@pytest.mark.parametrize("longest", [9, 12])
def test_ctc_loss_output_bytes_come_from_the_batch_target_lengths_exactly(longest):
    torch.manual_seed(0)
    model = CTCHead()
    x, labels = _ctc_batch(longest)
    profile = profile_model(model, (x, labels), loss_fn=lambda loss: loss, device="cpu")
    with torch.no_grad():  # the real op's outputs: the loss per row and log_alpha
        log_probs = model.proj(x).log_softmax(-1).transpose(0, 1)
        mask = labels >= 0
        real = torch.ops.aten._ctc_loss.Tensor(
            log_probs, labels.masked_select(mask), torch.full((3,), 40), mask.sum(-1), 0, False
        )
    real_bytes = sum(t.untyped_storage().nbytes() for t in real)
    assert real[1].shape == (3, 40, 2 * longest + 1)
    assert _op_bytes(profile) == real_bytes == 4 * (3 + 3 * 40 * (2 * longest + 1))
    # The whole step measured on the allocator: the same bytes to the byte.
    measured = measure_training_step(copy.deepcopy(model), (x, labels), loss_fn=lambda loss: loss)
    assert profile.peak_bytes == measured.peak_bytes


class MaskedScores(nn.Module):
    """Scores only the real tokens with ``masked_select``: its size is the batch mask's count, its values fake."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.proj(x).masked_select(mask.unsqueeze(-1)).square().mean()


def test_masked_select_with_a_batch_mask_has_the_mask_count_bytes():
    g = torch.Generator().manual_seed(0)
    x, mask = torch.randn(4, 32, 16, generator=g), torch.rand(4, 32, generator=g) > 0.3
    profile = profile_model(MaskedScores(), (x, mask), loss_fn=lambda loss: loss, device="cpu")
    assert _op_bytes(profile, "aten.masked_select.default") == 4 * 16 * int(mask.sum())
    with torch.no_grad():
        real = MaskedScores().proj(x).masked_select(mask.unsqueeze(-1))
    assert _op_bytes(profile, "aten.masked_select.default") == real.untyped_storage().nbytes()


class WeightDecidedLengths(nn.Module):
    """CTC whose target lengths are computed from the weights: the dry run cannot know the output's size."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        log_probs = self.proj(x).log_softmax(-1).transpose(0, 1)
        lengths = (log_probs.detach().exp() > 0.2).sum(0).amax(-1).clamp(1, 12)  # from the weights
        input_lengths = torch.full((x.shape[0],), x.shape[1], dtype=torch.long)
        return F.ctc_loss(log_probs, labels.clamp_min(1), input_lengths, lengths)


def test_an_output_size_decided_by_the_weights_is_blamed_on_the_weights():
    x, labels = _ctc_batch(12)
    with pytest.raises(ProfilingError) as info:
        profile_model(WeightDecidedLengths(), (x, labels), loss_fn=lambda loss: loss, device="cpu")
    message = str(info.value)
    assert "_ctc_loss" in message and "target_lengths" in message
    assert "from the weights" in message
    assert "F.ctc_loss(log_probs, labels.clamp_min(1), input_lengths, lengths)" in message


# ---------------------------------------------------------------- host reads of values computed from the weights


def test_a_matcher_reading_predictions_on_the_host_is_named_with_its_line_and_the_weights():
    family = FAMILIES["detr"]()
    with pytest.raises(ProfilingError) as info:
        profile_model(family.model, family.batch, optimizer_factory=family.optimizer, device="cpu")
    err, message = info.value, str(info.value)
    # The read that stopped the dry run: scipy's linear_sum_assignment on the cost matrix's .numpy().
    assert err.op == "Tensor.numpy" and ".numpy()" in message and "computed from the weights" in message
    assert err.source is not None and "loss_for_object_detection.py" in err.source
    assert "linear_sum_assignment(c[i])" in err.source and err.source in message
    # Not the library's complaint alone: the box check's stand-in answer and where it led are said.
    assert "(boxes1[:, 2:] >= boxes1[:, :2]).all()" in message and "ValueError: boxes1 must be" in message
    assert "host_read_stand_ins()" in message and "strict=False" in message


class HostMatcher(nn.Module):
    """A plain-torch head whose loss pairs predictions with targets by scipy on the host, as matchers do."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from scipy.optimize import linear_sum_assignment

        pred = self.head(x)  # (queries, 4)
        cost = torch.cdist(pred.detach(), targets, p=1)
        rows, cols = linear_sum_assignment(cost.cpu().numpy())
        return F.l1_loss(pred[torch.as_tensor(rows)], targets[torch.as_tensor(cols)])


def test_a_numpy_read_without_stand_ins_before_it_is_named():
    g = torch.Generator().manual_seed(0)
    x, targets = torch.randn(12, 16, generator=g), torch.rand(5, 4, generator=g)
    with pytest.raises(ProfilingError, match=r"reads a tensor of shape \(12, 5\) on the host with \.numpy\(\)") as info:
        profile_model(HostMatcher(), (x, targets), loss_fn=lambda loss: loss, device="cpu")
    assert "from the weights" in str(info.value) and info.value.module == ""
    assert info.value.source is not None and "linear_sum_assignment(cost.cpu().numpy())" in info.value.source
    with host_read_stand_ins():
        profile = profile_model(HostMatcher(), (x, targets), loss_fn=lambda loss: loss, device="cpu")
    # Both stand-ins (zeros, then a ramp) gave assignments of 5 pairs: the same step, checked by the second run.
    assert [(s["kind"], s["op"], s["value"]) for s in profile.placeholders] == [
        ("array", "Tensor.numpy", "an array of shape (12, 5)")
    ]
    measured = measure_training_step(HostMatcher(), (x, targets), loss_fn=lambda loss: loss)
    # Within 2% (28 bytes of a 1.9 kB step): torch.as_tensor of scipy's index arrays shares their memory in the real
    # step, where the dry run's are tensors of the allocator.
    assert abs(profile.peak_bytes - measured.peak_bytes) <= 0.02 * measured.peak_bytes, (profile, measured)


def _detr_reference() -> Reference:
    family = FAMILIES["detr"]()
    with host_read_stand_ins():
        profile = profile_model(family.model, family.batch, optimizer_factory=family.optimizer, device="cpu")
    measured = measure_training_step(copy.deepcopy(family.model), family.batch, optimizer_factory=family.optimizer)
    return Reference(family, profile, measured.peak_bytes, two_steps(copy.deepcopy(family.model), family))


@pytest.fixture(scope="module")
def detr_reference() -> Reference:
    return _detr_reference()


@pytest.mark.slow  # a long real-model cell: the matrix tier (the mechanism's unit tests are quick)
def test_with_stand_in_arrays_the_detector_profile_matches_a_real_step(detr_reference):
    profile, plain_peak = detr_reference.profile, detr_reference.plain_peak
    assert [s["op"] for s in profile.placeholders if s["kind"] == "array"] == ["Tensor.numpy"]
    # The stand-in assignment pairs as many rows as the real one: the step holds what the real step holds.
    assert abs(profile.plain_peak_bytes - plain_peak) <= 0.02 * plain_peak, (profile.plain_peak_bytes, plain_peak)


@pytest.mark.slow  # a cell of the real-model matrix, as in test_real_models.py
@pytest.mark.parametrize("backend", ["sac", "graph"])
def test_a_detector_planned_with_stand_in_arrays_trains_as_the_plain_model(detr_reference, backend):
    plan_at_80_percent_holds(detr_reference, backend)


class MatchedLightning(pl.LightningModule):
    """A LightningModule whose loss pairs its predicted boxes with the targets by scipy on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3)))
        self.boxes = nn.Linear(64, 4)
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        from scipy.optimize import linear_sum_assignment

        x, targets = batch
        pred = self.boxes(self.body(x)).sigmoid()[0]  # (queries, 4) of the first image
        rows, cols = linear_sum_assignment(torch.cdist(pred.detach(), targets[0], p=1).numpy())
        loss = F.l1_loss(pred[torch.as_tensor(rows)], targets[0][torch.as_tensor(cols)])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(4, 256, 64, generator=g), torch.rand(4, 5, 4, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=1)


def _fit(callback: AutoSAC, tmp_path) -> MatchedLightning:
    pl.seed_everything(0)
    module = MatchedLightning()
    trainer = pl.Trainer(
        callbacks=[callback],
        max_steps=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module)
    return module


def test_autosac_names_the_host_read_and_plans_the_fit_within_host_read_stand_ins(tmp_path):
    with pytest.raises(ProfilingError, match=r"\.numpy\(\).*from the weights") as info:
        _fit(AutoSAC(budget_gb=1.0, measure=False, log_figures=False), tmp_path)
    assert info.value.source is not None and "linear_sum_assignment" in info.value.source
    plain = _fit(AutoSAC(budget_gb=1.0, measure=False, log_figures=False, strict=False), tmp_path)
    callback = AutoSAC(budget_fraction=1.0, measure=False, log_figures=False)
    with host_read_stand_ins():
        probe = _fit(callback, tmp_path)
    assert callback.profile is not None
    assert [s["kind"] for s in callback.profile.placeholders if s["op"] == "Tensor.numpy"] == ["array"]
    planned = AutoSAC(budget_gb=0.8 * callback.profile.peak_bytes / 2**30, measure=False, log_figures=False)
    with host_read_stand_ins():
        module = _fit(planned, tmp_path)
    assert planned.plan is not None and planned.plan.decisions
    assert module.losses == pytest.approx(plain.losses) and len(probe.losses) == 2
