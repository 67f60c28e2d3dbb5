"""When a module's backward begins and ends, told by the gradients of the tensors it returned and took.

Backward runs forward in reverse: a module's backward begins when the gradient of a tensor it returned arrives,
and it is over once autograd has the gradients of all its inputs (or, when no input needs one, of its
parameters). Hooks on those tensors signal both, in an order that stays meaningful when several modules share a
tensor (an identity module returns its input).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["BackwardSignals"]


@dataclass
class _GradEvents:
    produced_by: list[str] = field(default_factory=list)  # modules that returned the tensor
    # (fqn, countdown) of the modules it was an input to
    consumed_by: list[tuple[str, Callable[[], None]]] = field(default_factory=list)


class BackwardSignals:
    """Calls ``begin(fqn)`` when a module's backward begins; :meth:`when_all_grads` calls back when one ends.

    Args:
        begin: Called with the module's fqn when its backward begins.
        handles: Where the tensor hooks' handles go, to be removed with the recorder's.
    """

    def __init__(self, begin: Callable[[str], None], handles: list[RemovableHandle]) -> None:
        self.begin = begin
        self.handles = handles
        self._events: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def produced(self, fqn: str, t: torch.Tensor) -> None:
        """Module ``fqn`` returned ``t`` (which requires grad)."""
        self._grad_events(t).produced_by.append(fqn)

    def when_all_grads(self, fqn: str, tensors: list[torch.Tensor], fn: Callable[[], None]) -> None:
        """Call ``fn`` once the gradient of every tensor of ``tensors`` has arrived (module ``fqn``'s end)."""
        # torch.autograd.graph.register_multi_grad_hook would do, but it keeps every gradient alive until the
        # last one arrives, which shifts the very memory the recorder measures. A countdown keeps none.
        unique = list({id(t): t for t in tensors}.values())
        remaining = [len(unique)]

        def tick() -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                fn()

        for t in unique:
            self._grad_events(t).consumed_by.append((fqn, tick))

    def _grad_events(self, t: torch.Tensor) -> _GradEvents:
        # One hook per tensor, so that when several modules share a tensor their events run in a meaningful
        # order rather than in hook registration order.
        events = self._events.get(t)
        if events is None:
            events = _GradEvents()
            self._events[t] = events
            self.handles.append(t.register_hook(functools.partial(self._on_grad_ready, events)))
        return events

    def _on_grad_ready(self, events: _GradEvents, _grad: torch.Tensor) -> None:
        # The module that finished its forward last begins first, and the module that took this tensor as input
        # last ends first. A module that both returned and took this tensor (an identity) begins before it ends;
        # every other producer begins once the consumers ended.
        consumers = [fqn for fqn, _ in events.consumed_by]
        for fqn in reversed(events.produced_by):
            if fqn in consumers:
                self.begin(fqn)
        for _, tick in reversed(events.consumed_by):
            tick()
        for fqn in reversed(events.produced_by):
            self.begin(fqn)
