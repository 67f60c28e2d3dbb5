"""A planned module inside ``torch.compile``: its policy, asked once per trace by AOT autograd, tags graph nodes.

Under ``torch.compile`` a wrapper's ``torch.utils.checkpoint`` call becomes dynamo's checkpoint higher-order op.
Dynamo accepts a ``context_fn`` it did not create while tracing (a plain function made outside the compiled code:
``NotImplementedError: checkpoint not implemented for ... context_fn`` otherwise), and calls nothing of it: AOT
autograd calls it when it traces the region (``torch._higher_order_ops.wrap.tag_activation_checkpoint``), and the
policy it returns tags each aten node of the region with save or recompute; the partitioner then keeps exactly
the saved ones for backward and recomputes the rest inside the compiled backward. So the policy runs as ordinary
Python at trace time, once per compiled graph, and holds no state dynamo must trace. A fresh match state per call
of the ``context_fn`` plays the role of the eager policy's per-call state: SAC asks the policy during the forward
only (``SelectiveCheckpointContext.is_recompute`` is always ``False`` in this torch), so nothing needs resetting
for the recompute.

The ops traced are not always the ops eager autograd ran: compile decomposes some (eager CPU dropout is
``empty_like, bernoulli_, div_, mul``; traced, it is one ``native_dropout``) and copies an output that is a view.
Ops are therefore matched to the plan by op and occurrence (the ``k``-th ``aten.mm`` of the call gets the plan's
decision for its ``k``-th ``aten.mm``), the way torchtitan's selective policy counts matmuls, so an op compile
adds or removes shifts nothing else. Matched ops are ``MUST_SAVE`` or ``MUST_RECOMPUTE`` (compile may override
``PREFER_*``); an op the plan does not have is ``PREFER_RECOMPUTE``. When the traced ops differ from the plan's,
the user is told once per module what was matched and what was not (:class:`TraceReport`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_sac.ops import op_name

__all__ = ["TraceReport", "traced_contexts"]

_COPY = "aten.clone.default"


@dataclass
class TraceReport:
    """What one trace of a planned module ran, against the plan.

    Attributes:
        traced: The op of each node the region's trace tagged, in order.
        saved: How many of them were tagged save (the plan saves them).
        recomputed: How many were tagged recompute because the plan recomputes them.
        unplanned: Traced ops the plan has no decision for (by op and occurrence): recomputed.
        not_traced: The plan's ops the trace did not run (by op and occurrence).
        output_copies: Unplanned clones of the op just before them: compile copies a region's output that is a
            view; recomputing such a copy is all it costs, so it is not a mismatch.
    """

    traced: list[str] = field(default_factory=list)
    saved: int = 0
    recomputed: int = 0
    unplanned: list[str] = field(default_factory=list)
    not_traced: list[str] = field(default_factory=list)
    output_copies: int = 0

    @property
    def matches(self) -> bool:
        """Whether every traced op had its decision and every planned op was traced."""
        return not self.unplanned and not self.not_traced

    def describe(self, planned: int) -> str:
        """The difference in words, for the warning."""

        def counted(names: list[str]) -> str:
            return ", ".join(f"{n} x{c}" if c > 1 else n for n, c in Counter(names).items())

        parts = [f"{self.saved + self.recomputed} of its {len(self.traced)} traced ops matched the plan's {planned}"]
        if self.unplanned:
            parts.append(f"not in the plan, recomputed: {counted(self.unplanned)}")
        if self.not_traced:
            parts.append(f"planned but not in the compiled graph: {counted(self.not_traced)}")
        return "; ".join(parts)


class _TraceMatch:
    """The policy of one traced call: the plan's decisions keyed by (op, occurrence)."""

    def __init__(self, names: list[str], save: list[bool]) -> None:
        self.decisions: dict[tuple[str, int], bool] = {}
        seen: Counter[str] = Counter()
        for name, keep in zip(names, save, strict=True):
            self.decisions[(name, seen[name])] = keep
            seen[name] += 1
        self.counts: Counter[str] = Counter()
        self.report = TraceReport()
        self._last_output: Any = None

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = op_name(func)
        key = (name, self.counts[name])
        self.counts[name] += 1
        self.report.traced.append(name)
        previous, self._last_output = self._last_output, getattr(ctx, "op_output", None)
        save = self.decisions.get(key)
        if save is None:
            if name == _COPY and previous is not None and args and args[0] is previous:
                self.report.output_copies += 1
            else:
                self.report.unplanned.append(name)
            return CheckpointPolicy.PREFER_RECOMPUTE
        if save:
            self.report.saved += 1
            return CheckpointPolicy.MUST_SAVE
        self.report.recomputed += 1
        return CheckpointPolicy.MUST_RECOMPUTE

    def finish(self) -> TraceReport:
        """The report, with the planned ops the trace did not reach."""
        self.report.not_traced = [name for (name, k) in self.decisions if k >= self.counts[name]]
        return self.report


