"""A checkpoint's recompute sees the lists and dicts its module was called with as they were at the call.

torchvision's DenseNet passes each layer the block's list of features and appends the layer's output to it after
the call. ``torch.utils.checkpoint`` keeps that list as the object itself, so a recompute read one more feature:
``torch.cat`` of them failed in backward with a shape error, and a layer reading a feature by position (the same
shape) got another tensor's values and trained wrong gradients, silently. The SAC backend's wrapper now reruns
the module on copies of the call's lists and dicts as they were when it began (``apply/rerun_args.py``).
"""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from lightning_sac import BudgetError, apply_plan, profile_model, solve_plan

D = 16


class _Layer(nn.Module):
    def __init__(self, mode: str, width: int) -> None:
        super().__init__()
        self.mode = mode
        self.a = nn.Linear(width, 64)
        self.b = nn.Linear(64, D)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        if self.mode == "cat":  # torchvision's _DenseLayer
            x = torch.cat(features, -1)
        elif self.mode == "mean":
            x = torch.stack(features).mean(0)
        else:  # the newest feature: after the caller's append, another tensor of the same shape
            x = features[-1]
        return self.b(torch.tanh(self.a(x)))


class _Block(nn.Module):
    def __init__(self, mode: str, n: int = 4) -> None:
        super().__init__()
        widths = [D * (i + 1) if mode == "cat" else D for i in range(n)]
        self.inp = nn.Linear(D, D)
        self.layers = nn.ModuleList(_Layer(mode, w) for w in widths)
        self.head = nn.Linear(D * (n + 1), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [self.inp(x)]
        for layer in self.layers:
            features.append(layer(features))  # the list the layer was given grows after its call
        return self.head(torch.cat(features, -1)).square().mean()


def _grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(x)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["cat", "mean", "last"])
def test_a_layer_given_a_list_the_caller_appends_to_trains_as_the_plain_model(mode):
    torch.manual_seed(0)
    model, x = _Block(mode), torch.randn(512, D)
    profile = profile_model(model, (x,), loss_fn=lambda loss: loss, device="cpu")
    with pytest.raises(BudgetError) as info:
        solve_plan(profile, 1e-9)
    plan = solve_plan(profile, info.value.minimum_bytes * 1.02 / 2**30)
    assert any(fqn.startswith("layers.") for fqn in plan.decisions)
    plain_loss, plain = _grads(copy.deepcopy(model), x)
    planned = copy.deepcopy(model)
    apply_plan(planned, plan)
    loss, grads = _grads(planned, x)  # before: a shape error in backward (cat), or other gradients (mean, last)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(grads[n], g) for n, g in plain.items())


class _Appends(nn.Module):
    """Appends its output to the list it is given: the caller's list must grow once per call, not per rerun."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(D, 128), nn.GELU(), nn.Linear(128, D))

    def forward(self, x: torch.Tensor, out: list[torch.Tensor]) -> torch.Tensor:
        y = x + self.mlp(x)
        out.append(y)
        return y


class _Collects(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Appends() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        collected: list[torch.Tensor] = []
        for block in self.blocks:
            x = block(x, collected)
        assert len(collected) == 3
        return torch.stack(collected).square().mean()


def test_a_module_that_appends_to_its_list_argument_does_so_once():
    torch.manual_seed(0)
    model, x = _Collects(), torch.randn(256, D)
    profile = profile_model(model, (x,), loss_fn=lambda loss: loss, device="cpu")
    with pytest.raises(BudgetError) as info:
        solve_plan(profile, 1e-9)
    plan = solve_plan(profile, info.value.minimum_bytes * 1.02 / 2**30)
    assert plan.decisions
    plain_loss, plain = _grads(copy.deepcopy(model), x)
    planned = copy.deepcopy(model)
    apply_plan(planned, plan)
    loss, grads = _grads(planned, x)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(grads[n], g) for n, g in plain.items())


class _HostRandom(nn.Module):
    """A block whose output depends on Python's or NumPy's global generator, drawn in its forward."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = source
        self.mlp = nn.Sequential(nn.Linear(D, 128), nn.GELU(), nn.Linear(128, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mlp(x)
        if self.source == "numpy":  # a feature mask from NumPy's global generator
            keep = torch.from_numpy((np.random.rand(D) > 0.3).astype(np.float32))
        else:  # a scale from Python's
            keep = torch.full((D,), random.uniform(0.5, 1.5))
        return x + h * keep


@pytest.mark.parametrize("source", ["numpy", "python"])
def test_a_module_drawing_from_a_host_generator_reruns_the_same_numbers(source):
    torch.manual_seed(0)
    model = nn.Sequential(*[_HostRandom(source) for _ in range(3)], nn.Linear(D, 1))
    x = torch.randn(512, D)
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    profile = profile_model(model, (x,), loss_fn=loss_fn, device="cpu")
    with pytest.raises(BudgetError) as info:
        solve_plan(profile, 1e-9)
    plan = solve_plan(profile, info.value.minimum_bytes * 1.02 / 2**30)
    assert plan.decisions

    def two_steps(m: nn.Module) -> list[Any]:
        random.seed(3)
        np.random.seed(3)
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        record = []
        for _ in range(2):
            loss = loss_fn(m(x))
            loss.backward()
            record.append([loss.detach()] + [p.grad.clone() for p in m.parameters()])
            optimizer.step()
            optimizer.zero_grad()
        # The generators move on as in the plain step: the recompute's draws are not taken from them.
        record.append([torch.tensor(random.random()), torch.tensor(np.random.rand())])
        return record

    plain = two_steps(copy.deepcopy(model))
    planned = copy.deepcopy(model)
    apply_plan(planned, plan)
    got = two_steps(planned)  # before: other gradients (the recompute drew other numbers), no error
    assert all(torch.equal(a, b) for ra, rb in zip(plain, got, strict=True) for a, b in zip(ra, rb, strict=True))


def test_profiling_leaves_the_host_generators_as_it_found_them():
    torch.manual_seed(0)
    model = nn.Sequential(_HostRandom("numpy"), _HostRandom("python"), nn.Linear(D, 1))
    random.seed(5)
    np.random.seed(5)
    expected = random.random(), np.random.rand()
    random.seed(5)
    np.random.seed(5)
    profile_model(model, (torch.randn(64, D),), loss_fn=lambda out: out.square().mean(), device="cpu")
    assert (random.random(), np.random.rand()) == expected  # before: moved on by every dry run of the forward


@pytest.mark.parametrize("mode", ["cat", "last"])
def test_a_checkpoint_keeps_the_list_as_it_was_not_what_is_appended_later(mode):
    """The checkpoint is handed copies of the call's lists: given the caller's list, it kept every feature the block
    appended after the call alive until the layer's backward (5% above the budget at 85% here)."""
    from lightning_sac.dryrun.measured import measure_training_step

    torch.manual_seed(0)
    model, x = _Block(mode), torch.randn(512, D)
    profile = profile_model(model, (x,), loss_fn=lambda loss: loss, device="cpu")
    plain = measure_training_step(copy.deepcopy(model), (x,), loss_fn=lambda loss: loss).peak_bytes
    plan = solve_plan(profile, 0.85 * plain / 2**30)
    planned = copy.deepcopy(model)
    apply_plan(planned, plan)
    measured = measure_training_step(planned, (x,), loss_fn=lambda loss: loss).peak_bytes
    assert measured <= plan.predicted_peak_bytes <= 0.85 * plain
