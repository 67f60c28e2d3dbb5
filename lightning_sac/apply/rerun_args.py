"""Arguments a checkpoint's recompute gets: the lists and dicts of the first call as they were when it began."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_sac.apply.planned import bound

__all__ = ["Rerunnable", "rerunnable"]


def _copied(x: Any) -> Any:
    """``x`` with every ``list`` and ``dict`` in it, within tuples, lists and dicts, a new one of the same items."""
    kind = type(x)
    if kind is list or kind is tuple:
        return kind(_copied(v) for v in x)
    if kind is dict:
        return {k: _copied(v) for k, v in x.items()}
    return x


def _holds_container(x: Any) -> bool:
    kind = type(x)
    if kind is list or kind is dict:
        return True
    return kind is tuple and any(_holds_container(v) for v in x)


class Rerunnable:
    """``bound(fn, kwargs)`` whose reruns see the lists and dicts of its first call as they were when it began.

    ``torch.utils.checkpoint`` keeps a non-tensor argument as the object itself, and its recompute reads it as it is
    then: torchvision's DenseNet passes each layer the block's list of features and appends the layer's output to
    that list after the call, so the recompute read one more tensor (a shape error in backward, or, where shapes
    matched, silently other values). The first call copies each list and dict (the items themselves, tensors
    included, are not copied) before the module runs on the caller's own; every rerun gets a fresh copy of those
    copies at their places, and the tensors ``checkpoint`` passes (version-checked) everywhere else.
    """

    def __init__(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        self.fn, self.kwargs = fn, kwargs
        self.first: tuple[tuple[Any, ...], dict[str, Any]] | None = None

    def __call__(self, *args: Any) -> Any:
        """The forward's call on the caller's objects, or a rerun on copies of them as they were then."""
        if self.first is None:
            self.first = _copied((args, self.kwargs))
            return self.fn(*args, **self.kwargs)
        first_args, first_kwargs = self.first
        args = tuple(_copied(f) if _holds_container(f) else a for a, f in zip(args, first_args, strict=True))
        return self.fn(*args, **{k: _copied(v) for k, v in first_kwargs.items()})


def rerunnable(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[..., Any]:
    """What to pass ``torch.utils.checkpoint`` for a call: :class:`Rerunnable` when the call holds a list or dict."""
    return Rerunnable(fn, kwargs) if _holds_container((args, kwargs)) else bound(fn, kwargs)
