"""Planning with dropout noise kept as ``bool`` masks: a third way for a module's random ops besides save and redraw.

A SAC policy keeps a module's random ops all saved or all recomputed (a recompute replays the generator from the
checkpoint's start, so it must draw exactly the forward's draws). Saved, the noise of a CPU dropout is a
floating tensor of zeros and ones (:mod:`lightning_sac.ops.noise`); recomputed, it is drawn again, a costly
op. The SAC backend can instead keep each noise as a ``bool`` mask and, in recompute, rerun the ops around the
draw and copy the mask back in its place (:mod:`lightning_sac.apply.skip_dead`): a quarter of the bytes (in fp32)
for the time of a copy. As no random op then draws in recompute, all of them must be masked together.

The planner sees this through a *view* of the module's op stats (:func:`masked_view`) in which "saving" the random
unit means masking it: its bytes are the masks', its cost the draws less the copies, and what a masked unit still
reruns (the ops that allocate and scale the noise, and the copies) is a fixed cost of wrapping the module
(:func:`mask_fixed_ms`). A policy found on the view becomes the one the backend runs with :func:`realize`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lightning_sac.dryrun import ModuleOpStats
from lightning_sac.solver.recompute import recompute_costs
from lightning_sac.solver.tradeoff import recompute_units

__all__ = ["MaskUnit", "mask_fixed_ms", "mask_unit", "masked_view", "realize"]


@dataclass(frozen=True)
class MaskUnit:
    """A module's random ops when all of them can be kept as masks.

    Attributes:
        ops: Every op of the unit a policy saves or recomputes with the random ops (see
            :func:`~lightning_sac.solver.tradeoff.recompute_units`): the draws, the ops that made their tensors, and the
            in-place ops on those.
        draws: The random ops, by index.
        makers: Per draw, the op that made the tensor it fills.
        rerun_ms: What a masked unit still reruns besides the draws, ms: the makers and the in-place ops on
            their tensors, and the copies back.
    """

    ops: tuple[int, ...]
    draws: tuple[int, ...]
    makers: tuple[int, ...]
    rerun_ms: float


def mask_unit(stats: ModuleOpStats, backend: str = "sac") -> MaskUnit | None:
    """The module's random ops as a :class:`MaskUnit`, or ``None`` when they cannot all be masked.

    They can when the backend is SAC, every random op fills a tensor another op of the module made with 0 and 1
    (:attr:`ModuleOpStats.mask_ops`) before the recompute's early stop, their unit holds nothing but those ops,
    the makers and in-place ops on the makers' tensors, and the copies cost less than the draws.
    """
    draws = tuple(stats.rand_ops)
    if backend != "sac" or not draws or stats.recompute_stop is None or set(draws) - set(stats.mask_ops):
        return None
    if max(draws) >= stats.recompute_stop:
        return None
    parents = dict(stats.inplace_ops)
    makers = tuple(parents.get(i, i) for i in draws)
    if any(m == d for m, d in zip(makers, draws, strict=True)):
        return None  # it fills a tensor from outside the module: the mask could not stand for the maker's output
    candidates, stored = recompute_units(stats, backend)
    unit = next(u.ops for u in [*candidates, *stored] if draws[0] in u.ops)
    allowed = set(draws) | set(makers) | {i for i, p in stats.inplace_ops if p in makers}
    if not set(draws) <= set(unit) or set(unit) - allowed:
        return None
    copies = dict(zip(stats.mask_ops, stats.mask_ms, strict=True))
    costs = recompute_costs(stats, backend)
    copy_ms = sum(copies[d] for d in draws)
    if copy_ms >= sum(costs[d] for d in draws):
        return None  # copying back would cost more than drawing again (a GPU target's roofline)
    rerun = sum(costs[i] for i in unit if i not in draws) + copy_ms
    return MaskUnit(ops=tuple(unit), draws=draws, makers=makers, rerun_ms=rerun)


def masked_view(stats: ModuleOpStats, backend: str = "sac") -> ModuleOpStats:
    """The op stats a planner weighs when saving the random unit means masking it (``stats`` when it cannot).

    Each maker holds its mask's bytes instead of the noise's; each draw costs what it costs less its copy; the
    makers and the in-place ops on their tensors cost nothing (a masked unit reruns them too: see
    :func:`mask_fixed_ms`).
    """
    unit = mask_unit(stats, backend)
    if unit is None:
        return stats
    memory = list(stats.memory)
    runtimes = list(stats.runtimes)
    copies = dict(zip(stats.mask_ops, stats.mask_ms, strict=True))
    sizes = dict(zip(stats.mask_ops, stats.mask_bytes, strict=True))
    for i in unit.ops:
        runtimes[i] = 0.0
    for draw, maker in zip(unit.draws, unit.makers, strict=True):
        memory[maker] = sizes[draw]
        runtimes[draw] = stats.runtimes[draw] - copies[draw]
    return dataclasses.replace(stats, memory=memory, runtimes=runtimes)


def mask_fixed_ms(stats: ModuleOpStats, backend: str = "sac") -> float:
    """What wrapping the module costs on :func:`masked_view` besides its curve, ms: :attr:`MaskUnit.rerun_ms`.

    The view's costs leave it out of both of the random unit's states; the real recompute pays it in both (a
    masked unit reruns it, a redrawn one includes it), so the view's cost plus this is the real one either way.
    """
    unit = mask_unit(stats, backend)
    return 0.0 if unit is None else unit.rerun_ms


def realize(stats: ModuleOpStats, policy: list[int], backend: str = "sac") -> tuple[list[int], list[int]]:
    """``(op_policy, masked_ops)`` the backend runs for a ``policy`` found on :func:`masked_view`.

    When the policy saves the random unit, its ops are recomputed and its draws masked; otherwise it is as is.
    """
    unit = mask_unit(stats, backend)
    if unit is None or not policy[unit.draws[0]]:
        return list(policy), []
    real = list(policy)
    for i in unit.ops:
        real[i] = 0
    return real, list(unit.draws)
