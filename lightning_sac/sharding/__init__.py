"""Sharded training (FSDP2, FSDP1, tensor parallelism): the units a model is sharded into, and one rank's model.

Takes a model wrapped by FSDP (or not); gives its units and the unsharded view the dry run profiles and a plan's
fingerprint names. What each rank then holds is the solver's (:mod:`lightning_sac.solver.sharded_memory`).
"""

from __future__ import annotations

from lightning_sac.sharding.brackets import enter_parallel_hook, exit_parallel_hook, in_parallel_hook
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
from lightning_sac.sharding.tensor_parallel import (
    DECLARED_STYLES,
    TensorParallelModule,
    check_tensor_parallel,
    declared_tensor_parallel,
    is_tp_hook,
    tensor_parallel_modules,
    tp_local_shape,
)
from lightning_sac.sharding.unsharded import unsharded_memo

__all__ = [
    "DECLARED_STYLES",
    "FSDPUnit",
    "ShardedLayout",
    "TensorParallelModule",
    "check_tensor_parallel",
    "clean_fqn",
    "declared_layout",
    "declared_tensor_parallel",
    "declared_units",
    "enter_parallel_hook",
    "exit_parallel_hook",
    "in_parallel_hook",
    "inside_a_unit",
    "is_fsdp_hook",
    "is_sharded",
    "is_tp_hook",
    "sharded_layout",
    "tensor_parallel_modules",
    "tp_local_shape",
    "unsharded_memo",
    "unsharded_structure",
]
