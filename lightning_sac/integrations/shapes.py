"""Batches larger than the plan was made for, in a loop that does not re-plan: said once, not run silently.

``AutoSAC`` plans again for a batch outside the applied plan's shapes; the Hugging Face Trainer's callback cannot
(the Trainer hands callbacks no batch, and a dynamic-padding collator makes every batch's length its own), so a
forward pre-hook compares what the model receives with the planned batch's shapes and warns once when a tensor is
larger: the budget holds for the shapes planned for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["ShapeWatch", "planned_shapes"]


def planned_shapes(batch: Any) -> dict[str, list[int]]:
    """The shape of each tensor of a dict batch, by key (empty for another batch)."""
    if not isinstance(batch, dict):
        return {}
    return {str(k): list(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}


class ShapeWatch:
    """Watches the model's keyword inputs for tensors larger than planned; ``warn`` is called once with the message.

    Args:
        shapes: :func:`planned_shapes` of the batch the plan was made for.
        warn: Called with the message, once.
    """

    def __init__(self, shapes: dict[str, list[int]], warn: Callable[[str], None]) -> None:
        self.shapes = shapes
        self.warn = warn
        self.warned = False
        self._handle: RemovableHandle | None = None

    def attach(self, model: nn.Module) -> None:
        """Watch ``model``'s calls."""
        if self.shapes:
            self._handle = model.register_forward_pre_hook(self._check, with_kwargs=True)

    def detach(self) -> None:
        """Stop watching."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _check(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.warned or not torch.is_grad_enabled():
            return
        for key, planned in self.shapes.items():
            t = kwargs.get(key)
            if not isinstance(t, torch.Tensor) or t.dim() != len(planned):
                continue
            if any(a > b for a, b in zip(t.shape, planned, strict=True)):
                self.warned = True
                self.warn(
                    f"AutoSACCallback: a batch's {key} is {list(t.shape)}, larger than the {planned} the plan was made "
                    "for; the plan still runs, but its budget holds for the planned shapes only. Pad every batch to "
                    "the largest length (e.g. the tokenizer's padding='max_length') or pass example_batch with the "
                    "largest shapes. (Warned once.)"
                )
                return
