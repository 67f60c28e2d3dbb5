"""What a checkpoint's recompute reruns a module with: its first call's lists, dicts and host generators.

``torch.utils.checkpoint`` reruns a module's Python code from the arguments it kept and with torch's generators as
they were; everything else the code reads is as it is at the recompute. Two things it reads are restored here for
the SAC backend, so that a rerun computes what the forward did:

* **Lists and dicts passed in.** ``checkpoint`` keeps a non-tensor argument as the object itself: torchvision's
  DenseNet passes each layer the block's list of features and appends the layer's output after the call, so the
  recompute read one more tensor (a shape error in backward, or, where shapes matched, silently other values). The
  first call copies each list and dict (not the items: tensors are not copied) before the module runs on the
  caller's own; every rerun gets a fresh copy of those copies at their places, and the tensors ``checkpoint``
  passes (version-checked) everywhere else.
* **Python's and NumPy's global generators.** A module that draws from ``random`` or ``np.random`` (a layer skipped
  by ``random.random()``, a mask from ``np.random.rand``) drew other numbers in the recompute and trained other
  gradients, silently. Their states at the first call are set for each rerun and put back after it, as
  ``checkpoint`` does for torch's own. A generator object the module owns (``np.random.default_rng()``) is not.

The graph backend replays recorded ops, not Python, and needs neither.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_sac.adapters import HostGenerators, host_generator_states, host_generators

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
    """A module's forward with the call's keywords bound; its reruns see the first call's state (module docstring).

    The first call's lists, dicts and host generators, as they were when it began. :meth:`arguments` gives what to
    pass ``torch.utils.checkpoint``: the call's arguments with copies in place of its lists and dicts, so that the
    checkpoint keeps only what they held then (the caller's list, kept, would keep what it appends later alive
    until backward); the first call swaps the caller's own back in, and lets go of them.
    """

    def __init__(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        self.fn, self.kwargs = fn, kwargs
        self.own: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self.states: HostGenerators | None = None

    def arguments(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The positional arguments to pass ``checkpoint`` for a call with ``args``."""
        if not _holds_container((args, self.kwargs)):
            return args
        self.own = (args, self.kwargs)
        copies, self.kwargs = _copied((args, self.kwargs))
        return tuple(copies)

    def __call__(self, *args: Any) -> Any:
        """The forward's call on the caller's objects, or a rerun on copies of them as they were then."""
        if self.states is None:
            self.states = host_generator_states()
            if self.own is not None:
                (args, kwargs), self.own = self.own, None
                return self.fn(*args, **kwargs)
            return self.fn(*args, **self.kwargs)
        # A rerun may change what it is given as the forward did: each gets copies of the copies.
        args, kwargs = _copied((args, self.kwargs))
        with host_generators(self.states):
            return self.fn(*args, **kwargs)


def rerunnable(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Rerunnable, tuple[Any, ...]]:
    """What to pass ``torch.utils.checkpoint`` for a call of ``fn`` (see :class:`Rerunnable`): it, and the arguments.

    ``checkpoint`` takes keywords of its own (``use_reentrant``, ``context_fn``, ``preserve_rng_state``...) and would
    take a module's keyword of the same name as its own; bound here, they reach the module whatever their names.
    """
    rerun = Rerunnable(fn, kwargs)
    return rerun, rerun.arguments(args)