_REPORTING: dict[type, type] = {}


def _reporting(mode_type: Any) -> type:
    """``mode_type`` (SAC's forward dispatch mode) with a callback when the region's forward ends."""
    if mode_type not in _REPORTING:

        def __exit__(self: Any, *exc: Any) -> Any:  # noqa: N807 - the dunder the with statement calls
            try:
                return mode_type.__exit__(self, *exc)
            finally:
                self.lightning_sac_on_exit()

        _REPORTING[mode_type] = type(f"Reporting{mode_type.__name__}", (mode_type,), {"__exit__": __exit__})
    return _REPORTING[mode_type]


def _with_exit_callback(mode: Any, on_exit: Callable[[], None]) -> Any:
    # Checkpoint requires SAC's own modes under compile, and compile sets attributes on the forward one
    # (``ac_graph_id``): the mode keeps its class's behaviour, with only ``__exit__`` extended.
    mode.__class__ = _reporting(type(mode))
    mode.lightning_sac_on_exit = on_exit
    return mode


def _tagging() -> bool:
    # What torch.utils.checkpoint's own check reads: a proxy mode is active while AOT autograd traces the graph
    # whose nodes the policy tags. AOT autograd first runs the region once without one, to collect metadata.
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


class PlannedCalls(Protocol):
    """What :func:`traced_contexts` asks of a planned module (:class:`~lightning_sac.apply.planned.PlannedForward`)."""

    names: list[str]
    save: list[bool]

    def begin(self) -> Any: ...  # noqa: D102

    def decide(self, state: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any: ...  # noqa: D102

    def finish(self, state: Any) -> None: ...  # noqa: D102

    def finish_trace(self, report: TraceReport) -> None: ...  # noqa: D102


def traced_contexts(forward: PlannedCalls) -> Callable[[], tuple[Any, Any]]:
    """The ``context_fn`` of ``forward``'s checkpoint under compile, made once, outside any compiled code.

    Compiling, its policy is a fresh :class:`_TraceMatch` per call, reported when the call tagged a graph. If
    dynamo runs the checkpoint eagerly instead (a graph break inside the module), it is the eager per-call policy
    of :meth:`~lightning_sac.apply.planned.PlannedForward.decide`.
    """

    def contexts() -> tuple[Any, Any]:
        if torch.compiler.is_compiling():
            match = _TraceMatch(forward.names, forward.save)
            fwd, rec = create_selective_checkpoint_contexts(match, allow_cache_entry_mutation=True)
            if not _tagging():
                return fwd, rec
            return _with_exit_callback(fwd, lambda: forward.finish_trace(match.finish())), rec
        state = forward.begin()
        fwd, rec = create_selective_checkpoint_contexts(
            lambda ctx, func, *a, **k: forward.decide(state, func, a, k, getattr(ctx, "op_output", None)),
            allow_cache_entry_mutation=True,
        )
        return _with_exit_callback(fwd, lambda: forward.finish(state)), rec

    return contexts
