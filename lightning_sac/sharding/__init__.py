"""Sharded training (FSDP2 and FSDP1): the units a model is sharded into, and a sharded model seen unsharded.

Takes a model wrapped by FSDP (or not); gives its units and the unsharded view the dry run profiles and a plan's
fingerprint names. What each rank then holds is the solver's (:mod:`lightning_sac.solver.sharded_memory`).
"""

from __future__ import annotations

from lightning_sac.sharding.declared import declared_layout, declared_units
from lightning_sac.sharding.layout import (
    FSDPUnit,
    ShardedLayout,
    clean_fqn,
    inside_a_unit,
    is_fsdp_hook,
    is_sharded,
    sharded_layout,
    unsharded_structure,
)
from lightning_sac.sharding.unsharded import unsharded_memo

__all__ = [
    "FSDPUnit",
    "ShardedLayout",
    "clean_fqn",
    "declared_layout",
    "declared_units",
    "inside_a_unit",
    "is_fsdp_hook",
    "is_sharded",
    "sharded_layout",
    "unsharded_memo",
    "unsharded_structure",
]
