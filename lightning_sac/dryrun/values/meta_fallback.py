"""Ops whose fake (meta) kernel fails where the real kernel runs: a shape rule, the real kernel on zeros, or an error.

A fake tensor's op runs the op's meta kernel, which computes the output's shape, strides and dtype. Some meta
kernels check more than the real kernel does: torch 2.13's ``aten._grouped_mm`` meta accepts only bfloat16,
while the CPU kernel multiplies float32 too, and transformers 5 runs every mixture-of-experts layer through it
on the CPU in float32 by default. The real step trains; the dry run would stop on a torch ``RuntimeError``. So,
when a fake kernel raises, :func:`fake_kernel_fallback` answers the op in this order:

1. **A shape rule** (:data:`SHAPE_RULES`) for an op whose output shape follows from its arguments' shapes alone:
   the output is a new fake tensor of that shape, strides and dtype, as the real kernel allocates it. The values
   of the arguments are not read (``_grouped_mm``'s ``offs`` may be fake).
2. **The real kernel on zeros**, when the op's fake arguments hold at most :data:`ZEROS_LIMIT_BYTES`: each fake
   argument becomes a zero-filled real tensor of its shape, strides and dtype, the real kernel runs, and each new
   output becomes a fake tensor of the shape, strides and dtype it got (an output that is an argument, written in
   place or ``out=``, is that fake argument). Not for random ops (they would move the user's random stream) nor
   views (a new tensor cannot alias the fake argument).
3. Else :class:`MetaKernelError`, which the recorder raises as a :class:`~lightning_sac.errors.ProfilingError`
   naming the op, the module, the source line and what the user can do.

The op then goes through the recorder like any other: its runtime is estimated and its outputs counted from the
fake tensors returned here. torch logs a traceback for every failing meta kernel before it raises
(``failed while attempting to run meta for ...``); :func:`quiet_meta_failures` drops those records during the
dry run, since the failure is answered here or reported as a ``ProfilingError``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
    unset_fake_temporarily,
)
from torch.utils._pytree import tree_map

from lightning_sac.errors import LightningSACError, ProfilingError, user_source_line
from lightning_sac.ops import flat_tensors, is_random, is_view_like

__all__ = [
    "SHAPE_RULES",
    "ZEROS_LIMIT_BYTES",
    "MetaKernelError",
    "fake_kernel_fallback",
    "grouped_mm_flops",
    "meta_kernel_failed",
    "quiet_meta_failures",
]

aten = torch.ops.aten

#: Largest total of fake argument bytes for which the real kernel runs on zeros (fallback 2).
ZEROS_LIMIT_BYTES = 64 * 2**20

_FAKE_TENSOR_LOG = logging.getLogger("torch._subclasses.fake_tensor")
# What the fake mode raises on purpose: values or shapes it does not have, tensors it cannot convert.
_FAKE_MODE_ANSWERS = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedFakeTensorException)


def _grouped_mm_size(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None) -> list[int] | None:
    """The output size of ``_grouped_mm`` (torch's ``_create_grouped_mm_output_tensor``), or ``None`` if invalid."""
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if mat_a.dim() not in (2, 3) or mat_b.dim() not in (2, 3) or ((a2 or b2) and offs is None):
        return None
    if not (a2 and b2) and mat_a.size(-1) != mat_b.size(-2):
        return None
    if a2 and b2:  # the contraction is grouped: one (M, N) product per group
        assert offs is not None
        return [offs.size(0), mat_a.size(0), mat_b.size(1)]
    if a2:  # rows of mat_a grouped, one (K, N) matrix per group
        return [mat_a.size(0), mat_b.size(-1)] if offs is not None and offs.size(0) == mat_b.size(0) else None
    if b2:  # columns of mat_b grouped
        return [mat_a.size(1), mat_b.size(1)] if offs is not None and offs.size(0) == mat_a.size(0) else None
    return [mat_a.size(0), mat_a.size(1), mat_b.size(-1)] if mat_a.size(0) == mat_b.size(0) else None


def _grouped_mm_rule(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """``aten._grouped_mm``'s output as the real kernel allocates it.

    Every row of the output exists whatever the group sizes in ``offs`` are, so the shape does not depend on its
    values (nor, in a mixture of experts, on the routing). A CUDA kernel pads each row to 16 bytes, as torch's meta
    kernel does; the CPU one does not.
    """
    size = _grouped_mm_size(mat_a, mat_b, offs)
    if size is None or bias is not None:
        return None
    dtype = out_dtype or mat_a.dtype
    if mat_a.device.type != "cuda":
        return torch.empty(size, dtype=dtype, device=mat_a.device)
    alignment = 16 // dtype.itemsize
    padded = (size[-1] + alignment - 1) // alignment * alignment
    stride = [size[1] * padded, padded, 1] if len(size) == 3 else [padded, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)


#: Per op, a function of its arguments that returns its output (new fake tensors), or ``None`` when the arguments
#: are not ones the real kernel takes (then the next fallback is tried).
SHAPE_RULES: dict[Any, Callable[..., Any]] = {aten._grouped_mm.default: _grouped_mm_rule}


def grouped_mm_flops(
    mat_a: torch.Tensor, mat_b: torch.Tensor, *args: Any, out_val: torch.Tensor | None = None, **kwargs: Any
) -> int:
    """Floating-point operations of one ``_grouped_mm``: two per multiply-add over every group together.

    Each output element is one dot product of the contraction's length, except for the 2D x 2D form (the weight
    gradient of a grouped matmul), whose groups split the contraction: there the whole contraction is summed once
    per ``(M, N)`` element across the groups.
    """
    if out_val is None:
        return 0
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        return 2 * mat_a.size(0) * mat_a.size(1) * mat_b.size(1)
    return 2 * out_val.numel() * mat_a.size(-1)


class MetaKernelError(ProfilingError):
    """An op whose fake kernel failed and that no fallback answers (module docstring).

    The recorder knows the running module and raises :meth:`in_module`'s error instead; raised outside it (a
    lazy module's warm-up step) this one says the same without the module.

    Attributes:
        reason: Why the fake kernel failed, and why no fallback applies.
    """

    def __init__(self, func: Any, reason: str, *, module: str | None = None, source: str | None = None) -> None:
        self.reason = reason
        source = source or user_source_line()
        where = f"Module {module or '<root>'!r} calls" if module is not None else "The training step calls"
        name = str(func)
        # torch.library names an aten op "aten::name" (its overload after a dot is not part of the name).
        qualified = "::".join(name.split(".")[:2]) if name.count(".") >= 1 else name
        super().__init__(
            f"{where} {func} at {source}, which the dry run cannot run on fake tensors: {reason}. Register a fake "
            f'kernel for it with torch.library.register_fake("{qualified}") (a function of the arguments that '
            "returns empty tensors of the output's shape, strides and dtype: the dry run counts their bytes), "
            "then profile again; or, with AutoSAC, strict=False trains without a plan. The model was not changed.",
            op=name,
            module=module,
            source=source,
        )
        self.func = func

    def in_module(self, module: str) -> ProfilingError:
        """The same error naming ``module`` (the innermost running module, ``""`` for the root)."""
        return MetaKernelError(self.func, self.reason, module=module, source=self.source)


def _fake_bytes(args: Any) -> int:
    return sum(t.numel() * t.element_size() for t in flat_tensors(list(args)) if isinstance(t, FakeTensor))


def _zeros_like_fake(x: Any) -> Any:
    if not isinstance(x, FakeTensor):
        return x
    with unset_fake_temporarily():
        extent = 1 + sum((n - 1) * s for n, s in zip(x.shape, x.stride(), strict=True)) if x.numel() else 0
        base = torch.zeros(extent + x.storage_offset(), dtype=x.dtype, device=x.device)
        return base.as_strided(tuple(x.shape), tuple(x.stride()), x.storage_offset())


def _on_zeros(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run the real kernel on zero-filled copies of the fake arguments; give its outputs back as fake tensors."""
    real_args, real_kwargs = tree_map(_zeros_like_fake, (args, kwargs))
    reals = flat_tensors(list(real_args) + list(real_kwargs.values()))
    fakes = dict(zip(map(id, reals), flat_tensors(list(args) + list(kwargs.values())), strict=True))
    with unset_fake_temporarily():
        out = func(*real_args, **real_kwargs)

    def back(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) in fakes:  # written in place or out=: the fake argument is the output
            return fakes[id(t)]
        # A new fake tensor (made under the fake mode this is called in) with the layout the kernel chose.
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=t.device)

    return tree_map(back, out)


def _first_line(err: BaseException) -> str:
    """``Type: first line of the message`` without its closing period (the error's text goes inside a sentence)."""
    text = str(err).strip().splitlines()[0].rstrip(".") if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def meta_kernel_failed(func: Any, err: BaseException) -> bool:
    """Whether ``err``, raised by ``func`` on fake tensors, is its fake kernel refusing what the real one may run.

    Not the fake mode's own answers (a value it does not have, a dynamic output shape: the dry run handles those
    elsewhere and its errors name them), except that a custom op without a fake kernel (``UnsupportedOperator``
    outside ``aten``) is one. Not our own errors either.
    """
    if isinstance(err, UnsupportedOperatorException):
        return getattr(func, "namespace", "aten") != "aten"
    return isinstance(err, Exception) and not isinstance(err, (_FAKE_MODE_ANSWERS, LightningSACError))


def fake_kernel_fallback(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], err: BaseException) -> Any:
    """Answer ``func``, whose fake kernel raised ``err``, as the module docstring says; call it under the fake mode.

    Raises:
        MetaKernelError: No fallback applies, or the real kernel fails on these arguments too.
    """
    rule = SHAPE_RULES.get(func)
    if rule is not None:
        out = rule(*args, **kwargs)
        if out is not None:
            return out
    cause = _first_line(err)
    if is_random(func, args, kwargs) or is_view_like(func):
        kind = "draws random numbers" if is_random(func, args, kwargs) else "is a view"
        raise MetaKernelError(func, f"its fake kernel raised {cause}, and it {kind}, so it is not run for real")
    size = _fake_bytes(list(args) + list(kwargs.values()))
    if size > ZEROS_LIMIT_BYTES:
        raise MetaKernelError(
            func,
            f"its fake kernel raised {cause}, and its arguments hold {size / 2**20:.0f} MiB, more than the "
            f"{ZEROS_LIMIT_BYTES // 2**20} MiB the dry run runs a real kernel on",
        )
    try:
        return _on_zeros(func, args, kwargs)
    except Exception as real_err:
        raise MetaKernelError(
            func,
            f"its fake kernel raised {cause}, and the real kernel on zero-filled tensors of the same shapes raised "
            f"{_first_line(real_err)}",
        ) from real_err


class _DropMetaTracebacks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")


@contextmanager
def quiet_meta_failures() -> Iterator[None]:
    """Drop torch's log of a failing meta kernel (a traceback at ERROR level) while the dry run answers it."""
    drop = _DropMetaTracebacks()
    _FAKE_TENSOR_LOG.addFilter(drop)
    try:
        yield
    finally:
        _FAKE_TENSOR_LOG.removeFilter(drop)
