"""Trainable parameters a step gives no gradient hold no optimizer state, in the profile as in training.

A decoder run without encoder states never uses its cross-attention (MusicGen's decoder alone), a vision tower's
last layer is unused when the features come from the one before (LLaVA): their gradients stay ``None``, and AdamW
makes no state for a parameter without a gradient. The dry run's warm-up stepped the optimizer on zero gradients
for every trainable parameter, so the profile held their state: twice their bytes too many with AdamW (MusicGen's
plain step predicted 7.2% over the measured). It now records the step again without state for them.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from lightning_sac import profile_model
from lightning_sac.dryrun import run as dry_run_module
from lightning_sac.dryrun.measured import measure_training_step


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.unused = nn.Linear(256, 256)  # 257 KiB of parameters no step reaches

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        h = self.used(x)
        return h if memory is None else h + self.unused(memory).sum()


@pytest.mark.parametrize(
    "optimizer", [functools.partial(torch.optim.AdamW, lr=1e-3), functools.partial(torch.optim.SGD, lr=0.1)]
)
def test_a_step_that_leaves_parameters_without_gradient_is_predicted_to_the_byte(optimizer, monkeypatch):
    calls = []
    record = dry_run_module.record_step
    monkeypatch.setattr(dry_run_module, "record_step", lambda *a, **k: calls.append(k) or record(*a, **k))
    torch.manual_seed(0)
    model, batch = _WithUnused(), (torch.randn(128, 64),)
    loss = lambda out: out.square().mean()  # noqa: E731
    profile = profile_model(model, batch, loss_fn=loss, optimizer_factory=optimizer, device="cpu")
    measured = measure_training_step(copy.deepcopy(model), batch, loss_fn=loss, optimizer_factory=optimizer)
    assert profile.plain_peak_bytes == measured.peak_bytes  # before: 2 x the unused bytes over (AdamW)
    assert profile.modules["unused"].optimizer_state_bytes == 0
    assert [sorted(k.get("ungraded", ())) for k in calls] == [[], [4, 5]]  # unused.weight, unused.bias
