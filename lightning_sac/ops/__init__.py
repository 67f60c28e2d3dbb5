"""What an aten op is, as the dry run and the appliers see it: its name, views, writes, randomness and noise.

Takes a dispatched op with its arguments; gives the facts both the recorder (dryrun) and a plan's policy (apply)
decide on, so that the two agree on every op.
"""

from __future__ import annotations

from lightning_sac.ops.aten import (
    composite_scratch,
    flat_tensors,
    is_cached_cast,
    is_inplace,
    is_random,
    is_sac_ignored,
    is_view_like,
    may_draw,
    mutated_tensors,
    op_name,
    suggested_format,
    undeclared_writes,
)
from lightning_sac.ops.noise import MASKABLE_OPS, is_maskable, noise_mask

__all__ = [
    "composite_scratch",
    "MASKABLE_OPS",
    "flat_tensors",
    "is_cached_cast",
    "is_inplace",
    "is_maskable",
    "is_random",
    "is_sac_ignored",
    "is_view_like",
    "may_draw",
    "mutated_tensors",
    "noise_mask",
    "op_name",
    "suggested_format",
    "undeclared_writes",
]
