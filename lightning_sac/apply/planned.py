"""What both backends share: a module's planned per-op decisions, matched against the ops each call runs."""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from lightning_sac.adapters import CacheCall, layer_indices, without_kv_caches
from lightning_sac.apply.traced import TraceReport, traced_contexts
from lightning_sac.ops import flat_tensors, is_random, may_draw, mutated_tensors, op_name
from lightning_sac.plan import ModuleDecision
from lightning_sac.sharding import in_parallel_hook

__all__ = ["COMPILE_TRACE_WARNING", "CallState", "Notices", "PlannedForward", "bound"]

#: How the warning begins that a module traced other ops under ``torch.compile`` than its plan's: a filter on it
#: (the planner's own traces, :func:`~lightning_sac.apply.compiled_trace.compiled_step_memory`) matches this text.
COMPILE_TRACE_WARNING = "lightning-sac: under torch.compile, module"


def bound(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Callable[..., Any]:
    """``fn`` with the call's keyword arguments bound, to pass to ``torch.utils.checkpoint``.

    ``checkpoint`` takes keywords of its own (``use_reentrant``, ``context_fn``, ``debug``, ``early_stop``,
    ``determinism_check``, ``preserve_rng_state``) and would take a module's keyword of the same name as its
    own; bound here, they reach the module whatever their names.
    """
    return functools.partial(fn, **kwargs) if kwargs else fn


class Notices:
    """Warnings shared by the wrappers of one applied plan: each is given once, not once per module or step."""

    def __init__(self) -> None:
        self.given: set[str] = set()

    def warn(self, key: str, message: str) -> None:
        """Warn with ``message`` unless a warning under ``key`` was given already."""
        if key not in self.given:
            self.given.add(key)
            warnings.warn(message, stacklevel=3)


class _Storages:
    """Storages seen in one call, by identity: a weak reference rules out an ``id`` a freed storage left behind."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    def add(self, storages: list[torch.UntypedStorage]) -> None:
        for st in storages:
            self._refs[id(st)] = weakref.ref(st)

    def __contains__(self, st: torch.UntypedStorage) -> bool:
        ref = self._refs.get(id(st))
        return ref is not None and ref() is st


def _storages(x: Any) -> list[torch.UntypedStorage]:
    return [t.untyped_storage() for t in flat_tensors(x)]


class CallState:
    """Where one forward call is in the planned op sequence; a fresh one per call.

    Attributes:
        index: Ops decided so far.
        mismatch: What first differed from the profiled ops, once something did.
        random_saved: Whether the call's random ops are saved (the first one's decision; all follow it).
        saved: Storages of the outputs of the ops saved so far (known when the backend passes outputs).
        made: Storages of the outputs of every op so far (likewise).
        unobserved: Whether the call ran without a policy asked about its ops (a plain checkpoint).
        masks: The ``bool`` masks of the call's masked draws, in order, until its recompute copies them back.
    """

    def __init__(self) -> None:
        self.unobserved = False
        self.index = 0
        self.mismatch: str | None = None
        self.random_saved: bool | None = None
        self.saved = _Storages()
        self.made = _Storages()
        self.masks: list[torch.Tensor] = []

    def planned_masks(self, n_ops: int) -> list[torch.Tensor] | None:
        """The masks for the recompute, or ``None`` when the call left the plan (its draws are then redrawn).

        Redrawing is exact then: every draw before the first difference was masked, so the recompute replays the
        generator through the same draws in the same order, and every draw after it was saved (:meth:`fallback`).
        """
        if self.mismatch is not None or self.index != n_ops:
            self.masks.clear()
            return None
        return self.masks


class PlannedForward:
    """The forward of a planned module: the class's own forward, and the plan's decision for each of its ops.

    Op ``i`` of a call (counting the ops ``torch.utils.checkpoint`` does not ignore, as the profiler did) is
    ``MUST_SAVE`` when the plan saves it and ``PREFER_RECOMPUTE`` otherwise. When the call runs another op than
    the profiled one at some index, or another number of ops (another code path), a warning names the module
    once, and from that op on the call keeps no more than plain autograd would: every op is recomputed except
    those that must not run twice or must stay consistent with what was saved (:meth:`fallback`).

    In training, a call with an empty KV cache runs without it (``use_cache=False``), as Hugging Face's
    checkpointing does, and one with a cache that already holds tokens runs plainly, unplanned, said once (see
    :mod:`lightning_sac.adapters.caches`). Subclasses run the forward under their backend.

    Args:
        module: The module whose forward is wrapped.
        fqn: Its name in the model, for messages.
        decision: The plan's decision for it.
        notices: The applied plan's shared warnings (a fresh one when not given).
    """

    def __init__(self, module: nn.Module, fqn: str, decision: ModuleDecision, notices: Notices | None = None) -> None:
        if len(decision.op_names) != len(decision.op_policy):
            raise ValueError(
                f"The plan's decision for {fqn!r} has {len(decision.op_policy)} op decisions but "
                f"{len(decision.op_names)} op names; re-create the plan with this version of lightning-sac."
            )
        self.fqn = fqn
        self.module = module
        self.names = list(decision.op_names)
        self.save = [bool(x) for x in decision.op_policy]
        self.masked = frozenset(decision.masked_ops)
        # Per op index, the op an earlier call ran there, matching the profile, and whether it can draw random
        # numbers: a later call that runs the same op object there skips the name and schema lookups (the policy
        # is asked about every op of every call, and its host time adds to the step's).
        self.seen: list[Any] = [None] * len(self.names)
        self.draws = [True] * len(self.names)
        # The class's forward, bound to the module: an instance attribute "forward" would recurse.
        self.inner: Callable[..., Any] = type(module).forward.__get__(module)
        self.notices = notices or Notices()
        self.layers = layer_indices(module)
        self.warned = False
        self.calls = 0
        self.mismatched_calls = 0
        self.last_mismatch: str | None = None  # what differed in the last call that ran other ops
        # Under torch.compile: how often the region was traced, and what its last trace tagged.
        self.traces = 0
        self.last_trace: TraceReport | None = None
        # Made here, outside any compiled code, so that dynamo passes it to AOT autograd (see apply.traced).
        self.traced_contexts = traced_contexts(self)

    def decide(
        self,
        state: CallState,
        func: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        output: Any = None,
    ) -> CheckpointPolicy:
        """The decision for the next op of the call, ``func`` with its arguments (and its output, for SAC)."""
        if in_parallel_hook():  # FSDP's or a TP style's own work, not the module's compute: not counted
            return CheckpointPolicy.PREFER_RECOMPUTE
        i = state.index
        state.index += 1
        if state.mismatch is None and (i >= len(self.seen) or func is not self.seen[i]):
            expected = self.names[i] if i < len(self.names) else "the end of the profiled ops"
            if op_name(func) != expected:
                state.mismatch = f"op {i} is {op_name(func)}, the profile has {expected}"
            else:
                self.seen[i], self.draws[i] = func, may_draw(func)
        kwargs = kwargs or {}
        if state.mismatch is None:
            save = self.save[i]
            if i in self.masked and isinstance(output, torch.Tensor):
                # Kept as a mask, recomputed by SAC: the recompute copies it back (apply.skip_dead).
                state.masks.append(output.to(torch.bool))
            if state.random_saved is None and self.draws[i] and is_random(func, args, kwargs):
                # A masked draw is not drawn again either: later draws must not be redrawn (fallback).
                state.random_saved = save or i in self.masked
        else:
            save = self.fallback(state, func, args, kwargs, output)
        if output is not None:
            made = _storages(output)
            state.made.add(made)
            if save:
                state.saved.add(made)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    @staticmethod
    def fallback(state: CallState, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> bool:
        """Whether to save an op after the call left the plan: only what recompute could not reproduce.

        Saved: an op that writes a tensor it does not return (BatchNorm's running statistics) or, with
        ``output`` known, an in-place op on a saved tensor or on one from outside the call (a recompute would
        write it twice), and random ops as the call's first random op was decided (a recompute replays the
        generator only for the random ops it reruns, so all must be alike). Everything else is recomputed,
        which keeps less than plain autograd would.
        """
        written = _storages(mutated_tensors(func, args, kwargs))
        if written:
            if output is None:
                return True  # the graph backend keeps a written tensor's node itself; saving it adds no storage
            returned = {id(st) for st in _storages(output)}
            if any(id(st) not in returned for st in written):
                return True  # it writes state it does not return
            # Saved when a recompute would write a saved tensor, or one from outside the call, a second time;
            # recomputed with its tensor when that is recomputed.
            return any(st in state.saved or st not in state.made for st in written)
        if is_random(func, args, kwargs):
            if state.random_saved is None:
                state.random_saved = False
            return state.random_saved
        return False

    def run(self, state: CallState, /, *args: Any, **kwargs: Any) -> Any:
        """Run the forward under the backend, asking :meth:`decide` about each op.

        Every wrapper's own parameters are positional-only, so that no keyword the module takes (``state=``,
        ``fn=``, ``self=``...) collides with them.
        """
        raise NotImplementedError

    def begin(self) -> CallState:
        """Start an eager call: counted, with a fresh :class:`CallState`."""
        self.calls += 1
        return CallState()

    def finish(self, state: CallState) -> None:
        """End an eager call: record, and warn once, when it ran other ops than the profiled ones."""
        if state.unobserved:
            return
        if state.mismatch is None and state.index != len(self.names):
            state.mismatch = f"it ran {state.index} ops, the profile has {len(self.names)}"
        if state.mismatch is None:
            return
        self.mismatched_calls += 1
        self.last_mismatch = state.mismatch
        if self.calls == 1:
            # A module's first call may build what its code keeps for the later ones (a lazily made mask or
            # table); the dry run profiled a later call (dryrun/run.py). Only a later call that differs says the
            # plan does not hold.
            return
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"lightning-sac: module {self.fqn!r} ran other ops than the profiled ones ({state.mismatch}), "
                "so its planned policy did not hold for that call: from the first difference on, its ops were "
                "recomputed (those that must not run twice were saved), which keeps no more memory than "
                "without a plan but recomputes more. This happens when the code path differs from the example "
                "the plan was made for. (Warned once.)",
                stacklevel=3,
            )

    def finish_trace(self, report: TraceReport) -> None:
        """End a trace under ``torch.compile``: record it, and say once when its ops differ from the plan's."""
        self.traces += 1
        self.last_trace = report
        if not report.matches:
            # One warning for the plan, not one per module: the blocks of a deep model trace alike.
            self.notices.warn(
                "compile",
                f"{COMPILE_TRACE_WARNING} {self.fqn!r} traces other ops than the eager step the "
                f"plan was made for (compile decomposes or fuses some): {report.describe(len(self.names))}. Ops are "
                "matched to the plan by op and occurrence: matched ones are saved or recomputed as planned, the "
                "others are recomputed, which keeps no more than without a plan but may recompute more than "
                "planned. (Warned once for the plan; each planned module's last trace is its wrapper's "
                "`last_trace`, in the handle apply_plan returned.)",
            )

    def run_traced(self, /, *args: Any, **kwargs: Any) -> Any:
        """The forward as ``torch.compile`` traces it: a checkpoint whose ``context_fn`` dynamo can pass on."""
        call = without_kv_caches(self.module, args, kwargs, self.layers)
        if call.unplanned:
            _said_unplanned(self, call)
            return self.inner(*args, **kwargs)
        if self.masked:
            _said_redrawn(self)
        return checkpoint(
            bound(self.inner, call.kwargs), *call.args, use_reentrant=False, context_fn=self.traced_contexts
        )

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        """Run the module's forward with the plan; plainly without grad (evaluation)."""
        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)
        if torch.compiler.is_compiling():
            return self.run_traced(*args, **kwargs)
        call = without_kv_caches(self.module, args, kwargs, self.layers)
        if call.unplanned:
            _said_unplanned(self, call)
            return self.inner(*args, **kwargs)
        state = self.begin()
        out = self.run(state, *call.args, **call.kwargs)
        self.finish(state)
        return out


