"""The SAC backend: each planned module's forward under ``torch.utils.checkpoint`` with a selective policy.

The module's ``forward`` is replaced by an instance attribute that calls the class's forward inside a
non-reentrant checkpoint; deleting the attribute restores the module exactly. Nothing is re-registered, so
parameters, module names and ``state_dict`` keys never change and checkpoints load with or without a plan.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_sac.plan import ModuleDecision
from lightning_sac.profiling.ops import op_name

__all__ = ["SelectiveCheckpointForward"]


class _CallState:
    """Where one forward call is in the planned op sequence; a fresh one per call (and per checkpoint)."""

    def __init__(self) -> None:
        self.index = 0
        self.mismatch: str | None = None


class SelectiveCheckpointForward:
    """A module's forward run under a non-reentrant checkpoint that saves exactly the ops the plan saves.

    The policy is asked about every op ``torch.utils.checkpoint`` does not ignore, in order, the same ops the
    profiler recorded; op ``i`` is saved (``MUST_SAVE``) when ``op_policy[i]`` is 1 and recomputed
    (``PREFER_RECOMPUTE``) otherwise. When the call runs another op than the profiled one at some index
    (another input shape, another code path), the rest of the call saves every op, and a warning names the
    module once. Without grad (evaluation), the forward runs plainly.

    Args:
        module: The module whose forward is wrapped.
        fqn: Its name in the model, for messages.
        decision: The plan's decision for it.
    """

    def __init__(self, module: nn.Module, fqn: str, decision: ModuleDecision) -> None:
        if len(decision.op_names) != len(decision.op_policy):
            raise ValueError(
                f"The plan's decision for {fqn!r} has {len(decision.op_policy)} op decisions but "
                f"{len(decision.op_names)} op names; re-create the plan with this version of lightning-sac."
            )
        self.fqn = fqn
        self.names = list(decision.op_names)
        self.save = [bool(x) for x in decision.op_policy]
        # The class's forward, bound to the module: an instance attribute "forward" would recurse.
        self.inner: Callable[..., Any] = type(module).forward.__get__(module)
        self.warned = False
        self.calls = 0
        self.mismatched_calls = 0

    def _policy(self, state: _CallState, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        i = state.index
        state.index += 1
        if state.mismatch is None:
            name = op_name(func)
            expected = self.names[i] if i < len(self.names) else "the end of the profiled ops"
            if name != expected:
                state.mismatch = f"op {i} is {name}, the profile has {expected}"
        if state.mismatch is not None or self.save[i]:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def _warn(self, state: _CallState) -> None:
        self.mismatched_calls += 1
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"lightning-sac: module {self.fqn!r} ran other ops than the profiled ones ({state.mismatch}), "
                "so its planned policy did not hold for that call: ops from the first difference on were saved, and it "
                "freed less memory than planned. This happens when the batch shape or code path differs from "
                "the example the plan was made for; plan with the worst-case batch. (Warned once.)",
                stacklevel=3,
            )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's forward under the selective checkpoint."""
        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)
        self.calls += 1
        state = _CallState()

        def contexts() -> tuple[Any, Any]:
            # A fresh call state for the forward; recompute reads SAC's cache and does not ask the policy.
            # An in-place op shares its parent's decision, so a saved parent's cache entry is mutated by its
            # saved in-place ops (dropout's bernoulli_ on empty_like's output); on recompute both return the
            # cached, final value and nothing is applied twice.
            return create_selective_checkpoint_contexts(
                lambda *a, **k: self._policy(state, *a, **k), allow_cache_entry_mutation=True
            )

        out = checkpoint(self.inner, *args, use_reentrant=False, context_fn=contexts, **kwargs)
        if state.mismatch is None and state.index != len(self.names):
            state.mismatch = f"it ran {state.index} ops, the profile has {len(self.names)}"
        if state.mismatch is not None:
            self._warn(state)
        return out
