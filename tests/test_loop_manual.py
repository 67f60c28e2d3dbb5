"""Manual optimization: AutoSAC dry-runs the module's own ``training_step``, several optimizers and passes included.

The fake copy runs the step as ``fit`` does: ``self.optimizers()`` gives its own optimizers wrapped as Lightning
wraps them, ``toggle_optimizer`` / ``toggled_optimizer`` switch ``requires_grad`` of its parameters,
``self.manual_backward`` backpropagates, and each ``opt.step()`` steps. The fit tests measure the plain fit's peak
P with the independent harness (``fit_harness.BatchPeaks``), then fit with ``AutoSAC(budget_gb=0.8 * P)``: the fit
completes with a non-empty plan, its losses, parameters, buffers and gradients are the plain fit's, and every
batch's measured peak is within the budget + 2% (issue "AutoSAC in real training loops"). A step that runs a
backward pass inside its forward (a gradient penalty) cannot be planned: reported, or trained without a plan.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fit_harness import BatchPeaks
from test_callback import trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_sac import AutoSAC, ProfilingError
from lightning_sac.dryrun.data import ModelProfile
from lightning_sac.solver.memory_model import activation_windows

GIB = 2**30
SLACK = 1.02  # the allowance over the budget for a measured batch peak
BATCH = 1024


class Block(nn.Module):
    """A residual MLP block with batch norm: wide activations, and running statistics a recompute must not touch."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Samples(Dataset):
    """Real samples and latent codes, made when fetched, as a loader reading from disk makes them."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(BATCH, 32, generator=g), torch.randn(BATCH, 16, generator=g)


class GAN(pl.LightningModule):
    """A GAN step as Lightning's docs write it: two AdamW optimizers, each toggled while its network trains."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(16, 64), Block(64, 512), Block(64, 512), nn.Linear(64, 32))
        self.discriminator = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))
        self.losses: list[tuple[float, float]] = []
        self._step_losses: list[torch.Tensor] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        real, z = batch
        g_opt, d_opt = self.optimizers()
        # The generator: the discriminator's parameters are frozen while its loss backpropagates through them.
        self.toggle_optimizer(g_opt)
        fake = self.generator(z)
        verdict = self.discriminator(fake)
        g_loss = F.binary_cross_entropy_with_logits(verdict, torch.ones_like(verdict))
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        self.untoggle_optimizer(g_opt)
        # The discriminator, on real and generated samples (two more calls).
        with self.toggled_optimizer(d_opt):
            on_real, on_fake = self.discriminator(real), self.discriminator(fake.detach())
            d_loss = F.binary_cross_entropy_with_logits(on_real, torch.ones_like(on_real))
            d_loss = (d_loss + F.binary_cross_entropy_with_logits(on_fake, torch.zeros_like(on_fake))) / 2
            self.manual_backward(d_loss)
            d_opt.step()
            d_opt.zero_grad()
        self._step_losses = [g_loss.detach(), d_loss.detach()]

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        g_loss, d_loss = self._step_losses
        self.losses.append((float(g_loss), float(d_loss)))
        self._step_losses = []

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.AdamW(self.generator.parameters(), lr=1e-3),
            torch.optim.AdamW(self.discriminator.parameters(), lr=1e-3),
        ]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Samples(), batch_size=None)


def fit(module: pl.LightningModule, callbacks: list[Any], tmp_path: Path, steps: int = 8) -> list[int]:
    """Fit ``module`` (``steps`` optimizer steps) and return every batch's measured peak."""
    peaks = BatchPeaks()
    pl.seed_everything(0)
    trainer([*callbacks, peaks], tmp_path, max_steps=steps).fit(module)
    return peaks.peaks


def gradient_at(profile: ModelProfile, name: str, nth: int = 0) -> int:
    """Gradient bytes alive when the step enters phase ``name`` for the ``nth`` time."""
    events = [e for e in profile.timeline if (e.kind, e.name) == ("phase", name)]
    return events[nth].at["gradient"]


