"""Ops whose output shape depends on values the dry run has: the batch's.

Fake tensors refuse an op whose output size depends on the values of its inputs (``DynamicOutputShapeException``):
they have shapes, not values. But the values that decide the size often come from the batch alone, and those are
real in the dry run (:mod:`lightning_sac.dryrun.values.real_values`). ``aten._ctc_loss`` returns ``log_alpha`` of
``(batch, T, 2 * max(target_lengths) + 1)``: its size depends on the target lengths (real, counted from the labels)
and on the shape of ``log_probs`` (fake, computed from the weights), never on the values of ``log_probs``.

:data:`SHAPE_ARGUMENTS` lists, per such op, the arguments whose values decide its output's shape. When those are
real, :func:`run_on_batch_values` runs the op's real kernel on zero-filled real tensors of the fake tensors'
layouts and the real arguments as they are, and returns fake tensors of the real outputs' sizes, strides and
dtypes: the memory is exact, and no value computed from zeros leaves this module. Only when the fake inputs are
small (:data:`~lightning_sac.dryrun.values.real_values.REAL_LIMIT_BYTES`); the real kernel's time is the dry run's cost.

An op that is not listed, or whose deciding values are fake (computed from the weights), gets ``None``, and the
dry run stops with a :class:`~lightning_sac.errors.ProfilingError` that says which of its inputs came from the
weights and which from the batch (:func:`blocking_inputs`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DynamicOutputShapeException,
    FakeTensor,
    UnsupportedOperatorException,
    unset_fake_temporarily,
)
from torch.utils._pytree import tree_flatten, tree_map

from lightning_sac.errors import ProfilingError

__all__ = ["SHAPE_ARGUMENTS", "blocking_inputs", "data_dependent_error", "named_arguments", "run_on_batch_values"]

aten = torch.ops.aten

#: Per op, the arguments (by schema name) whose values decide its output's shape; the others give it by their
#: shapes only. Single-input ops (``nonzero``, ``unique``) are absent: with their input real they run for real.
SHAPE_ARGUMENTS: dict[Any, tuple[str, ...]] = {
    aten._ctc_loss.default: ("target_lengths",),  # int[]: real by nature
    aten._ctc_loss.Tensor: ("target_lengths",),
    aten.masked_select.default: ("mask",),
    aten.bincount.default: ("self",),  # its weights give values, not the length
}


# Indexing whose size a boolean index decides (real_values.py runs it with the indices of a real mask).
_INDEXING = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default)


def named_arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by their schema names (positional ones first, then keywords)."""
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args, strict=False)), **kwargs}


def _zeros_like_layout(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # No random fill: the user's random stream must not move, and zeros are valid lengths, indices and values.
    numel = t.numel()
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) if numel else 0
    base = torch.zeros(extent + int(t.storage_offset()), dtype=t.dtype, device=device)
    return base.as_strided(tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))


