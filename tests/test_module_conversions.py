"""A module converted during the step (``Module.to``) in the dry run, whose parameters are fake tensors.

Hugging Face's mixture-of-experts routers (SwitchTransformers, NLLB-MoE) run
``self.classifier = self.classifier.to(self.dtype)`` at every forward: a no-op once the dtype is right. torch
converts a module of fake tensors by swapping each parameter for its converted copy, which fails on a tensor the
fake mode holds a weak reference to: ``profile_model`` raised torch's bare ``RuntimeError: _apply(): Couldn't swap
Linear.weight``. A conversion that changes nothing now leaves the module as it is; one that changes a fake tensor
is refused with a ProfilingError that says what to do.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_sac import ProfilingError, apply_plan, profile_model, solve_plan
from lightning_sac.dryrun.measured import measure_training_step


class _Router(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.classifier = nn.Linear(32, 8)
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.classifier = self.classifier.to(self.dtype)  # as SwitchTransformersTop1Router does, every call
        return torch.softmax(self.classifier(x.to(self.dtype)), -1).to(x.dtype)


class _Block(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.router = _Router(dtype)
        self.mlp = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x) * self.router(x)[..., :1]


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(_Block(dtype), _Block(dtype), nn.Linear(32, 4))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def test_a_conversion_that_changes_nothing_is_profiled_and_planned():
    model, x = _model(torch.float32), torch.randn(16, 24, 32)
    profile = profile_model(model, (x,), loss_fn=_loss, device="cpu")
    measured = measure_training_step(copy.deepcopy(model), (x,), loss_fn=_loss).peak_bytes
    assert profile.plain_peak_bytes == measured  # a CPU step of plain ops: to the byte
    plan = solve_plan(profile, 0.7 * measured / 2**30)
    planned = copy.deepcopy(model)
    apply_plan(planned, plan)
    assert measure_training_step(planned, (x,), loss_fn=_loss).peak_bytes <= 0.7 * measured
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the user's model: untouched


def test_a_conversion_that_changes_a_fake_tensor_says_what_to_do():
    model = _model(torch.float64)  # the router casts its float32 classifier to float64 at its first call
    with pytest.raises(ProfilingError, match=r"converts its parameters or buffers during the step") as info:
        profile_model(model, (torch.randn(16, 24, 32),), loss_fn=_loss, device="cpu")
    assert "Module '0.router.classifier' (Linear)" in str(info.value)
    assert "Convert the model before profiling" in str(info.value)
    assert all(p.dtype == torch.float32 for p in model.parameters())
