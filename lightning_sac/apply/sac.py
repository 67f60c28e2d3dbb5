"""The SAC backend: each planned module's forward under ``torch.utils.checkpoint`` with a selective policy.

The module's ``forward`` is replaced by an instance attribute that calls the class's forward inside a
non-reentrant checkpoint; deleting the attribute restores the module exactly. Nothing is re-registered, so
parameters, module names and ``state_dict`` keys never change and checkpoints load with or without a plan.
Under ``torch.compile`` the wrapper takes :meth:`PlannedForward.run_traced` instead (:mod:`lightning_sac.apply.traced`).

A module whose policy saves nothing runs a plain checkpoint, without a selective policy: the same recompute,
without the dispatch modes a policy needs, which cost a Python call per op and, because ATen sees every tensor
as a subclass under them, slower out-of-place paths in composite ops (1.2-1.3x a GPT block's time on a CPU).
A plain checkpoint cannot see which ops a call runs, so each new kind of call (training flags, autocast,
argument shapes and values) runs once under the policy first: when it runs the profiled ops, later calls of its
kind run plainly; when it runs others, they keep the policy, whose fallback saves what must not run twice.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_sac.adapters import sac_sees_outputs
from lightning_sac.apply.planned import CallState, PlannedForward
from lightning_sac.apply.rerun_args import rerunnable
from lightning_sac.apply.skip_dead import SkipDeadOps
from lightning_sac.errors import LightningSACError
from lightning_sac.plan import ModuleDecision

__all__ = ["SelectiveCheckpointForward", "runs_whole", "whole_checkpoints"]

_WHOLE = contextvars.ContextVar("lightning_sac_whole_checkpoints", default=True)
# Kinds of call remembered per module; past it the memory starts over (each kind is then observed once more).
_MAX_KINDS = 64
_SCALARS = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _call_kind(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What decides a call's code path, as far as it is cheap to see: flags, autocast, arguments' layout."""
    leaves = tuple(
        (tuple(x.shape), x.dtype, x.requires_grad)
        if isinstance(x, torch.Tensor)
        else (x if isinstance(x, _SCALARS) else type(x).__name__)
        for x in tree_leaves((args, kwargs))
    )
    flags = tuple(m.training for m in module.modules())
    autocast = (torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda"))
    return flags, autocast, tuple(kwargs), leaves


@contextlib.contextmanager
def whole_checkpoints(enabled: bool) -> Iterator[None]:
    """Whether wrappers made inside may run a policy that saves nothing as a plain checkpoint (default yes).

    Off, they run it under a selective policy like any other: what the profile's calibration measures to tell
    the two costs apart.
    """
    token = _WHOLE.set(enabled)
    try:
        yield
    finally:
        _WHOLE.reset(token)


def runs_whole(module: nn.Module, decision: ModuleDecision) -> bool:
    """Whether ``module`` under ``decision`` can run a plain checkpoint: its policy saves nothing.

    Not for a module whose plan keeps dropout noise as masks, which only a policy can record. Not for a module
    holding running statistics (BatchNorm and its kind): a plain checkpoint would update them
    a second time in recompute, whatever code path the call takes, where a selective policy saves that op.
    """
    if any(decision.op_policy) or decision.masked_ops:
        return False
    return not any(isinstance(m, _NormBase) and m.track_running_stats for m in module.modules())


class _Beneath:
    """Enter SAC's recompute mode over a mode made at entry: SAC serves saved ops, the other sees the rest."""

    def __init__(self, sac_mode: Any, make: Callable[[], SkipDeadOps]) -> None:
        self.sac_mode = sac_mode
        self.make = make
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> None:
        # Entered at backward, after the forward decided every op: the skipper's order is known by then.
        self.stack.enter_context(self.make())
        self.stack.enter_context(self.sac_mode)

    def __exit__(self, *exc: Any) -> None:
        self.stack.close()


class _ForwardDecisions:
    """The policy of one checkpointed call: the plan decides each forward op, and recompute hears those answers again.

    From torch 2.12 SAC's recompute reads its cache and asks nothing. Before it, recompute asks the policy again for
    every op (``SelectiveCheckpointContext.is_recompute``) and serves a saved op from a per-op list in order, so a
    different answer there would hand one op's saved value to another (an in-place ``relu_`` the forward recomputed,
    answered "save" in recompute, takes the value of a later ``relu_`` that was saved): the answers are replayed by
    position, and a recompute that runs another op than the forward did at that position is refused.
    """

    def __init__(self, planned: PlannedForward, state: CallState) -> None:
        self.planned = planned
        self.state = state
        self.answers: list[tuple[Any, CheckpointPolicy]] = []
        self.replayed = 0

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if not getattr(ctx, "is_recompute", False):
            # Before torch 2.12 the policy runs before the op, with no output to see (sac_sees_outputs).
            answer = self.planned.decide(self.state, func, args, kwargs, getattr(ctx, "op_output", None))
            self.answers.append((func, answer))
            return answer
        i, self.replayed = self.replayed, self.replayed + 1
        if i >= len(self.answers) or self.answers[i][0] != func:
            ran = self.answers[i][0] if i < len(self.answers) else "the end of the forward"
            raise LightningSACError(
                f"The recompute of {self.planned.fqn or 'the model'!r} ran {func} as its op {i}, where the forward "
                f"ran {ran}: the module's forward takes another code path when run again, so its saved values "
                "cannot be matched to the recomputed ops. Leave this module out of the plan (solve_plan's "
                "constraints) or make its forward deterministic in its code path."
            )
        return self.answers[i][1]


class SelectiveCheckpointForward(PlannedForward):
    """A module's forward run under a non-reentrant checkpoint that saves exactly the ops the plan saves.

    Each call gets fresh ``create_selective_checkpoint_contexts`` whose policy is :meth:`PlannedForward.decide`;
    a module whose policy saves nothing runs a plain checkpoint (see the module docstring), whose calls are not
    matched against the profiled ops: with nothing saved, every op is recomputed whichever ran.
    """

    def __init__(self, module: nn.Module, fqn: str, decision: ModuleDecision, notices: Any = None) -> None:
        super().__init__(module, fqn, decision, notices)
        if self.masked and not sac_sees_outputs():
            raise LightningSACError(
                f"The plan keeps {fqn or 'the model'}'s dropout noise as masks ({len(self.masked)} ops), which needs "
                "torch.utils.checkpoint to show each op's output to the policy (SelectiveCheckpointContext.op_output, "
                f"torch >= 2.12); torch {torch.__version__} does not. Plan again on this torch (solve_plan leaves "
                "masks out where the backend cannot keep them), pass masks=False to solve_plan, or apply with "
                "backend='graph'."
            )
        self.whole = _WHOLE.get() and runs_whole(module, decision)
        # Per kind of call (see _call_kind): whether its observed call ran the profiled ops.
        self.kinds: dict[tuple[Any, ...], bool] = {}
        self.skipped = list(decision.skipped_ops)
        self.last_skipper: SkipDeadOps | None = None  # the last recompute's (tests read what it skipped)

    def run(self, state: CallState, /, *args: Any, **kwargs: Any) -> Any:
        """Run the forward under ``torch.utils.checkpoint``: with the selective policy, or plainly."""
        if not self.whole:
            return self._selective(state, *args, **kwargs)
        kind = _call_kind(self.module, args, kwargs)
        if self.kinds.get(kind):
            state.unobserved = True
            if not self.skipped:
                rerun, given = rerunnable(self.inner, args, kwargs)
                return checkpoint(rerun, *given, use_reentrant=False)
            # The recompute alone runs under a dispatch mode, which sees every op of it: the one that skips.
            order = range(len(self.names))
            rerun, given = rerunnable(self.inner, args, kwargs)
            return checkpoint(
                rerun,
                *given,
                use_reentrant=False,
                context_fn=lambda: (contextlib.nullcontext(), self._skipper(order)),
            )
        out = self._selective(state, *args, **kwargs)
        if len(self.kinds) >= _MAX_KINDS:
            self.kinds.clear()
        self.kinds[kind] = state.mismatch is None and state.index == len(self.names)
        return out

    def _skipper(self, order: Sequence[int], masks: list[torch.Tensor] | None = None) -> SkipDeadOps:
        self.last_skipper = SkipDeadOps(self.names, order, self.skipped, masks, self.fqn)
        return self.last_skipper

    def _rerun_order(self, state: CallState) -> Sequence[int]:
        """The profile indices of the ops SAC's recompute runs (passes down to a mode beneath it), in order."""
        if state.mismatch is not None or state.index != len(self.names):
            return ()  # the call left the plan: its decisions are not the plan's, so nothing is skipped
        return [i for i, save in enumerate(self.save) if not save]

    def _selective(self, state: CallState, /, *args: Any, **kwargs: Any) -> Any:
        def contexts() -> tuple[Any, Any]:
            # A fresh call state for the forward. An in-place op shares its parent's decision, so a saved parent's
            # cache entry is mutated by its saved in-place ops (dropout's bernoulli_ on empty_like's output); on
            # recompute both return the cached, final value and nothing is applied twice.
            forward, recompute = create_selective_checkpoint_contexts(
                _ForwardDecisions(self, state), allow_cache_entry_mutation=True
            )
            if not self.skipped and not self.masked:
                return forward, recompute

            def skipper() -> SkipDeadOps:
                masks = state.planned_masks(len(self.names)) if self.masked else None
                return self._skipper(self._rerun_order(state), masks)

            return forward, _Beneath(recompute, skipper)

        rerun, given = rerunnable(self.inner, args, kwargs)
        return checkpoint(rerun, *given, use_reentrant=False, context_fn=contexts)
