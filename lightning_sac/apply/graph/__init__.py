"""The graph backend: checkpointing that records the forward's op graph and reruns only what backward needs.

Takes a module and its :class:`~lightning_sac.plan.ModuleDecision`; gives a forward wrapper whose recompute
replays the recorded ops (random ones with their generator state, writes through views included).
"""

from __future__ import annotations

from lightning_sac.apply.graph.backend import (
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