@pytest.mark.slow
def test_a_gan_with_two_optimizers_trains_within_the_budget_as_the_plain_fit(tmp_path):
    pl.seed_everything(0)
    model = GAN()
    plain = copy.deepcopy(model)
    plain_peaks = fit(plain, [], tmp_path)
    assert len(plain_peaks) == 4  # two optimizer steps per batch
    budget = 0.8 * max(plain_peaks)
    sac = AutoSAC(budget_gb=budget / GIB, measure=False, log_figures=False)
    planned = copy.deepcopy(model)
    peaks = fit(planned, [sac], tmp_path)

    assert sac.plan is not None and sac.plan.decisions and sac.profiled
    assert all(fqn.startswith("generator.") for fqn in sac.plan.decisions)  # the discriminator runs thrice
    # The dry run is the fit's step byte for byte: from the second batch on (the optimizers' state exists) the
    # plain fit's peak is the profile's.
    assert sac.plan.unconstrained_peak_bytes == max(plain_peaks) == plain_peaks[-1]
    assert planned.losses == plain.losses and len(plain.losses) == 4
    for (name, p), q in zip(plain.named_parameters(), planned.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)
        assert (p.grad is None) == (q.grad is None) == name.startswith("discriminator."), name
        if p.grad is not None:  # the generator's last gradients, alive until its next zero_grad
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)
    for (name, b), c in zip(plain.named_buffers(), planned.buffers(), strict=True):
        torch.testing.assert_close(c, b, rtol=0, atol=0, msg=name)  # batch norm statistics, updated once a call
    assert max(peaks) <= budget * SLACK, [round(p / budget, 4) for p in peaks]


def test_the_dry_run_follows_toggles_and_each_optimizer_as_the_step_calls_them(tmp_path):
    sac = AutoSAC(budget_gb=100, measure=False, log_figures=False)
    module = GAN()
    fit(module, [sac], tmp_path, steps=2)
    profile = sac.profile
    assert profile is not None
    generator = profile.modules["generator"].gradient_bytes
    discriminator = profile.modules["discriminator"].gradient_bytes
    assert generator > 0 and discriminator > 0
    # The step begins as the fit's steps do: the generator's gradients of the step before are alive (its
    # zero_grad comes before its backward), the discriminator's are not (set to None after its step).
    assert gradient_at(profile, "forward") == generator
    # The discriminator is toggled off while the generator's loss backpropagates through it: no gradient.
    assert gradient_at(profile, "optimizer", 0) == generator
    assert gradient_at(profile, "optimizer", 1) == generator + discriminator
    assert gradient_at(profile, "done") == generator
    assert [e.name for e in profile.timeline if e.kind == "phase"] == [
        *["forward", "backward", "forward", "optimizer", "forward"],
        *["backward", "forward", "optimizer", "forward", "done"],
    ]
    assert profile.modules["discriminator"].calls == 3 and profile.modules["generator"].calls == 1
    assert profile.input_signature[-1] == "manual_optimization"
    assert all(p.requires_grad for p in module.parameters())  # the dry run toggled the fake copy only


class TwoHeads(pl.LightningModule):
    """A shared trunk and two heads, each head's loss backpropagated on its own, the first with retain_graph.

    The second head's activations are alive through the first backward pass: a checkpoint of it frees them there.
    """

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.trunk = nn.Sequential(nn.Linear(16, 64), Block(64, 256))
        self.head1 = nn.Sequential(*[Block(64, 256) for _ in range(4)], nn.Linear(64, 1))
        self.head2 = nn.Sequential(*[Block(64, 256) for _ in range(4)], nn.Linear(64, 1))
        self.losses: list[float] = []
        self._step_loss: torch.Tensor | None = None

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        features = self.trunk(batch[1])
        first = self.head1(features).pow(2).mean()
        second = self.head2(features).abs().mean()
        self.manual_backward(first, retain_graph=True)
        self.manual_backward(second)
        opt.step()
        self._step_loss = (first + second).detach()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(self._step_loss))  # type: ignore[arg-type]
        self._step_loss = None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Samples(), batch_size=None)


@pytest.mark.slow
def test_two_backward_passes_through_one_graph_are_planned_around_the_shared_trunk(tmp_path):
    pl.seed_everything(0)
    model = TwoHeads()
    plain = copy.deepcopy(model)
    plain_peaks = fit(plain, [], tmp_path, steps=4)
    budget = 0.8 * max(plain_peaks)
    sac = AutoSAC(budget_gb=budget / GIB, measure=False, log_figures=False)
    planned = copy.deepcopy(model)
    peaks = fit(planned, [sac], tmp_path, steps=4)
    assert sac.plan is not None and sac.plan.decisions and sac.profile is not None
    # The trunk's backward runs in both passes (the first kept its graph): a checkpoint of it would recompute
    # twice and keep its inputs between the passes, which the memory model does not describe, so it is no
    # candidate; each head runs one backward.
    begins = [e.name for e in sac.profile.timeline if e.kind == "bwd_pre"]
    assert begins.count("trunk") == 2 and begins.count("head1") == begins.count("head2") == 1
    windows = activation_windows(sac.profile)
    assert not any(f.startswith("trunk") for f in windows) and {"head1", "head2", "head1.0", "head2.0"} <= set(windows)
    assert not any(f.startswith("trunk") for f in sac.plan.decisions)
    # The dry run's peak is the fit's but for a few bytes of scalars (96 of 33 MB when written).
    assert sac.plan.unconstrained_peak_bytes == pytest.approx(max(plain_peaks), rel=1e-5)
    assert planned.losses == plain.losses and len(plain.losses) == 4
    for (name, p), q in zip(plain.named_parameters(), planned.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)
    assert max(peaks) <= budget * SLACK, [round(p / budget, 4) for p in peaks]


