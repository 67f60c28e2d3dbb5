"""The Lightning callback :class:`AutoSAC` and everything it does during a fit.

Takes a ``Trainer`` and a ``LightningModule``; gives a fit whose steps run a plan for the budget: planned at fit
start on rank 0, re-planned per batch shape, measured and logged. The argument checks, the solve and the measured
step's verdict are the integrations' too (:mod:`lightning_sac.integrations`).
"""

from __future__ import annotations

from lightning_sac.lightning.args import check_autosac_args
from lightning_sac.lightning.callback import AutoSAC
from lightning_sac.lightning.fit_measure import (
    measured_verdict,
    started_step_profiler,
    step_state_tensors,
    window_timeline,
)
from lightning_sac.lightning.fit_planning import (
    broadcast_from_rank_zero,
    own_checkpointing_message,
    plan_message,
    solve_or_minimum,
)

__all__ = [
    "AutoSAC",
    "broadcast_from_rank_zero",
    "check_autosac_args",
    "measured_verdict",
    "own_checkpointing_message",
    "plan_message",
    "solve_or_minimum",
    "started_step_profiler",
    "step_state_tensors",
    "window_timeline",
]
