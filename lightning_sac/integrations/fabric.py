"""``plan_and_apply``: AutoSAC's plan for a Lightning Fabric training loop.

A Fabric loop is the user's own code, so the step to plan is named by a function, ``step_fn(model, batch) -> loss``,
the forward and loss the loop backpropagates with ``fabric.backward``. Global rank 0 dry-runs it with the loop's
optimizer and Fabric's precision on fake tensors and solves for the budget; ``fabric.broadcast`` hands every rank
the same plan, which each applies to the module it set up. The loop is assumed to set the gradients to ``None``
before each forward or after each step (``optimizer.zero_grad()``, PyTorch's default ``set_to_none=True``), and to
step the optimizer every ``accumulate_grad_batches`` micro-batches.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.fabric.plugins.precision.amp import MixedPrecision
from lightning.fabric.wrappers import _FabricModule
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_sac.apply import PlanHandle, apply_plan
from lightning_sac.devices import DeviceSpec
from lightning_sac.dryrun import placeholder_message
from lightning_sac.errors import ProfilingError
from lightning_sac.integrations.planner import LoopStep, PlanSettings, plan_for_step, plan_on_rank_zero
from lightning_sac.lightning import own_checkpointing_message, plan_message

__all__ = ["plan_and_apply"]


def _module_of(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The module as the user wrote it, and what Fabric runs (its DDP wrapper, or the module itself)."""
    forward = model._forward_module if isinstance(model, _FabricModule) else model
    original = model.module if isinstance(model, _FabricModule) else model
    return (original.module if isinstance(original, DistributedDataParallel) else original), forward


def _check_strategy(fabric: Any) -> None:
    name = type(fabric.strategy).__name__
    if name not in ("SingleDeviceStrategy", "DDPStrategy"):
        raise ValueError(
            f"plan_and_apply plans single-device and DDP Fabric loops; this Fabric runs {name}. Use "
            "Fabric(strategy='ddp') or one device, or AutoSAC with Lightning's Trainer for FSDP and tensor parallelism."
        )


def plan_and_apply(
    fabric: Any,
    model: nn.Module,
    optimizer: Any,
    example_batch: Any,
    step_fn: Callable[[nn.Module, Any], torch.Tensor],
    budget_gb: float | None = None,
    *,
    budget_fraction: float | None = None,
    device: str | DeviceSpec | None = None,
    estimate: str = "roofline",
    candidates: Sequence[Any] | None = None,
    backend: str = "sac",
    n_segments: int = 2,
    solver_time_limit_s: float = 30.0,
    strict: bool = True,
    replace_existing: bool = False,
    accumulate_grad_batches: int = 1,
) -> PlanHandle | None:
    """Plan the loop's step on global rank 0, broadcast the plan, apply it to ``model`` on every rank.

    Call it after ``fabric.setup(model, optimizer)`` and before the first step, on every rank (it broadcasts). The
    arguments after ``budget_gb`` are :class:`~lightning_sac.AutoSAC`'s.

    Args:
        fabric: The ``lightning.fabric.Fabric`` of the loop.
        model: The module as ``fabric.setup`` returned it (or as written).
        optimizer: The loop's optimizer (as ``fabric.setup`` returned it, or the torch one).
        example_batch: A batch of the shapes to plan for, as ``step_fn`` takes it.
        step_fn: ``step_fn(model, batch)`` runs the forward and returns the loss the loop backpropagates.
        budget_gb: Memory budget per device, GiB.
        budget_fraction: Or: the budget as a fraction of the target device's memory.
        device: Target device name or ``DeviceSpec``; default Fabric's device.
        estimate: ``"roofline"`` or ``"benchmark"`` (CPU only).
        candidates: Module classes or fqn glob patterns allowed as checkpoint units.
        backend: ``"sac"`` or ``"graph"``.
        n_segments: Lines of each module's trade-off fit.
        solver_time_limit_s: HiGHS time limit.
        strict: ``True``: a budget below the minimum, or a step that cannot be dry-run, raises and nothing is
            applied. ``False``: warn, then apply the minimum-memory plan, or return ``None``.
        replace_existing: Let the plan replace the model's own Hugging Face ``gradient_checkpointing``.
        accumulate_grad_batches: Micro-batches per optimizer step.

    Returns:
        The applied plan's handle (``handle.plan``; ``handle.remove()`` gives the modules their own forward back),
        or ``None`` when ``strict=False`` and the step could not be dry-run (a warning says so).

    Raises:
        ProfilingError: The step cannot be dry-run (``strict=True``); nothing is applied.
        BudgetError: The budget is below the reachable minimum (``strict=True``); nothing is applied.
        LightningSACError: Planning failed on global rank 0 (raised on the other ranks).
    """
    settings = PlanSettings(
        budget_gb, budget_fraction, device, estimate, candidates, backend, n_segments, solver_time_limit_s, strict,
        replace_existing,
    )  # fmt: skip
    settings.check({}, example_batch)
    if isinstance(accumulate_grad_batches, bool) or not isinstance(accumulate_grad_batches, int):
        raise TypeError(f"plan_and_apply: accumulate_grad_batches must be an int, got {accumulate_grad_batches!r}.")
    if accumulate_grad_batches < 1:
        raise ValueError(f"plan_and_apply: accumulate_grad_batches must be at least 1, got {accumulate_grad_batches}.")
    if not callable(step_fn):
        raise TypeError(f"plan_and_apply: step_fn must be a function step_fn(model, batch) -> loss, got {step_fn!r}.")
    _check_strategy(fabric)
    module, runs = _module_of(model)
    precision = fabric.strategy.precision
    # Fabric's mixed precision autocasts the forward (torch.autocast's defaults: casts of weights cached).
    autocast = precision._desired_input_dtype if isinstance(precision, MixedPrecision) else None
    step = LoopStep(
        step_fn,
        optimizer,
        autocast_dtype=autocast,
        accumulate=accumulate_grad_batches,
        world_size=fabric.world_size,
        data_parallel=isinstance(runs, DistributedDataParallel),
        share=(fabric,),
    )

    def make() -> Any:
        try:
            plan, profile = plan_for_step(module, example_batch, step, settings, fabric.device)
        except ProfilingError as err:
            if strict:
                raise
            message = f"plan_and_apply could not dry-run the training step, so the loop runs without a plan: {err}"
            warnings.warn(message, stacklevel=3)
            return None
        for note in (placeholder_message(profile.placeholders) if profile.placeholders else None,
                     own_checkpointing_message(profile)):  # fmt: skip
            if note is not None:
                fabric.print(note)
        return plan

    plan = plan_on_rank_zero(fabric.global_rank == 0, make, lambda obj: fabric.broadcast(obj, src=0))
    if plan is None:
        return None
    handle = apply_plan(module, plan, backend=backend)
    fabric.print(plan_message(plan, backend))
    return handle
