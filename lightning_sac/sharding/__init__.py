"""Sharded training (FSDP2 and FSDP1): the units a model is sharded into, and what they hold on one rank."""

from lightning_sac.sharding.layout import FSDPUnit, ShardedLayout, clean_fqn, is_sharded, sharded_layout

__all__ = ["FSDPUnit", "ShardedLayout", "clean_fqn", "is_sharded", "sharded_layout"]
