"""Keep FSDP's and tensor parallelism's own ops out of a planned module's op count when the module contains them.

A plan decides op by op, by the op's index in the module's call as profiled, and the profile is of the unsharded
model (:mod:`lightning_sac.sharding.unsharded`), without FSDP. A planned module that contains FSDP units runs
their hooks inside its checkpoint: the forward's all-gather copy-in and copy-out, casts of inputs under mixed
precision, and in the recompute other ones again (FSDP does not gather for a recompute, but casts). Counted,
they would shift every later op's index and the plan would not hold. So each contained unit's FSDP hooks (FSDP2)
or its wrapper's work around the wrapped module (FSDP1) run between an enter and an exit hook, and ops between
them are not the module's compute: :func:`~lightning_sac.sharding.in_parallel_hook` tells the policy so. A
tensor-parallel style's hooks on a contained module (``DTensor.from_local``'s view in, the row-parallel output's
all-reduce and the view back out) are bracketed alike: the profile's per-rank copy runs stand-ins for them in the
same brackets (:mod:`lightning_sac.sharding.tensor_parallel`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_sac.sharding import enter_parallel_hook, exit_parallel_hook, is_fsdp_hook, is_tp_hook

__all__ = ["bracket_fsdp_units"]


def _place(hooks: OrderedDict[int, Any], key: int, after: int | None) -> None:
    """Move hook ``key`` to just after hook ``after`` (to the front when ``after`` is None)."""
    value = hooks.pop(key)
    items = list(hooks.items())
    at = 0 if after is None else next(i for i, (k, _) in enumerate(items) if k == after) + 1
    items.insert(at, (key, value))
    hooks.clear()
    hooks.update(items)


def _around(
    module: nn.Module, table: str, register: Callable[..., RemovableHandle], which: Callable[[object], bool]
) -> list[RemovableHandle]:
    """Enter before and exit after each hook ``which`` picks in ``module``'s hook table ``table``."""
    hooks: OrderedDict[int, Any] = getattr(module, table)
    handles: list[RemovableHandle] = []
    for key in [k for k, h in hooks.items() if which(h)]:
        enter, leave = register(enter_parallel_hook), register(exit_parallel_hook)
        keys = list(hooks)
        before = keys[keys.index(key) - 1] if keys.index(key) > 0 else None
        _place(hooks, enter.id, before)
        _place(hooks, leave.id, key)
        handles += [enter, leave]
    return handles


def bracket_fsdp_units(module: nn.Module) -> list[RemovableHandle]:
    """Bracket the FSDP work of every FSDP unit strictly inside ``module``; the handles remove the brackets."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    handles: list[RemovableHandle] = []
    for sub in module.modules():
        if sub is module:
            continue
        # A tensor-parallel style's hooks wrap the inputs as DTensor and redistribute the output (all-reduce).
        handles += _around(sub, "_forward_pre_hooks", sub.register_forward_pre_hook, is_tp_hook)
        handles += _around(sub, "_forward_hooks", sub.register_forward_hook, is_tp_hook)
        if isinstance(sub, FSDPModule):
            handles += _around(sub, "_forward_pre_hooks", sub.register_forward_pre_hook, is_fsdp_hook)
            handles += _around(sub, "_forward_hooks", sub.register_forward_hook, is_fsdp_hook)
        elif isinstance(sub, FullyShardedDataParallel):
            # FSDP1 gathers inside the wrapper's forward, before and after calling the module it wraps.
            inner = sub._fsdp_wrapped_module
            handles += [
                sub.register_forward_pre_hook(enter_parallel_hook, prepend=True),
                inner.register_forward_pre_hook(exit_parallel_hook, prepend=True),
                inner.register_forward_hook(enter_parallel_hook),
                sub.register_forward_hook(exit_parallel_hook),
            ]
    return handles
