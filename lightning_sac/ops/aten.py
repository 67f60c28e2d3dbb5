"""Facts about aten operators that the dry run needs: which SAC ignores, which alias, mutate or draw randoms.

These are read off the operator schema and tags, so they hold for any operator, custom ones included. What an
op writes is the exception: a few schemas do not declare every argument the kernel writes
(``native_batch_norm`` updates ``running_mean`` and ``running_var`` in training), and such an op must never run
twice. So :func:`mutated_tensors` also runs the op's decomposition once per call pattern on meta tensors and
records what it really writes (:func:`undeclared_writes`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch._decomp import decomposition_table
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import SAC_IGNORED_OPS

__all__ = [
    "composite_scratch",
    "flat_tensors",
    "is_cached_cast",
    "is_inplace",
    "is_random",
    "is_sac_ignored",
    "is_view_like",
    "may_draw",
    "mutated_tensors",
    "op_name",
    "suggested_format",
    "undeclared_writes",
]

aten = torch.ops.aten


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
    return _is_view_like(func)


# Facts read off an operator's schema and tags, once per operator: the dry run asks for every op it runs.
@functools.cache
def _is_view_like(func: torch._ops.OpOverload) -> bool:
    return bool(func.is_view) or torch.Tag.inplace_view in func.tags


@functools.cache
def _written_arguments(func: torch._ops.OpOverload) -> tuple[tuple[int, str, bool], ...]:
    # (position, name, keyword-only) of each argument a mutable schema declares written, in schema order.
    return tuple(
        (i, arg.name, arg.kwarg_only)
        for i, arg in enumerate(func._schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    )


def _schema_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    """Yield ``(schema argument, value)`` for every argument the call passed."""
    for i, arg in enumerate(func._schema.arguments):
        if not arg.kwarg_only and i < len(args):
            yield arg, args[i]
        elif arg.name in kwargs:
            yield arg, kwargs[arg.name]


def mutated_tensors(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """Return the tensors the op writes to (``self`` of ``add_``, ``out=`` arguments, lists of ``_foreach_*_``).

    Declared writes, and the ones a schema leaves out (:func:`undeclared_writes`).
    """
    if not isinstance(func, torch._ops.OpOverload):
        return []
    written: list[torch.Tensor] = []
    if func._schema.is_mutable:
        # As _schema_args pairs them: by position unless keyword-only, else by name.
        for i, name, kwarg_only in _written_arguments(func):
            if not kwarg_only and i < len(args):
                written.extend(flat_tensors(args[i]))
            elif name in kwargs:
                written.extend(flat_tensors(kwargs[name]))
    elif func in decomposition_table or func in _KNOWN_UNDECLARED:
        written.extend(undeclared_writes(func, args, kwargs))
    return written


# Schemas that do not declare a write, for ops without a decomposition to probe: (op, argument positions written,
# position of the bool argument that must be true for it), as their kernels behave.
_KNOWN_UNDECLARED: dict[Any, tuple[tuple[int, ...], int]] = {aten.miopen_batch_norm.default: ((3, 4), 5)}


class _Writes(TorchDispatchMode):
    """Records the storages that the ops of a decomposition write to, declared or not.

    Undeclared writes count too: ``cudnn_batch_norm`` (CUDA's BatchNorm in float32) decomposes into
    ``native_batch_norm``, whose schema declares no write either; only its own decomposition shows the running
    statistics written.
    """

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.storages.update(id(t.untyped_storage()) for t in mutated_tensors(func, args, kwargs))
        return func(*args, **kwargs)


def _pattern(x: Any) -> Any:
    # What decides which arguments a kernel writes: which are tensors or None, and the flags (training=...).
    if isinstance(x, torch.Tensor):
        return "T"
    if isinstance(x, (list, tuple)):
        return tuple(_pattern(v) for v in x)
    return x if isinstance(x, (bool, type(None))) else type(x).__name__


_PROBED: dict[Any, tuple[int, ...]] = {}


def undeclared_writes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensor arguments ``func`` writes although its schema does not say so (BatchNorm's running statistics).

    Found by running the op's decomposition (``torch._decomp``) on meta copies of the arguments under a mode that
    records declared in-place writes, once per operator and call pattern (which arguments are tensors or
    ``None``, and the boolean flags). Ops without a decomposition are taken from a short list of known ones; a
    decomposition that cannot run on meta tensors is taken at its schema's word.
    """
    # Called for most ops of every dry run and graph region: the key is built without flattening.
    key = (func, tuple(map(_pattern, args)), tuple((k, _pattern(v)) for k, v in kwargs.items()))
    positions = _PROBED.get(key)
    if positions is None:
        flat, spec = tree_flatten((args, kwargs))
        positions = _PROBED[key] = _probe(func, flat, spec)
    if not positions:
        return []
    flat = tree_flatten((args, kwargs))[0]
    return [flat[i] for i in positions]


def _probe(func: Any, flat: list[Any], spec: Any) -> tuple[int, ...]:
    known = _KNOWN_UNDECLARED.get(func)
    if known is not None:
        positions, flag = known
        return positions if len(flat) > flag and flat[flag] is True else ()
    metas = [
        torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device="meta")
        if isinstance(x, torch.Tensor)
        else x
        for x in flat
    ]
    where = {id(m.untyped_storage()): i for i, m in enumerate(metas) if isinstance(m, torch.Tensor)}
    margs, mkwargs = tree_unflatten(metas, spec)
    writes = _Writes()
    try:
        with _disable_current_modes(), writes:
            decomposition_table[func](*margs, **mkwargs)
    except Exception:  # noqa: BLE001 - a decomposition that needs values or real devices: trust the schema
        return ()
    return tuple(sorted(where[s] for s in writes.storages if s in where))


