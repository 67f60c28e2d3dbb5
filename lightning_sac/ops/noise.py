"""Dropout noise a recompute can copy back from a ``bool`` mask instead of drawing it again.

On a CPU, ``F.dropout`` (and the math attention's dropout) draws its noise into ``empty_like(x).bernoulli_(1 - p)``:
a floating tensor of zeros and ones, kept for backward at the width of ``x`` (4 bytes an element in fp32).
Drawing it is one of the costliest ops of a transformer block on a CPU (29 of the 100 ms a GPT block of the
benchmark recomputes), and keeping it costs four times what a ``bool`` mask of it does. The profile records, for
each such op, what its mask would take and what copying it back costs, for the planner
(:mod:`lightning_sac.solver.masks`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["MASKABLE_OPS", "is_maskable", "noise_mask"]

aten = torch.ops.aten

#: Random ops whose result holds only 0 and 1 (in the tensor's own floating dtype), written in place.
MASKABLE_OPS: frozenset[Any] = frozenset({aten.bernoulli_.float})


def is_maskable(func: Any, args: tuple[Any, ...]) -> bool:
    """Whether ``func`` fills a floating tensor with zeros and ones in place (its result fits a ``bool`` mask)."""
    return func in MASKABLE_OPS and bool(args) and isinstance(args[0], torch.Tensor) and args[0].is_floating_point()


def noise_mask(
    func: Any,
    args: tuple[Any, ...],
    estimator: Callable[[Any, tuple[Any, ...], dict[str, Any], Any], float],
    round_bytes: Callable[[int], int],
) -> tuple[int, float] | None:
    """``(bytes, ms)`` of keeping the noise ``func`` draws as a ``bool`` mask, or ``None`` when it is not maskable.

    The bytes are the mask's allocation on the target (``round_bytes``); the time is the estimator's for the two
    copies a mask takes: into the mask in forward (``noise.to(torch.bool)``) and back in recompute
    (``noise.copy_(mask)``).
    """
    if not is_maskable(func, args):
        return None
    noise = args[0]
    with _disable_current_modes():  # a layout for the estimator, not an op of the step
        mask = torch.empty(tuple(noise.shape), dtype=torch.bool, device="meta")
    nbytes = round_bytes(noise.numel())
    into = estimator(aten.copy_.default, (mask, noise), {}, mask)
    back = estimator(aten.copy_.default, (noise, mask), {}, noise)
    return nbytes, float(into + back)
