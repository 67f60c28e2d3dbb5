"""Re-exports :mod:`lightning_sac.apply.graph_ac`, where graph-based activation checkpointing now lives."""

from lightning_sac.apply.graph_ac import (
    GraphCheckpointForward,
    PolicyContext,
    PolicyFn,
    compose_policies,
    recompute_count,
    save_recompute_policy,
)

__all__ = [
    "GraphCheckpointForward",
    "PolicyContext",
    "PolicyFn",
    "compose_policies",
    "recompute_count",
    "save_recompute_policy",
]
