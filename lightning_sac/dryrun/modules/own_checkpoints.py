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
from collections.abc import Iterator
from typing import Any

import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["CheckpointWatch", "checkpointing_flags", "flags_off"]


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
