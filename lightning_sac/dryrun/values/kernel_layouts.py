"""Ops whose fake kernel gives another memory layout than the real kernel: the real one's, for the dry run.

A fake tensor's op gets its output's strides from the op's meta kernel. Where the real kernel lays its output out
otherwise, the model's next ops see other strides than in training, and code that branches on layout takes
another path: ATen's ``linear`` on a contiguous 3-d input is ``view``, ``mm``, ``_unsafe_view``, on another
layout ``t``, ``matmul`` and a copy. A PatchTST with ``norm_type="batchnorm"`` (BatchNorm1d between two
transposes) was profiled with the second path where training runs the first: its plain peak predicted 7% under
the measured, and planned modules met other ops than profiled.

:data:`SUGGESTED_LAYOUT` lists such ops; :func:`real_layout` gives their first output the real kernel's layout.

Tensors of another layout than strided (sparse COO or CSR: a graph network's adjacency, an ``nn.Embedding(...,
sparse=True)``'s gradient) have no storage the dry run can count: :func:`layout_error` says so, where they enter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_sac.errors import ProfilingError
from lightning_sac.ops import suggested_format

__all__ = ["SUGGESTED_LAYOUT", "check_strided", "layout_error", "real_layout"]

aten = torch.ops.aten

#: Ops whose first output the real kernel allocates contiguous in the suggested memory format of one argument (by
#: position), where the meta kernel keeps that argument's strides: BatchNorm's forward and backward
#: (``empty_like(input, input.suggest_memory_format())``; on a ``(N, C, L)`` input transposed from ``(N, L, C)``
#: the real output is contiguous, the fake one transposed).
SUGGESTED_LAYOUT = {aten.native_batch_norm.default: 0, aten.native_batch_norm_backward.default: 1}


def real_layout(func: Any, args: tuple[Any, ...], out: Any) -> Any:
    """``out`` of ``func`` with its first output laid out as the real kernel lays it (a new fake tensor).

    Call under the fake mode (the new tensor is fake). Ops not in :data:`SUGGESTED_LAYOUT`, and outputs that
    already have the real layout, are returned as they are.
    """
    at = SUGGESTED_LAYOUT.get(func)
    if at is None or not isinstance(out, tuple) or not isinstance(out[0], torch.Tensor):
        return out
    first, source = out[0], args[at]
    fmt = suggested_format(source)
    if first.is_contiguous(memory_format=fmt):
        return out
    laid = torch.empty(tuple(first.shape), dtype=first.dtype, device=first.device, memory_format=fmt)
    return (laid, *out[1:])


def layout_error(
    what: str, layout: torch.layout, *, op: str | None = None, module: str | None = None
) -> ProfilingError:
    """The error for a tensor the dry run cannot count: ``what`` (an input, an op's output) has ``layout``."""
    fix = (
        "Pass a graph as an edge index and aggregate with index_add_ or scatter_reduce (or densify the matrix with "
        ".to_dense()); give nn.Embedding sparse=False"
    )
    where = "" if module is None else f" (in module {module or '<root>'!r}, forward or backward)"
    return ProfilingError(
        f"{what}{where} is a tensor of layout {layout}; lightning-sac profiles strided (dense) tensors only, "
        f"whose storage it counts. {fix}. The model was not changed.",
        op=op,
        module=module,
    )


def check_strided(func: Any, outputs: list[torch.Tensor], module: Callable[[], str]) -> None:
    """Raise :func:`layout_error` when an output of ``func`` is not strided (``module()``: the running module)."""
    for t in outputs:
        if t.layout != torch.strided:
            raise layout_error(f"The output of {func}", t.layout, op=str(func), module=module())
