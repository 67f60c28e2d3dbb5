"""What AutoSAC decides around a dry run.

The batch it plans with, a saved plan's file, what it tells the user about the model's own checkpointing, and
the plan under ``strict=False`` when the budget is out of reach.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_sac.dryrun import ModelProfile
from lightning_sac.errors import BudgetError, LightningSACError
from lightning_sac.plan import Plan
from lightning_sac.solver import solve_plan

__all__ = [
    "broadcast_from_rank_zero",
    "first_training_batch",
    "own_checkpointing_message",
    "plan_message",
    "read_plan_file",
    "solve_or_minimum",
]

_GIB = 2**30


def broadcast_from_rank_zero(
    is_rank_zero: bool, make: Callable[[], dict[str, Any]], broadcast: Callable[[Any], Any]
) -> dict[str, Any]:
    """``make()`` on global rank 0, what it returns handed to every rank by ``broadcast`` (an object from rank 0).

    Raises:
        LightningSACError: ``make`` failed on rank 0 (raised there with its own traceback; on the other ranks with
            its type and message): every rank waits for the broadcast, and none trains without the others' plan.
    """
    payload: dict[str, Any] = {}
    if is_rank_zero:
        try:
            payload = make()
        except Exception as err:
            broadcast({"error": type(err).__name__, "message": str(err)})
            raise
    payload = broadcast(payload)
    if "error" in payload:
        raise LightningSACError(f"AutoSAC planning failed on global rank 0: {payload['error']}: {payload['message']}")
    return payload


def first_training_batch(trainer: pl.Trainer) -> Any:
    """The first batch of the trainer's training dataloader (of the first one, for a collection of them).

    Raises:
        ValueError: The trainer has no training dataloader.
    """
    loaders: Any = trainer.train_dataloader  # the user's loader, or a collection of them
    while isinstance(loaders, (list, tuple, dict)):
        loaders = next(iter(loaders.values() if isinstance(loaders, dict) else loaders), None)
    if loaders is None:
        raise ValueError("AutoSAC found no training dataloader; pass example_batch or example_batch_fn.")
    # Starting a DataLoader iterator draws its base seed from the global generator: fork it, so that the
    # run's random numbers (shuffling, dropout) are the same with AutoSAC as without.
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        return next(iter(loaders))


def read_plan_file(path: Path) -> Plan | None:
    """The plan saved at ``path``, or ``None`` (and a warning) when it cannot be read or parsed."""
    try:
        return Plan.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        # A half-written or hand-edited file: planning again and overwriting it is what the user wants.
        rank_zero_warn(
            f"AutoSAC: the plan file {str(path)!r} cannot be read as a plan ({type(err).__name__}: {err}); "
            "planning again, and the new plan replaces it."
        )
        return None


def own_checkpointing_message(profile: ModelProfile) -> str | None:
    """What to tell the user when the model checkpoints modules itself, or ``None`` when it does not."""
    own = profile.checkpointed_modules or profile.checkpoint_callers
    if not own:
        return None
    how = (
        "AutoSAC(replace_existing=True) or model.gradient_checkpointing_disable()"
        if profile.checkpointing_flags
        else "removing its torch.utils.checkpoint calls"
    )
    return (
        f"AutoSAC: the model already checkpoints {len(own)} module(s) itself ({', '.join(own[:3])}"
        f"{', ...' if len(own) > 3 else ''}); the plan leaves them, and every module around or inside "
        f"them, alone. To let AutoSAC choose instead: {how}."
    )


def solve_or_minimum(profile: ModelProfile, budget_gb: float, *, strict: bool, **solver_args: Any) -> Plan:
    """The plan within ``budget_gb`` (:func:`~lightning_sac.solve_plan`), or the minimum-memory one.

    Below the reachable minimum, ``strict=False`` warns and returns the minimum-memory plan.

    Raises:
        BudgetError: The budget is below the minimum and ``strict`` is set.
    """
    try:
        return solve_plan(profile, budget_gb, **solver_args)
    except BudgetError as err:
        if strict:
            raise
        rank_zero_warn(f"{err} strict=False: applying the minimum-memory plan instead.")
        return solve_plan(profile, err.minimum_bytes * 1.001 / _GIB, **solver_args)


def plan_message(plan: Plan, backend: str, *, report_only: bool = False) -> str:
    """What AutoSAC prints on rank 0 for a plan: the table, and under ``report_only`` that nothing is applied."""
    if not report_only:
        return f"AutoSAC plan ({backend} backend):\n{plan.table()}"
    return (
        f"AutoSAC (report_only=True): the step's peak without a plan is {plan.unconstrained_peak_bytes / _GIB:.3f} "
        f"GiB per device on {plan.device}, budget {plan.budget_bytes / _GIB:.3f} GiB; the plan it would apply "
        f"({backend} backend) is below, and nothing is applied: the model trains unchanged.\n{plan.table()}"
    )
