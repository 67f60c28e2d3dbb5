"""FSDP2 units declared rather than read: the layout ``fully_shard`` would give a model, without sharding it.

The command line plans a model that is not sharded (no process group exists there): ``--fsdp N --fsdp-units
PATTERN`` names the modules the training script passes to ``fully_shard`` (each matching module, innermost first,
then the root), and :func:`declared_layout` gives the units FSDP2 would make of them over ``N`` ranks, byte for byte
as :func:`~lightning_sac.sharding.sharded_layout` reads them from a sharded model (``tests/test_declared_units.py``
compares the two on a model sharded over torch's fake process group):

- a unit manages the parameters of its module that no unit inside it manages (a parameter shared by two modules,
  once, by the first unit that reaches it);
- each parameter is sharded on dim 0, padded to a multiple of the world size: its shard is ``ceil(d0 / N)`` rows;
  FSDP's all-gather fills a flat buffer of every rank's padded shard, then copies out the unpadded parameters (on
  one rank there is no all-gather: the shards are copied into the parameters);
- parameters are gathered in ``param_dtype`` (their own dtype when ``None``) and gradients reduced in
  ``reduce_dtype`` (``param_dtype`` when ``None``); shards and sharded gradients keep the parameters' dtype;
- a unit reshards after forward, except a root (a unit inside no other unit), which ``fully_shard``'s default keeps
  gathered to backward.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence

import torch
from torch import nn

from lightning_sac.sharding.layout import FSDPUnit, ShardedLayout, inside_a_unit

__all__ = ["declared_layout", "declared_units"]


def _names(fqn: str, module: nn.Module, pattern: str) -> bool:
    # A glob's "*" stands for one part of a name ("model.layers.*" is each layer, not every module inside one), as
    # a training script's loop over its layers shards them.
    if pattern == type(module).__name__:
        return True
    return fqn.count(".") == pattern.count(".") and fnmatch.fnmatchcase(fqn, pattern)


def declared_units(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """The fqns of the modules ``patterns`` name, in module order; never the root.

    A pattern is a class name (``LlamaDecoderLayer``) or an fqn glob whose ``*`` stands for one part of a name
    (``model.layers.*``: each layer).

    Raises:
        ValueError: A pattern names no module of ``model``.
    """
    named = [(fqn, m) for fqn, m in model.named_modules() if fqn]
    unmatched = [p for p in patterns if not any(_names(f, m, p) for f, m in named)]
    if unmatched:
        raise ValueError(
            f"FSDP unit pattern(s) {', '.join(map(repr, unmatched))} name no module of the model: give module names "
            f"with * for any part (e.g. 'model.layers.*') or a class name (e.g. '{type(named[-1][1]).__name__}')"
            if named
            else "The model has no submodule to make an FSDP unit of."
        )
    return [f for f, m in named if any(_names(f, m, p) for p in patterns)]


def _shard_rows(rows: int, world_size: int) -> int:
    return math.ceil(rows / world_size)


def declared_layout(
    model: nn.Module,
    patterns: Sequence[str],
    world_size: int,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> ShardedLayout:
    """The FSDP2 layout of ``model`` with ``fully_shard`` applied to each module ``patterns`` name, then the root.

    Args:
        model: The model, unsharded (on any device, the meta device included).
        patterns: fqn globs or class names of the units below the root.
        world_size: Ranks the units are sharded over.
        param_dtype: ``MixedPrecisionPolicy.param_dtype``.
        reduce_dtype: ``MixedPrecisionPolicy.reduce_dtype``.

    Raises:
        ValueError: A pattern names no module, or ``world_size`` is below 1.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}.")
    inner = declared_units(model, patterns)
    modules = dict(model.named_modules())
    owner: dict[int, str] = {}
    # Innermost first (fully_shard's order): a unit manages what no unit inside it already does.
    for fqn in sorted(inner, key=lambda f: -f.count(".")) + [""]:
        for p in modules[fqn].parameters():
            owner.setdefault(id(p), fqn)
    params = {id(p): p for p in model.parameters()}
    units: list[FSDPUnit] = []
    for fqn in [""] + [f for f in modules if f in inner]:  # module pre-order, as read from a sharded model
        own = [params[i] for i, f in owner.items() if f == fqn]
        if not own:
            continue  # FSDP makes no parameter group of a module left without parameters
        compute = [param_dtype or p.dtype for p in own]
        reduce = [reduce_dtype or d for d in compute]
        shard_numel = [_shard_rows(p.shape[0] if p.dim() else 1, world_size) * math.prod(p.shape[1:]) for p in own]
        trainable = [i for i, p in enumerate(own) if p.requires_grad]
        # A unit inside no unit before it is a root of its forward: fully_shard's default keeps its parameters
        # gathered from forward to backward.
        is_root = not inside_a_unit(fqn, units)
        units.append(
            FSDPUnit(
                fqn=fqn,
                shard_bytes=sum(n * p.element_size() for n, p in zip(shard_numel, own, strict=True)),
                gathered_bytes=sum(p.numel() * d.itemsize for p, d in zip(own, compute, strict=True)),
                buffer_bytes=sum(n * world_size * d.itemsize for n, d in zip(shard_numel, compute, strict=True))
                if world_size > 1
                else 0,  # one rank: FSDP2 copies the shards into the parameters, with no all-gather buffer
                grad_bytes=sum(own[i].numel() * reduce[i].itemsize for i in trainable),
                compute_grad_bytes=sum(own[i].numel() * compute[i].itemsize for i in trainable),
                grad_shard_bytes=sum(shard_numel[i] * own[i].element_size() for i in trainable),
                param_bytes=sum(p.numel() * p.element_size() for p in own),
                trainable=bool(trainable),
                reshard_after_forward=not is_root,
            )
        )
    return ShardedLayout("fsdp2", world_size, units)
