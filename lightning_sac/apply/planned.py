"""What both backends share: a module's planned per-op decisions, matched against the ops each call runs."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from lightning_sac.plan import ModuleDecision
from lightning_sac.profiling.ops import op_name

__all__ = ["CallState", "PlannedForward"]


class CallState:
    """Where one forward call is in the planned op sequence; a fresh one per call."""

    def __init__(self) -> None:
        self.index = 0
        self.mismatch: str | None = None


class PlannedForward:
    """The forward of a planned module: the class's own forward, and the plan's decision for each of its ops.

    Op ``i`` of a call (counting the ops ``torch.utils.checkpoint`` does not ignore, as the profiler did) is
    ``MUST_SAVE`` when the plan saves it and ``PREFER_RECOMPUTE`` otherwise. When the call runs another op than
    the profiled one at some index, or another number of ops (another code path), every op from there on is
    saved and a warning names the module once. Subclasses run the forward under their backend.

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
        self.last_mismatch: str | None = None  # what differed in the last call that ran other ops

    def decide(self, state: CallState, func: Any) -> CheckpointPolicy:
        """The decision for the next op of the call, ``func``."""
        i = state.index
        state.index += 1
        if state.mismatch is None:
            expected = self.names[i] if i < len(self.names) else "the end of the profiled ops"
            if op_name(func) != expected:
                state.mismatch = f"op {i} is {op_name(func)}, the profile has {expected}"
        if state.mismatch is not None or self.save[i]:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def run(self, state: CallState, *args: Any, **kwargs: Any) -> Any:
        """Run the forward under the backend, asking :meth:`decide` about each op."""
        raise NotImplementedError

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's forward with the plan; plainly without grad (evaluation)."""
        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)
        self.calls += 1
        state = CallState()
        out = self.run(state, *args, **kwargs)
        if state.mismatch is None and state.index != len(self.names):
            state.mismatch = f"it ran {state.index} ops, the profile has {len(self.names)}"
        if state.mismatch is not None:
            self.mismatched_calls += 1
            self.last_mismatch = state.mismatch
            if not self.warned:
                self.warned = True
                warnings.warn(
                    f"lightning-sac: module {self.fqn!r} ran other ops than the profiled ones ({state.mismatch}), "
                    "so its planned policy did not hold for that call: ops from the first difference on were "
                    "saved, and it freed less memory than planned. This happens when the code path differs from "
                    "the example the plan was made for. (Warned once.)",
                    stacklevel=2,
                )
        return out
