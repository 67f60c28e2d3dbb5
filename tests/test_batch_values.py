"""Output shapes decided by the batch's values: CTC's loss, planned and trained; exact bytes for such an op.

``aten._ctc_loss`` returns ``log_alpha`` of ``(batch, T, 2 * max(target_lengths) + 1)``; the target lengths are
counted from the labels, real in the dry run, so the op's output size comes from them (profiling/value_shapes.py).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_real_models import reference, two_steps
from torch import nn

from lightning_sac import ProfilingError, apply_plan, profile_model, solve_plan
from lightning_sac.measure import measure_training_step

GIB = 2**30


def test_ctc_model_plain_prediction_matches_a_real_step():
    ref = reference("wav2vec2_ctc")
    predicted = ref.profile.plain_peak_bytes
    assert abs(predicted - ref.plain_peak) <= 0.02 * ref.plain_peak, (predicted, ref.plain_peak)


@pytest.mark.parametrize("backend", ["sac", "graph"])
def test_ctc_model_plan_at_80_percent_holds_and_trains_as_the_plain_model(backend):
    ref = reference("wav2vec2_ctc")
    plan = solve_plan(ref.profile, 0.8 * ref.profile.peak_bytes / GIB, backend=backend)
    assert plan.decisions
    model = copy.deepcopy(ref.family.model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="lightning-sac")  # no mismatch, no unplanned call
        handle = apply_plan(model, plan)
        steps = two_steps(model, ref.family)
    assert all(w.mismatched_calls == 0 for w in handle.wrappers.values())
    for (plain_loss, plain_grads, plain_buffers), (loss, grads, buffers) in zip(ref.steps, steps, strict=True):
        torch.testing.assert_close(loss, plain_loss)
        assert grads.keys() == plain_grads.keys()
        for n in plain_grads:
            torch.testing.assert_close(grads[n], plain_grads[n], msg=n)
        assert buffers.keys() == plain_buffers.keys()
        for n in plain_buffers:
            torch.testing.assert_close(buffers[n], plain_buffers[n], msg=n)
    handle.remove()
    planned = copy.deepcopy(ref.family.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_plan(planned, plan)
        measured = measure_training_step(
            planned, ref.family.batch, loss_fn=ref.family.loss_fn, optimizer_factory=ref.family.optimizer
        ).peak_bytes
    assert measured <= 1.02 * plan.predicted_peak_bytes, (measured, plan.predicted_peak_bytes)
    assert measured <= ref.plain_peak, (measured, ref.plain_peak)


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


def _ctc_op(profile, name: str = "aten._ctc_loss.default") -> int:
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
    assert _ctc_op(profile) == real_bytes == 4 * (3 + 3 * 40 * (2 * longest + 1))
    # The whole step measured on the allocator: the same bytes to the byte.
    measured = measure_training_step(copy.deepcopy(model), (x, labels), loss_fn=lambda loss: loss)
    assert profile.peak_bytes == measured.peak_bytes


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
