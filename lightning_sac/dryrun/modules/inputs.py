"""What a module's recorded call took, kept as metadata: the inputs calibration rebuilds on real tensors.

The dry run records each module's arguments as :class:`TensorSpec` entries (shapes, strides, dtypes), never the fake
tensors themselves; :mod:`lightning_sac.profiling.calibrate` turns them back into real tensors to time the module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

from lightning_sac.dryrun.runtime import real_tensor

__all__ = ["Opaque", "TensorSpec", "input_spec", "materialize"]


@dataclass(frozen=True)
class TensorSpec:
    """What it takes to build a real tensor like a profiled (fake) one."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    requires_grad: bool

    def materialize(self) -> torch.Tensor:
        """A real CPU tensor of this layout with valid synthetic values (see ``runtime.real_tensor``)."""
        t = real_tensor(self.shape, self.stride, self.offset, self.dtype)
        # detach: a leaf of the same layout, so that its .grad can be reset between runs
        return t.detach().requires_grad_() if self.requires_grad else t


@dataclass(frozen=True)
class Opaque:
    """An argument that is neither a tensor nor a plain value (a KV cache, a config object): only its type."""

    type_name: str


_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.memory_format, slice)


def input_spec(value: Any) -> Any:
    """``value`` (a module's ``(args, kwargs)``) with every tensor replaced by its :class:`TensorSpec`.

    Only metadata is kept: holding the fake tensors themselves would keep them alive in the memory profile, and so
    would holding an object that references tensors (a KV cache), which becomes an :class:`Opaque`.
    """

    def spec(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return TensorSpec(tuple(x.shape), tuple(x.stride()), int(x.storage_offset()), x.dtype, x.requires_grad)
        return x if isinstance(x, _PLAIN) else Opaque(type(x).__name__)

    return tree_map(spec, value)


def materialize(spec: Any) -> Any:
    """Real tensors for every :class:`TensorSpec` in ``spec``.

    Raises:
        ValueError: An argument is :class:`Opaque`.
    """

    def real(x: Any) -> Any:
        if isinstance(x, Opaque):
            raise ValueError(f"it takes a {x.type_name} argument, which synthetic inputs cannot stand in for")
        return x.materialize() if isinstance(x, TensorSpec) else x

    return tree_map(real, spec)