@dataclass(frozen=True)
class _Layout:
    """What a real output looked like: the fake one is made with these."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def run_on_batch_values(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    is_real: Callable[[torch.Tensor], bool],
    limit_bytes: int,
) -> Any:
    """The fake outputs of ``func`` with the sizes its real kernel gives on the batch's values, or ``None``.

    Args:
        func: The op fake tensors refused.
        args: Its positional arguments (fake and real tensors).
        kwargs: Its keyword arguments.
        is_real: Whether a tensor holds the real step's values.
        limit_bytes: Largest total size of the fake inputs stood in for by zeros.

    Returns:
        Fake tensors (made by the fake mode below the caller) shaped like the real outputs, in the output's
        structure; ``None`` when the op is not in :data:`SHAPE_ARGUMENTS`, a deciding argument is not real, or the
        fake inputs are too large.
    """
    deciding = SHAPE_ARGUMENTS.get(func)
    if deciding is None:
        return None
    named = named_arguments(func, args, kwargs)
    for name in deciding:
        value = named.get(name)
        if isinstance(value, torch.Tensor) and (isinstance(value, FakeTensor) or not is_real(value)):
            return None
    flat, _ = tree_flatten((args, kwargs))
    fakes = [t for t in flat if isinstance(t, FakeTensor)]
    if not fakes or sum(t.numel() * t.element_size() for t in fakes) > limit_bytes:
        return None
    reals = [t for t in flat if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor)]
    device = reals[0].device if reals else torch.device("cpu")
    fake_device = fakes[0].device

    def stand_in(x: Any) -> Any:
        return _zeros_like_layout(x, device) if isinstance(x, FakeTensor) else x

    with unset_fake_temporarily(), torch.no_grad():
        real_args, real_kwargs = tree_map(stand_in, (args, kwargs))
        out = func(*real_args, **real_kwargs)
        layouts = tree_map(
            lambda t: _Layout(tuple(t.shape), tuple(t.stride()), t.dtype) if isinstance(t, torch.Tensor) else t, out
        )
        del out, real_args, real_kwargs

    def fake_output(x: Any) -> Any:
        if not isinstance(x, _Layout):
            return x
        return torch.empty_strided(x.shape, x.stride, dtype=x.dtype, device=fake_device)

    # Called from a dispatch mode's handler above the fake mode: these factories make fake tensors.
    return tree_map(fake_output, layouts)


def blocking_inputs(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], is_real: Callable[[torch.Tensor], bool]
) -> tuple[list[str], list[str]]:
    """The names of the op's tensor arguments that came from the weights (fake) and from the batch (real)."""
    weights: list[str] = []
    batch: list[str] = []
    try:
        named = named_arguments(func, args, kwargs)
    except AttributeError:  # not an aten overload: no schema to name the arguments by
        named = {f"argument {i}": a for i, a in enumerate(args)}
    for name, value in named.items():
        tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        if not tensors:
            continue
        fake = any(isinstance(t, FakeTensor) or not is_real(t) for t in tensors)
        (weights if fake else batch).append(name)
    return weights, batch


def _listed(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names) if names else "none"


def data_dependent_error(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    err: BaseException,
    is_real: Callable[[torch.Tensor], bool],
    *,
    module: str,
    where: str,
) -> ProfilingError:
    """The error for an op the dry run cannot run: whose values it lacks, the weights' or the batch's, and the fix.

    Args:
        func: The op.
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        err: What fake tensors raised for it.
        is_real: Whether a tensor holds the real step's values.
        module: The innermost running module's fqn.
        where: The model's source line that called it.
    """
    weights, batch = blocking_inputs(func, args, kwargs, is_real)
    deciding = list(SHAPE_ARGUMENTS.get(func, ("indices",) if func in _INDEXING else ()))
    head = f"Module {module or '<root>'!r} calls {func} at {where}"
    tail = (
        " With AutoSAC, example_batch= plans for another batch, candidates= can leave the module out and "
        "strict=False trains without a plan. The model was not changed."
    )
    from_weights = [n for n in deciding if n in weights] if deciding else weights
    if isinstance(err, DynamicOutputShapeException) and deciding and not from_weights:
        what = (
            f", and its output's size depends on the values of {_listed(deciding)}, which come from the batch and "
            f"are real in the dry run; its inputs computed from the weights ({_listed(weights)}) are too large to "
            "stand in for with zeros on this machine. Profile with a smaller example batch of the same lengths, "
            "or register a fake kernel that computes the size (torch.library.register_fake)."
        )
    elif isinstance(err, DynamicOutputShapeException) and not deciding and batch:
        what = (
            f", and its output's size depends on the values of its inputs: {_listed(weights)} computed from the "
            f"weights (the dry run has their shapes only), {_listed(batch)} from the batch (real in the dry run). If "
            "the batch's values decide the size, register a fake kernel for the op that computes it from them "
            "(torch.library.register_fake); if the weights' do, make that code shape-static (e.g. torch.where "
            "instead of x[mask]) or move it out of the training step."
        )
    elif isinstance(err, UnsupportedOperatorException):
        what = (
            ", which fake tensors cannot run (the op has no fake kernel). Register one that computes its outputs' "
            "shapes (torch.library.register_fake)."
        )
    else:
        kind = "size" if isinstance(err, DynamicOutputShapeException) else "result"
        what = (
            f", and its output's {kind} depends on the values of {_listed(from_weights)}, computed from the weights, "
            "which the dry run does not have (it has the batch's values: .item(), .all(), nonzero or a boolean "
            "mask on ids, masks, labels and lengths work). Decide it from the batch, make that code shape-static "
            "(e.g. torch.where instead of x[mask]) or move it out of the training step."
        )
    return ProfilingError(head + what + tail, op=str(func), module=module, source=where)