@torch.compiler.disable
def _said_unplanned(forward: PlannedForward, call: CacheCall) -> None:
    # Not traced under compile (warnings are not): a rare path, where a graph break costs nothing that matters.
    if call.holds_tokens:
        forward.notices.warn(
            f"tokens:{forward.fqn}",
            f"lightning-sac: module {forward.fqn!r} was called with a KV cache that already holds tokens "
            f"({', '.join(call.holds_tokens)}); recomputing it would update that cache twice, so such calls run "
            "without the plan (its memory is not saved). (Warned once.)",
        )
    else:
        forward.notices.warn(
            "eval-cache",  # once per plan: every layer of a decoder meets it in the same call
            f"lightning-sac: module {forward.fqn!r} (and any other planned module so called) was called in "
            f"evaluation mode with gradients on and a KV cache ({', '.join(call.writes_cache)}), which the call "
            "writes; recomputing it would write that cache twice, so such calls run without the plan (their memory "
            "is not saved). Pass use_cache=False to run them planned. (Warned once.)",
        )


@torch.compiler.disable
def _said_redrawn(forward: PlannedForward) -> None:
    forward.notices.warn(
        f"masks:{forward.fqn}",
        f"lightning-sac: module {forward.fqn!r} runs under torch.compile, whose traced recompute cannot copy the "
        "plan's dropout masks back: its dropout noise is drawn again in recompute instead (exact, and less memory "
        "than planned, but more recompute). Plan with solve_plan(..., masks=False) for a compiled model; AutoSAC "
        "does. (Warned once.)",
    )
