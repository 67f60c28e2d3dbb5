"""AutoSAC's plan for loops outside Lightning's Trainer: the Hugging Face ``Trainer`` and Lightning Fabric.

Takes a loop's model, optimizer, batch and loss; gives the same dry run, plan and apply as the callback, planned on
rank 0 and handed to every rank: ``integrations.hf.AutoSACCallback``, ``integrations.fabric.plan_and_apply``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_sac.integrations.fabric import plan_and_apply
    from lightning_sac.integrations.hf import AutoSACCallback

__all__ = ["AutoSACCallback", "plan_and_apply"]

# Each is imported on first use: the Fabric function never loads transformers (an optional extra).
_SOURCES = {"AutoSACCallback": "lightning_sac.integrations.hf", "plan_and_apply": "lightning_sac.integrations.fabric"}


def __getattr__(name: str) -> Any:
    if name not in _SOURCES:
        raise AttributeError(f"module 'lightning_sac.integrations' has no attribute {name!r}")
    return getattr(importlib.import_module(_SOURCES[name]), name)
