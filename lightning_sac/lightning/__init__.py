"""The Lightning callback :class:`AutoSAC` and everything it does during a fit.

Takes a ``Trainer`` and a ``LightningModule``; gives a fit whose steps run a plan for the budget: planned at fit
start on rank 0, re-planned per batch shape, measured and logged.
"""

from __future__ import annotations

from lightning_sac.lightning.callback import AutoSAC

__all__ = [
    "AutoSAC",
]