def is_inplace(func: Any) -> bool:
    """Whether the op mutates one of its tensor arguments (views that only change metadata excluded)."""
    if not isinstance(func, torch._ops.OpOverload):
        return False
    return _is_inplace(func)


@functools.cache
def _is_inplace(func: torch._ops.OpOverload) -> bool:
    if torch.Tag.inplace_view in func.tags:
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


def may_draw(func: Any) -> bool:
    """Whether ``func`` can draw from the random number generator in some call (:func:`is_random` says for one)."""
    return _random_kind(func) != "never"


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
        # Called several times for every op of a dry run: a flat list costs no call per item.
        out: list[torch.Tensor] = []
        for item in x:
            if isinstance(item, torch.Tensor):
                out.append(item)
            elif isinstance(item, (tuple, list)):
                out.extend(flat_tensors(item))
        return out
    return []


def is_cached_cast(func: Any, args: tuple[Any, ...], out: Any) -> bool:
    """Whether ``func`` is a cast that autocast's cache keeps until its outermost region exits.

    With the cache on (``torch.autocast``'s default, and accelerate's, unlike Lightning's ``cache_enabled=False``),
    autocast casts each weight once per region and keeps the cast (``cached_cast`` in ``autocast_mode.cpp``: an fp32
    leaf that requires grad, not a view): a plan that recomputes such a cast frees nothing until the region ends, so
    its output must stay saved. An explicit cast of a weight matching the same test is only saved needlessly.
    """
    if func is not aten._to_copy.default or not torch.is_autocast_cache_enabled() or not args:
        return False
    x = args[0]
    low = isinstance(out, torch.Tensor) and out.dtype in (torch.float16, torch.bfloat16)
    weight = isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.requires_grad and x.is_leaf
    return low and weight and not x._is_view()


def composite_scratch(func: Any, args: tuple[Any, ...]) -> list[int]:
    """The allocations an op's own implementation makes and frees inside its call, on every device, bytes each.

    A fake kernel makes an op's outputs only. ``_safe_softmax``, the softmax of SDPA's math kernel (which zeroes
    the rows a mask leaves empty), computes the softmax, then a ``bool`` of ``input == -inf``, that one's ``all``
    over ``dim`` and a zero of the result's dtype, and zeroes those rows of its result: measured on torch 2.13's
    CPU kernel and 2.11's CUDA one (64 MiB beyond its output for an 8 x 8 x 1024 x 1024 input, exactly its
    elements' count in bytes, plus the rows' and the zero's). Where a recompute of attention sets a step's peak,
    that is the peak. ``soft_margin_loss_backward`` holds two temporaries of its input's size beyond its gradient.
    """
    if func is aten.soft_margin_loss_backward.default:
        # exp(-target * input) and two products of the input's size before the gradient: a composite of ATen ops,
        # alike on every device; measured on torch 2.13's CPU kernel (not yet on a GPU).
        x = args[1]
        return [x.numel() * x.element_size()] * 2
    if func is aten._safe_softmax.default and args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0:
        x, dim = args[0], int(args[1])
        dtype = args[2] if len(args) > 2 and isinstance(args[2], torch.dtype) else x.dtype
        return [x.numel(), x.numel() // max(x.shape[dim], 1), torch.empty((), dtype=dtype).element_size()]
    return []


def suggested_format(x: torch.Tensor) -> torch.memory_format:
    """``Tensor::suggest_memory_format``: channels-last where the strides say so, contiguous otherwise.

    The layout ATen's kernels allocate their outputs in (BatchNorm's on every device, cuDNN's input).
    """
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format
