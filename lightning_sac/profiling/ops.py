"""Facts about aten operators that the dry run needs: which SAC ignores, which alias, mutate or draw randoms.

These are read off the operator schema and tags, so they hold for any operator, custom ones included.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.checkpoint import SAC_IGNORED_OPS

__all__ = [
    "flat_tensors",
    "is_inplace",
    "is_random",
    "is_sac_ignored",
    "is_view_like",
    "mutated_tensors",
    "op_name",
]


def op_name(func: Any) -> str:
    """Return the overload name of an operator, e.g. ``"aten.mm.default"``."""
    return str(func)


def is_sac_ignored(func: Any) -> bool:
    """Whether ``torch.utils.checkpoint`` skips ``func`` when it asks a SAC policy about each op.

    The dry run must skip the same ops, or op indices would not line up with the policy's at run time.
    """
    return func in SAC_IGNORED_OPS


def is_view_like(func: Any) -> bool:
    """Whether the op's outputs alias its inputs: views and in-place views such as ``transpose_``."""
    if not isinstance(func, torch._ops.OpOverload):
        return False
    return bool(func.is_view) or torch.Tag.inplace_view in func.tags


def _schema_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    """Yield ``(schema argument, value)`` for every argument the call passed."""
    for i, arg in enumerate(func._schema.arguments):
        if not arg.kwarg_only and i < len(args):
            yield arg, args[i]
        elif arg.name in kwargs:
            yield arg, kwargs[arg.name]


def mutated_tensors(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """Return the tensors the op writes to (``self`` of ``add_``, ``out=`` arguments, lists of ``_foreach_*_``)."""
    if not isinstance(func, torch._ops.OpOverload) or not func._schema.is_mutable:
        return []
    written: list[torch.Tensor] = []
    for arg, value in _schema_args(func, args, kwargs):
        if arg.alias_info is not None and arg.alias_info.is_write:
            written.extend(flat_tensors(value))
    return written


def is_inplace(func: Any) -> bool:
    """Whether the op mutates one of its tensor arguments (views that only change metadata excluded)."""
    if not isinstance(func, torch._ops.OpOverload) or torch.Tag.inplace_view in func.tags:
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


@functools.cache
def _random_kind(func: Any) -> str:
    # Per operator, once: "dropout_p" (random when that argument is non-zero), "always" or "never".
    if not isinstance(func, torch._ops.OpOverload):
        return "never"
    if any(a.name == "dropout_p" for a in func._schema.arguments):
        return "dropout_p"
    return "always" if torch.Tag.nondeterministic_seeded in func.tags else "never"


def is_random(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the op draws from the random number generator in this call.

    Attention kernels take a ``dropout_p`` argument and are random only when it is non-zero; other ops are
    random when tagged ``nondeterministic_seeded`` (``native_dropout``, ``rand``, ``bernoulli_``...).
    """
    kind = _random_kind(func)
    if kind != "dropout_p":
        return kind == "always"
    return any(bool(value) for arg, value in _schema_args(func, args, kwargs) if arg.name == "dropout_p")


def flat_tensors(x: Any) -> list[torch.Tensor]:
    """Return the tensors in an op's argument or result (a tensor, or nested tuples and lists of them)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        out: list[torch.Tensor] = []
        for item in x:
            out.extend(flat_tensors(item))
        return out
    return []