class GradientPenalty(GAN):
    """A WGAN-GP style critic step: the penalty backpropagates inside the forward (create_graph=True)."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        real, z = batch
        _, d_opt = self.optimizers()
        real = real.clone().requires_grad_(True)
        critic = self.discriminator(real)
        (slope,) = torch.autograd.grad(critic.sum(), real, create_graph=True)
        loss = critic.mean() + (slope.norm(dim=1) - 1).pow(2).mean()
        d_opt.zero_grad()
        self.manual_backward(loss)
        d_opt.step()
        self._step_losses = [loss.detach(), loss.detach()]


class OwnBackward(GAN):
    """A manual step that calls ``loss.backward()`` itself instead of ``self.manual_backward(loss)``."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        g_opt, _ = self.optimizers()
        g_opt.zero_grad()
        loss = self.discriminator(self.generator(batch[1])).mean()
        loss.backward()
        g_opt.step()
        self._step_losses = [loss.detach(), loss.detach()]


@pytest.mark.parametrize(
    ("module", "match"),
    [
        (GradientPenalty, r"create_graph=True inside its forward .* cannot be planned: with AutoSAC, strict=False"),
        (OwnBackward, r"loss.backward\(\) or torch.autograd.grad.*self.manual_backward\(loss\)"),
    ],
)
def test_a_backward_inside_the_forward_stops_fit_under_strict(module, match, tmp_path):
    sac = AutoSAC(budget_gb=0.001, measure=False, log_figures=False)
    with pytest.raises(ProfilingError, match=match) as info:
        fit(module(), [sac], tmp_path, steps=2)
    assert "test_loop_manual.py" in (info.value.source or "")  # the user's line
    assert sac.plan is None


def test_a_gradient_penalty_trains_without_a_plan_under_strict_false(tmp_path):
    pl.seed_everything(0)
    model = GradientPenalty()
    plain = copy.deepcopy(model)
    fit(plain, [], tmp_path, steps=2)
    sac = AutoSAC(budget_gb=0.001, strict=False, measure=False, log_figures=False)
    unplanned = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="could not profile the training step, so training runs without a plan"):
        fit(unplanned, [sac], tmp_path, steps=2)
    assert sac.plan is None and not sac.profiled
    assert unplanned.losses == plain.losses and len(plain.losses) == 2
    assert not any("forward" in m.__dict__ for m in unplanned.modules())  # nothing was wrapped


class ClosureAndRawStep(GAN):
    """The generator steps with a closure (as LBFGS needs), the discriminator through the unwrapped optimizer."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        real, z = batch
        g_opt, _ = self.optimizers()
        _, d_raw = self.optimizers(use_pl_optimizer=False)
        losses = []

        def generator_closure() -> torch.Tensor:
            g_opt.zero_grad()
            loss = self.discriminator(self.generator(z)).mean()
            self.manual_backward(loss)
            losses.append(loss.detach())
            return loss

        g_opt.step(closure=generator_closure)
        d_raw.zero_grad()
        d_loss = self.discriminator(real).mean()
        self.manual_backward(d_loss)
        d_raw.step()
        self._step_losses = [losses[0], d_loss.detach()]


def test_closures_and_unwrapped_optimizers_step_in_their_phases(tmp_path):
    pl.seed_everything(0)
    model = ClosureAndRawStep()
    plain_peaks = fit(copy.deepcopy(model), [], tmp_path, steps=4)
    sac = AutoSAC(budget_gb=100, measure=False, log_figures=False)
    fit(copy.deepcopy(model), [sac], tmp_path, steps=2)
    profile = sac.profile
    assert profile is not None
    assert [e.name for e in profile.timeline if e.kind == "phase"] == [
        *["forward", "optimizer", "forward", "backward", "forward", "optimizer", "forward"],  # the closure
        *["backward", "forward", "optimizer", "forward", "done"],
    ]
    # The closure's forward is recorded as a forward: the generator runs once, with op stats and a backward.
    assert profile.modules["generator"].calls == 1 and "generator.1" in activation_windows(profile)
    assert profile.peak_bytes == plain_peaks[-1]
