"""Skipping, in a SAC recompute, the ops whose values nothing needs (``solver.recompute.skipped_ops``).

``torch.utils.checkpoint`` reruns a module's forward in order up to its early stop, every op of it, even one
whose output only gives another op its shape: on a CPU, ``F.dropout`` draws its noise into
``empty_like(x)``, so the recompute of a GPT MLP reruns its last matrix product (a quarter of the block's
matmul work) for nothing but the noise's size. :class:`SkipDeadOps` is a dispatch mode entered for the
recompute only, beneath SAC's own when there is one: it sees the ops the recompute really runs, in order, and
answers each op the plan names as skipped with a new tensor of the layout the op's meta kernel gives, filled
with NaN so that a wrongly skipped op could not pass unnoticed. The allocation is the same as the op's own, so
the memory model is unchanged.

The mode counts ops as the profiler did and checks each one's name against the profile; from the first op
that differs (another code path) it skips nothing more in that recompute.

It also puts back the dropout noise a plan keeps as ``bool`` masks (:mod:`lightning_sac.solver.masks`): each
draw the recompute reruns gets the next mask, copied into the tensor it would have filled, in place of drawing.
The forward masked all of the module's draws, so the recompute draws nothing; a draw that finds no mask of its
shape would get other numbers than the forward's, and raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_map_only

from lightning_sac.ops import MASKABLE_OPS, flat_tensors, is_random, is_sac_ignored, op_name
from lightning_sac.sharding import in_parallel_hook

__all__ = ["SkipDeadOps", "placeholder"]


def placeholder(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """A NaN-filled tensor with the layout ``func``'s output would have, or ``None`` when it has none to give.

    ``None`` when the op has no single tensor output, or takes a tensor subclass such as ``DTensor``.
    The layout comes from the op's meta kernel run on meta copies of the arguments: no data is read. Only the
    layout's allocation reaches the modes beneath (a FLOP counter sees no matrix product).
    """
    tensors: list[torch.Tensor] = []
    if any(is_traceable_wrapper_subclass(t) for t in flat_tensors(args) + flat_tensors(list(kwargs.values()))):
        # A DTensor's op (a tensor-parallel linear's): its output is a DTensor of the rank's local shard, which a
        # meta kernel on the global shapes does not give. Such an op runs.
        return None

    def to_meta(t: torch.Tensor) -> torch.Tensor:
        tensors.append(t)
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    meta_args, meta_kwargs = tree_map_only(torch.Tensor, to_meta, (args, kwargs))
    with _disable_current_modes():  # the layout only: modes beneath (a FLOP counter) must not see an op run
        out = func(*meta_args, **meta_kwargs)
    if not isinstance(out, torch.Tensor) or not tensors:
        return None
    made = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=tensors[0].device)
    return made.fill_(float("nan")) if made.is_floating_point() else made.zero_()


class SkipDeadOps(TorchDispatchMode):
    """Answer the recompute's skipped ops with a placeholder instead of running them.

    Args:
        names: The profiled op names of the module, by index.
        order: The profile index of each op this mode will see, in order (under SAC, the ops the forward's
            policy recomputed; under a plain checkpoint, all of them).
        skipped: Profile indices of the ops to skip.
        masks: The forward's masks of its draws, in order (consumed), or ``None`` when nothing was masked.
        where: The module, for messages.
    """

    def __init__(
        self,
        names: Sequence[str],
        order: Sequence[int],
        skipped: Sequence[int],
        masks: list[torch.Tensor] | None = None,
        where: str = "",
    ) -> None:
        super().__init__()
        self.masks = masks
        self.where = where
        self.copied = 0  # masks copied back in this recompute (tests read it)
        self.names = names
        self.order = order
        self.skipped = frozenset(skipped)
        self.seen = 0
        self.diverged = False
        self.skips = 0  # ops skipped in this recompute (tests read it)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.masks is not None and not in_parallel_hook() and is_random(func, args, kwargs):
            self._count(func)
            return self._copy_back(func, args)
        if self.diverged or is_sac_ignored(func) or in_parallel_hook():
            return func(*args, **kwargs)
        k = self._count(func)
        if self.diverged:
            return func(*args, **kwargs)
        if self.order[k] in self.skipped:
            out = placeholder(func, args, kwargs)
            if out is not None:
                self.skips += 1
                return out
        return func(*args, **kwargs)

    def _count(self, func: Any) -> int:
        """Count an op of the recompute; its position, after checking its name against the profile's."""
        k = self.seen
        self.seen += 1
        if not self.diverged and (k >= len(self.order) or op_name(func) != self.names[self.order[k]]):
            self.diverged = True  # another code path: from here on nothing is skipped
        return k

    def _copy_back(self, func: Any, args: tuple[Any, ...]) -> Any:
        """The forward's noise for a draw: the next mask copied into the tensor the draw fills."""
        assert self.masks is not None
        noise = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func not in MASKABLE_OPS or noise is None or not self.masks or self.masks[0].shape != noise.shape:
            got = f"{func} on shape {tuple(noise.shape) if noise is not None else '?'}"
            expected = f"a mask of shape {tuple(self.masks[0].shape)}" if self.masks else "no draw (all masks used)"
            raise RuntimeError(
                f"lightning-sac: the recompute of module {self.where!r} drew random numbers its forward had kept as "
                f"masks, in another order (got {got}, expected {expected}); redrawing would give other numbers than "
                "the forward's, so the gradients would be wrong. The module's code path differs between forward and "
                "recompute (global state read in forward?). Re-plan with solve_plan(..., masks=False) to redraw "
                "instead."
            )
        self.copied += 1
        return noise.copy_(self.masks.pop(0))
