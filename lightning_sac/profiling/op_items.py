"""A module's op list (:class:`ModuleOpStats`) as one record per op, and back: for a module that holds the layers.

The op list of a module that runs the repeated layers (the model's root, a decoder's stack) has each layer's ops in
it: :func:`op_items` turns it into records that :func:`~lightning_sac.profiling.extend.extend_list` can extend,
:func:`op_stats_of` builds the list of the model with more layers from them. An op's facts that are sets of indices
(views, random ops, saved ones...) become flags of the op; indices of other ops become numbers (affine in the layer).
"""

from __future__ import annotations

from typing import Any

from lightning_sac.dryrun import ModuleOpStats
from lightning_sac.profiling.extend import Item

__all__ = ["SETS", "op_items", "op_numbers", "op_stats_of"]

#: The fields of ModuleOpStats that are sets of op indices, read as one flag per op.
SETS = (
    "view_like_ops",
    "rand_ops",
    "saved_autograd_ops",
    "packed_ops",
    "mutated_later",
    "stateful_ops",
    "output_ops",
)


def op_items(stats: ModuleOpStats) -> list[Item]:
    """One record per op of ``stats``: its name, flags and counts as what it is, the rest as numbers."""
    sets = [set(getattr(stats, name)) for name in SETS]
    masks = {op: k for k, op in enumerate(stats.mask_ops)}
    workspace = dict(zip(stats.workspace_ops, stats.workspace_bytes, strict=True))
    parts = {i: (n, at) for i, n, at in stats.freed_parts}
    parents = dict(stats.inplace_ops)
    if len(parents) != len(stats.inplace_ops):
        raise ValueError("op_items: an op with two in-place parents")
    makers: dict[int, list[int]] = {}
    for reader, maker in stats.reads_before_overwrite:
        makers.setdefault(reader, []).append(maker)
    items = []
    for i, name in enumerate(stats.func_names):
        mask = masks.get(i)
        sig = (
            name,
            tuple(i in s for s in sets),
            mask is not None,
            i in parents,
            len(stats.op_inputs[i]),
            len(makers.get(i, ())),
            i in workspace,
            i in parts,
        )
        nums = (
            stats.runtimes[i],
            stats.memory[i],
            stats.freed_at[i],
            *stats.op_inputs[i],
            *([parents[i]] if i in parents else []),
            *makers.get(i, ()),
            *([] if mask is None else [stats.mask_bytes[mask], stats.mask_ms[mask]]),
            *([workspace[i]] if i in workspace else []),
            *(parts.get(i, ())),
        )
        items.append(Item(sig, nums))
    return items


def op_numbers(sig: Any) -> int:
    """How many numbers the record of an op with this ``sig`` has (see :func:`op_items`)."""
    _, _, has_mask, has_parent, n_inputs, n_makers, has_workspace, *part = sig
    return 3 + n_inputs + int(has_parent) + n_makers + 2 * int(has_mask) + int(has_workspace) + 2 * int(any(part))


def op_stats_of(items: list[Item], flags: tuple[bool, bool], recompute_stop: int | None) -> ModuleOpStats:
    """The op list of ``items`` (from :func:`op_items`); ``flags``: ``force_store_random, output_saved_inside``."""
    out = ModuleOpStats(force_store_random=flags[0], output_saved_inside=flags[1], recompute_stop=recompute_stop)
    for i, item in enumerate(items):
        sig: tuple[Any, ...] = item.sig  # type: ignore[assignment]
        name, flags, has_mask, has_parent, n_inputs, n_makers, has_workspace, *part = sig
        nums = list(item.nums)
        out.func_names.append(name)
        out.runtimes.append(nums[0])
        out.memory.append(int(nums[1]))
        out.freed_at.append(int(nums[2]))
        k = 3
        out.op_inputs.append([int(x) for x in nums[k : k + n_inputs]])
        k += n_inputs
        if has_parent:
            out.inplace_ops.append((i, int(nums[k])))
            k += 1
        out.reads_before_overwrite += [(i, int(m)) for m in nums[k : k + n_makers]]
        k += n_makers
        if has_mask:
            out.mask_ops.append(i)
            out.mask_bytes.append(int(nums[k]))
            out.mask_ms.append(nums[k + 1])
            k += 2
        if has_workspace:
            out.workspace_ops.append(i)
            out.workspace_bytes.append(int(nums[k]))
            k += 1
        if any(part):
            out.freed_parts.append((i, int(nums[k]), int(nums[k + 1])))
        for name_of_set, flag in zip(SETS, flags, strict=True):
            if flag:
                getattr(out, name_of_set).append(i)
    return out
