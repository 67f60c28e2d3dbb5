"""Copies the CPU makes of pointwise ops' operands whose dtype is not the op's common dtype.

On CPU, ``TensorIterator`` computes a pointwise op in its operands' common dtype by converting every operand of
another dtype first: ``operand.to(common_dtype)``, a full copy that lives for the call (``TensorIteratorBase::
compute_types``, under ``common_device == kCPU``). An in-place or ``out=`` op whose output has another dtype gets
a temporary output of the common dtype too, copied back at the end. CUDA kernels cast while they load, so none of
this happens there. Fake tensors run no kernel, so the dry run adds these copies as the op's workspace.

Mixed precision makes them large: under ``bf16-mixed`` a residual ``x + attn(x)`` adds an fp32 stream to a bf16
branch, and the CPU converts the whole branch to fp32 before adding (torch.profiler shows ``aten::add >
aten::to``). An int mask multiplied into float activations does the same.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from lightning_sac.ops import flat_tensors, mutated_tensors

__all__ = ["common_dtype", "promotion_bytes"]

# Operands a pointwise kernel reads in their own dtype: where's condition, masked_fill's and dropout's masks.
_NOT_PROMOTED = frozenset({"condition", "mask", "out"})


def _operands(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    operands: list[torch.Tensor] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.name in _NOT_PROMOTED:
            continue
        if not arg.kwarg_only and i < len(args):
            operands += flat_tensors(args[i])
        elif arg.name in kwargs:
            operands += flat_tensors(kwargs[arg.name])
    return operands


def common_dtype(operands: list[torch.Tensor], result: torch.Tensor | None) -> torch.dtype | None:
    """The dtype a pointwise op computes in: its operands' promoted dtype, or its float result's for int operands.

    Operands follow PyTorch's promotion (a 0-dim tensor does not widen a dimensioned one of its category); an op
    that makes a float from integers (``sqrt``, true ``div``, ``1.0 - mask``) computes in the result's dtype.
    """
    if not operands:
        return None
    promoted = elementwise_dtypes(*operands, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)[1]
    if result is not None and result.dtype.is_floating_point and not promoted.is_floating_point:
        return result.dtype
    return promoted


def promotion_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """Bytes of the converted copies a CPU pointwise op holds during its call (0 when its operands agree).

    Args:
        func: The aten op.
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        out: What it returned.
    """
    if not isinstance(func, torch._ops.OpOverload) or torch.Tag.pointwise not in func.tags:
        return 0
    operands = _operands(func, args, kwargs)
    results = flat_tensors(out)
    common = common_dtype(operands, results[0] if results else None)
    if common is None:
        return 0
    size = common.itemsize
    copies = sum(t.numel() * size for t in operands if t.dtype != common)
    # An output written in place (self of add_, out=) of another dtype gets a temporary output of the common one.
    copies += sum(t.numel() * size for t in mutated_tensors(func, args, kwargs) if t.dtype != common)
    return copies
