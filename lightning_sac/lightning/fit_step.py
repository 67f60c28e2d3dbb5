"""The dry run of a LightningModule's own training step: what :class:`~lightning_sac.AutoSAC` profiles.

The fake copy of the module runs its ``training_step`` and the optimizer of its ``configure_optimizers``, with
the trainer's precision, Lightning's order of ``zero_grad`` and its gradient accumulation, so the profile is of the
step ``fit`` runs. A module that optimizes manually runs its own step, backward passes and optimizer steps on the
fake copy through Lightning's manual-optimization API (:mod:`lightning_sac.lightning.fit_manual`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import FSDPPrecision
from torch.nn.parallel import DistributedDataParallel

from lightning_sac.devices import DeviceSpec
from lightning_sac.dryrun import ModelProfile
from lightning_sac.errors import ProfilingError
from lightning_sac.lightning.fit_manual import ManualDryRun
from lightning_sac.profiling import profile_step

__all__ = ["FitStepSettings", "first_optimizer", "profile_lightning_step", "training_loss"]

_AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def training_loss(out: Any) -> torch.Tensor:
    """The loss of what ``training_step`` returned: the loss, or a dict holding it under ``"loss"``."""
    loss = out.get("loss") if isinstance(out, dict) else out
    if not isinstance(loss, torch.Tensor):
        raise ProfilingError(
            f"AutoSAC needs training_step to return the loss (a tensor, or a dict with 'loss'); it returned "
            f"{type(out).__name__}."
        )
    return loss


def first_optimizer(conf: Any) -> torch.optim.Optimizer | None:
    """The first optimizer of whatever ``configure_optimizers`` returned (schedulers are ignored)."""
    if conf is None or isinstance(conf, torch.optim.Optimizer):
        return conf
    if isinstance(conf, dict):
        return first_optimizer(conf.get("optimizer"))
    if isinstance(conf, (list, tuple)) and conf:
        return first_optimizer(conf[0])
    raise TypeError(f"AutoSAC cannot find an optimizer in configure_optimizers' return value {conf!r}.")


@dataclass(frozen=True)
class FitStepSettings:
    """How the dry run of a fit's step is made.

    Attributes:
        spec: The target device.
        estimate: ``"roofline"`` or ``"benchmark"``.
        replace_existing: Profile with the model's Hugging Face ``gradient_checkpointing`` flags off.
    """

    spec: DeviceSpec
    estimate: str = "roofline"
    replace_existing: bool = False


def profile_lightning_step(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, settings: FitStepSettings
) -> ModelProfile:
    """Dry-run ``pl_module``'s ``training_step`` on ``batch`` and its optimizer's step, as ``trainer`` runs them.

    With ``trainer.accumulate_grad_batches = k``, the step profiled is the last micro-batch of a cycle, the one that
    holds the most (:func:`~lightning_sac.dryrun.step.training_step`). A module with
    ``automatic_optimization = False`` runs its own ``training_step`` whole, with the optimizers of its
    ``configure_optimizers``.

    Raises:
        ProfilingError: The step cannot be dry-run (see :func:`~lightning_sac.profile_model`).
    """
    manual = not pl_module.automatic_optimization

    def compute_loss(module: torch.nn.Module, inputs: tuple[Any, ...]) -> Any:
        # The fake copy logs nothing: its values are fake, and the trainer's logger is the user's.
        module.__dict__["log"] = module.__dict__["log_dict"] = lambda *a, **k: None
        out = module.training_step(inputs[0], 0)  # type: ignore[operator]
        return out if manual else training_loss(out)  # a manual step backpropagates itself

    def make_optimizer(module: torch.nn.Module) -> torch.optim.Optimizer | None:
        return first_optimizer(module.configure_optimizers())  # type: ignore[operator]

    run = ManualDryRun(trainer, compute_loss) if manual else None
    autocast = _AUTOCAST.get(str(trainer.precision))
    if isinstance(trainer.precision_plugin, FSDPPrecision) and not settings.spec.is_cuda:
        # Lightning's FSDP precision autocasts CUDA only; FSDP1's mixed precision computes on cast parameters,
        # which the unsharded copy has (lightning_sac.sharding.unsharded).
        autocast = None
    profile = profile_step(
        pl_module,
        (batch,),
        None if run else compute_loss,
        make_optimizer=run.make_optimizers if run else make_optimizer,
        device=settings.spec,
        estimate=settings.estimate,
        share=(trainer,),
        autocast_dtype=autocast,
        lightning_order=True,
        replace_existing=settings.replace_existing,
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        manual_step=run.run if run else None,
        wrapper=trainer.strategy.model if trainer.strategy.model is not pl_module else None,
    )
    profile.data_parallel = isinstance(trainer.strategy.model, DistributedDataParallel)
    return profile
