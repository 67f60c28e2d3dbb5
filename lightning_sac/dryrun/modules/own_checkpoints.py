"""The model's own activation checkpointing: which modules already run under ``torch.utils.checkpoint``.

Models that checkpoint themselves (``torch.utils.checkpoint`` in ``forward``, Hugging Face's
``gradient_checkpointing_enable()``, ``checkpoint_wrapper``) are profiled as they run: their regions really free
their activations on fake tensors too. The planner must not wrap such a module again, nor a module around or
inside one (nested regions would recompute twice and the profile's op lists would not describe them), so the
dry run records them. Both forms of ``torch.utils.checkpoint`` go through two module globals that
``checkpoint()`` looks up at each call, ``_checkpoint_without_reentrant_generator`` and ``CheckpointFunction``;
while :class:`CheckpointWatch` is entered they are wrapped to count open regions. A recompute in backward runs
the region's function directly, so it is not counted again.

Hugging Face marks the modules it checkpoints with a ``gradient_checkpointing`` flag; :func:`checkpointing_flags`
lists them, so that messages can say how to hand control to lightning-sac, and :func:`flags_off` turns them off
on a model (the dry run's copy, or the user's model when a plan replaces them: ``replace_existing=True``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.hooks import RemovableHandle

__all__ = ["CheckpointWatch", "GeneratorStates", "checkpointing_flags", "flags_off"]


def checkpointing_flags(model: nn.Module) -> list[str]:
    """Fqns of the modules whose Hugging Face-style ``gradient_checkpointing`` flag is ``True``."""
    return [fqn for fqn, m in model.named_modules() if getattr(m, "gradient_checkpointing", None) is True]


@contextlib.contextmanager
def flags_off(model: nn.Module, fqns: list[str]) -> Iterator[None]:
    """Set the ``gradient_checkpointing`` flag of the modules ``fqns`` to ``False`` within the block."""
    modules = dict(model.named_modules())
    changed = [modules[f] for f in fqns if getattr(modules.get(f), "gradient_checkpointing", None) is True]
    for m in changed:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in changed:
            m.gradient_checkpointing = True


class _CountedFunction:
    """Stands in for ``CheckpointFunction`` (the reentrant form): ``apply`` counts the open region."""

    def __init__(self, original: Any, watch: CheckpointWatch) -> None:
        self.original = original
        self.watch = watch

    def apply(self, *args: Any) -> Any:
        self.watch.begin()
        try:
            return self.original.apply(*args)
        finally:
            self.watch.end()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.original, name)


class CheckpointWatch:
    """Records which modules run inside the model's own checkpoint regions, and which modules open them.

    Args:
        model: The (fake) model of the dry run; forward hooks are added to it while the watch is entered.

    Attributes:
        under: Outermost modules whose forward ran inside one of the model's own checkpoint regions.
        callers: Modules in whose forward (outside any region) a region began: they contain checkpointing.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.under: list[str] = []
        self.callers: list[str] = []
        self._depth = 0
        self._stack: list[str] = []
        self._handles: list[RemovableHandle] = []
        self._originals: dict[str, Any] = {}

    def begin(self) -> None:
        """A checkpoint region begins."""
        if self._depth == 0 and self._stack and self._stack[-1] not in self.callers:
            self.callers.append(self._stack[-1])
        self._depth += 1

    def end(self) -> None:
        """A checkpoint region ends."""
        self._depth -= 1

    def _pre(self, fqn: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._stack.append(fqn)
            inside = any(fqn == u or fqn.startswith(u + ".") or u == "" for u in self.under)
            if self._depth > 0 and not inside:
                self.under.append(fqn)

        return hook

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._stack.pop()

    def __enter__(self) -> CheckpointWatch:
        for fqn, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._pre(fqn)))
            self._handles.append(module.register_forward_hook(self._post))
        generator = torch_checkpoint._checkpoint_without_reentrant_generator
        self._originals = {"_checkpoint_without_reentrant_generator": generator}
        self._originals["CheckpointFunction"] = torch_checkpoint.CheckpointFunction

        def counted(*args: Any, **kwargs: Any) -> Iterator[Any]:
            self.begin()
            try:
                yield from generator(*args, **kwargs)
            finally:
                self.end()

        stand_ins: dict[str, Any] = {"_checkpoint_without_reentrant_generator": counted}
        stand_ins["CheckpointFunction"] = _CountedFunction(self._originals["CheckpointFunction"], self)
        for name, value in stand_ins.items():
            setattr(torch_checkpoint, name, value)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, value in self._originals.items():
            setattr(torch_checkpoint, name, value)
        for h in self._handles:
            h.remove()
        self._handles.clear()


class GeneratorStates:
    """Calls ``on_state`` with every CPU generator state ``torch.get_rng_state()`` makes in the step while entered.

    ``torch.utils.checkpoint`` stashes the CPU generator's state at each region's forward (kept by the region's
    frame, or the reentrant form's ``ctx``, until its backward is over) and ``torch.random.fork_rng`` copies it
    again for the length of each recompute: real tensors made outside the dispatcher, which the dry run's mode
    does not see (5 KiB each; three were alive at a model's own checkpoint's recompute, the plain step's peak,
    predicted 11 KiB under). Both the stash and the fork look ``torch.get_rng_state`` up at each call. Only the
    step's own calls count: made while ``mode`` is on the dispatch stack (the dry run's own forks run with it off).

    Args:
        mode: The dry run's dispatch mode.
        on_state: Called with each state.
        enabled: Whether to watch at all (a GPU target's generator state is on the host: not counted).
    """

    def __init__(self, mode: object, on_state: Callable[[torch.Tensor], None], enabled: bool = True) -> None:
        self.mode = mode
        self.on_state = on_state
        self.enabled = enabled
        self._original: Callable[[], torch.Tensor] | None = None

    def __enter__(self) -> GeneratorStates:
        if not self.enabled:
            return self
        original = self._original = torch.get_rng_state

        def get_rng_state() -> torch.Tensor:
            state = original()
            if self.mode in _get_current_dispatch_mode_stack():
                self.on_state(state)
            return state

        torch.get_rng_state = torch.random.get_rng_state = get_rng_state
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._original is not None:
            torch.get_rng_state = torch.random.get_rng_state = self._original
            self._original = None
