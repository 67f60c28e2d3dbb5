"""The step recorder's module hooks: where each module's forward and backward begin and end, and what they hold.

Forward pre- and post-hooks open and close a module's first call: its inputs and outputs, its slice of the
recorder's op list, its memory snapshots and forward peak. :class:`BackwardSignals` tell when its backward
begins (a descendant's gradient flows) and ends (its inputs' or parameters' gradients are complete). The op
dispatch that fills the op list and counts memory is :class:`~lightning_sac.dryrun.recorder.StepRecorder`,
which mixes these hooks in.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_sac.devices import DeviceSpec
from lightning_sac.dryrun.data import MemorySnapshot, ModuleProfile, TimelineEvent
from lightning_sac.dryrun.memory import LiveMemory, PeakWatch
from lightning_sac.dryrun.modules.backward_signals import BackwardSignals
from lightning_sac.dryrun.modules.inputs import input_spec
from lightning_sac.dryrun.op_graph import OpGraph
from lightning_sac.dryrun.step import tensors_of

__all__ = ["ModuleHooks", "ModuleState", "history_tensors", "stored_state"]


def history_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Each attribute of ``module`` holding a tensor with a gradient history (or a list or tuple of them), and it."""
    for name, value in vars(module).items():
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                yield name, t


def stored_state(module: nn.Module) -> str | None:
    """An attribute of ``module`` that holds a tensor with a gradient history (:func:`history_tensors`).

    Set by its forward: the module keeps state computed from its inputs (RecurrentGemma's RG-LRU stores its last
    ``recurrent_states`` and starts the next call from them). A checkpoint's recompute reruns the forward on the
    state the forward left, not the one it began with, and stores it again: the recomputed values, and the ops
    run, need not be the forward's. A cache of constants (rotary embeddings' cos and sin) has no history.
    """
    return next((name for name, _ in history_tensors(module)), None)


@dataclass
class ModuleState:
    """What the hooks know of one module: its profile so far, its op slice, open peaks and backward progress."""

    profile: ModuleProfile
    n_inputs: int = 0
    op_start: int = 0
    op_end: int = 0
    pack_start: int = 0
    pack_end: int = 0
    fwd_start_ms: float = 0.0
    fwd_watch: PeakWatch | None = None
    bwd_start_ms: float | None = None
    bwd_watch: PeakWatch | None = None
    bwd_done: bool = False
    bwd_pass: int = 0
    force_store_random: bool = False
    output_keys: set[tuple[int, int]] = field(default_factory=set)
    has_parameters: bool = False
    snapshots: dict[str, MemorySnapshot] = field(default_factory=dict)


class ModuleHooks:
    """Per-module forward and backward bookkeeping of a step recorder; :meth:`modules` gives the profiles.

    A mix-in: the recorder provides the step's phase and clock, its memory accounting, op graph and timeline
    (the attributes declared below, :meth:`_event` and :meth:`_key`) and calls :meth:`_hook_modules`.
    """

    phase: str
    cum_ms: float
    spec: DeviceSpec
    memory: LiveMemory
    graph: OpGraph
    orders: dict[str, list[str]]
    _handles: list[RemovableHandle]
    _saved: set[tuple[int, int]]
    timeline: list[TimelineEvent]

    def _event(self, kind: str, name: str) -> None:
        raise NotImplementedError  # the recorder's timeline

    def _key(self, storage: torch.UntypedStorage) -> tuple[int, int]:
        raise NotImplementedError  # the recorder's storage identity

    def _module_frees(self, key: int, nbytes: int) -> None:
        """Note the free of storage ``key`` in the profiles of the modules a checkpoint of which it concerns.

        An input (or output) freed after its module's forward and before its backward is over: a checkpoint would
        keep it (``freed_inputs``). The free gets an event of its own: the interval before it still holds the
        storage, the one after not.
        """
        event: int | None = None

        def at(fqn: str) -> int:
            nonlocal event
            if event is None:
                self._event("free", fqn)
                event = len(self.timeline) - 1
            return event

        for table, field_name in ((self._input_of, "freed_inputs"), (self._output_of, "freed_outputs")):
            for fqn in table.pop(key, ()):
                st = self._states[fqn]
                if "post_forward" in st.snapshots and not st.bwd_done:
                    getattr(st.profile, field_name).append([at(fqn), nbytes])

    def _hook_modules(self, model: nn.Module) -> None:
        """Start the bookkeeping and add the forward hooks to every module of ``model`` (into ``_handles``)."""
        self._states: dict[str, ModuleState] = {}
        self._stack: list[str] = []  # modules whose forward is running, innermost last
        self._bwd_open: list[str] = []  # modules whose backward has begun and not ended
        self._backward_pass = 0  # how many backward passes the step has begun (a manual step can run several)
        self._input_of: dict[int, list[str]] = {}  # storage id -> modules whose first call took it as input
        self._output_of: dict[int, list[str]] = {}  # storage id -> modules whose first call returned it
        #: Per fqn, the layout of the first forward call's inputs (for measuring modules for real).
        self.input_specs: dict[str, Any] = {}
        #: Per fqn, an attribute its forward stored a tensor with a gradient history in (:func:`stored_state`).
        self.module_state: dict[str, str] = {}
        #: Per fqn, the first op that wrote in place to an input of its call while it ran (:meth:`_writes`).
        self.writes_input: dict[str, str] = {}
        self._signals = BackwardSignals(self._begin_backward, self._handles)
        for fqn, module in model.named_modules():
            is_leaf = next(module.children(), None) is None
            self._states[fqn] = ModuleState(ModuleProfile(fqn=fqn, module_type=type(module).__name__, is_leaf=is_leaf))
            self._states[fqn].has_parameters = next(module.parameters(), None) is not None
            self._handles.append(module.register_forward_pre_hook(self._make_pre(fqn), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._make_post(fqn), with_kwargs=True))

    def _writes(self, written: list[torch.Tensor], name: str) -> None:
        """Note the running modules whose call's inputs op ``name`` writes in place.

        Mixtral's sparse MoE block multiplies its input by router jitter in place: a checkpoint of the block keeps
        that input to rerun the block from, and its recompute would start from the written values (torch's
        checkpoint then fails in backward, or worse).
        """
        for t in written:
            for fqn in self._input_of.get(id(t.untyped_storage()), ()):
                if fqn in self._stack:
                    self.writes_input.setdefault(fqn, name)

    def _storage_bytes(self, tensors: list[torch.Tensor]) -> int:
        seen = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
        return sum(self.spec.round_bytes(n) for n in seen.values())

    def _make_pre(self, fqn: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self.phase != "forward":
                return  # a checkpoint of the model's own recomputes it in backward: not a call of the step
            st = self._states[fqn]
            st.profile.calls += 1
            self._stack.append(fqn)
            self._event("fwd_pre", fqn)
            st.fwd_start_ms = self.cum_ms
            if st.profile.calls > 1:
                return
            inputs = tensors_of((args, kwargs))
            self.input_specs[fqn] = input_spec((args, kwargs))
            st.n_inputs = len(inputs)
            st.profile.input_bytes = self._storage_bytes(inputs)
            for key in {id(t.untyped_storage()) for t in inputs}:
                self._input_of.setdefault(key, []).append(fqn)
            st.force_store_random = not inputs
            st.snapshots["pre_forward"] = self.memory.snapshot()
            st.fwd_watch = self.memory.open_watch()
            st.op_start = len(self.graph.ops)
            if self.memory.trace is not None:
                self.memory.trace.trace.module_ops[fqn] = st.op_start
            st.pack_start = len(self.graph.packs)
            # Backward of this module is over once autograd has the gradients of its inputs, or, when no
            # input needs one (token ids), of its parameters.
            targets = [t for t in inputs if t.requires_grad] or [p for p in module.parameters() if p.requires_grad]
            self._signals.when_all_grads(fqn, targets, lambda: self._end_backward(fqn))

        return hook

    def _make_post(self, fqn: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if self.phase != "forward":
                return
            st = self._states[fqn]
            self._stack.pop()
            self._event("fwd_post", fqn)
            if fqn not in self.module_state and (name := stored_state(module)) is not None:
                self.module_state[fqn] = name
            st.profile.forward_ms += self.cum_ms - st.fwd_start_ms
            if st.profile.calls > 1 or st.fwd_watch is None:
                return
            outputs = tensors_of(output)
            st.profile.output_bytes = self._storage_bytes(outputs)
            st.output_keys = {self._key(t.untyped_storage()) for t in outputs}
            for key in {id(t.untyped_storage()) for t in outputs}:
                self._output_of.setdefault(key, []).append(fqn)
            st.snapshots["post_forward"] = self.memory.snapshot()
            st.snapshots["peak_forward"] = st.fwd_watch.peak_snapshot
            self.memory.close_watch(st.fwd_watch)
            st.op_end = len(self.graph.ops)
            st.pack_end = len(self.graph.packs)
            for t in outputs:
                if t.requires_grad:
                    self._signals.produced(fqn, t)

        return hook

    def _begin_backward(self, fqn: str) -> None:
        st = self._states[fqn]
        if not st.profile.calls:
            return
        if st.bwd_start_ms is not None:
            if st.bwd_done and st.bwd_pass != self._backward_pass:
                self._begin_again(fqn)
            return
        st.bwd_pass = self._backward_pass
        # Several modules can return the same tensor (the root and its LM head); a module's backward has
        # begun once any of its descendants' has, so ancestors begin first.
        if fqn:
            self._begin_backward(fqn.rpartition(".")[0])
        self._event("bwd_pre", fqn)
        st.bwd_start_ms = self.cum_ms
        st.snapshots["pre_backward"] = self.memory.snapshot()
        st.bwd_watch = self.memory.open_watch()
        self._bwd_open.append(fqn)

    def _begin_again(self, fqn: str) -> None:
        """A later backward pass runs through the module's graph, which an earlier one kept (retain_graph=True).

        The timeline gets the module's ``bwd_pre`` and ``bwd_post`` again, so that the solver can tell: a checkpoint
        of it would recompute in each pass and keep its inputs from one to the next, which the memory model of
        one backward does not describe (:func:`~lightning_sac.solver.candidates.excluded_reason`). Its profile keeps
        the first backward's figures.
        """
        st = self._states[fqn]
        if fqn:
            self._begin_backward(fqn.rpartition(".")[0])
        st.bwd_done, st.bwd_pass = False, self._backward_pass
        self._event("bwd_pre", fqn)
        self._bwd_open.append(fqn)

    def _end_backward(self, fqn: str) -> None:
        st = self._states[fqn]
        if st.bwd_done or st.bwd_start_ms is None:
            return
        # A child whose end autograd never signals (its inputs and parameters need no grad) ends with it.
        prefix = f"{fqn}." if fqn else ""
        for child in [c for c in self._bwd_open if c != fqn and c.startswith(prefix)]:
            self._end_backward(child)
        st.bwd_done = True
        self._event("bwd_post", fqn)
        if "post_backward" in st.snapshots:  # a later pass's end (see _begin_again)
            self._bwd_open.remove(fqn)
            return
        st.profile.backward_ms = self.cum_ms - st.bwd_start_ms
        st.snapshots["post_backward"] = self.memory.snapshot()
        assert st.bwd_watch is not None
        st.snapshots["peak_backward"] = st.bwd_watch.peak_snapshot
        self.memory.close_watch(st.bwd_watch)
        self._bwd_open.remove(fqn)

    # ----------------------------------------------------------------- results
    def modules(self) -> dict[str, ModuleProfile]:
        """Per-module profiles, in forward pre-order, with snapshots and op stats filled in.

        Op stats are for non-leaf modules, and for leaf modules with parameters that run several ops that allocate
        memory (``nn.LSTM``, a fused attention layer): what a plan can checkpoint.
        """
        out: dict[str, ModuleProfile] = {}
        order = list(dict.fromkeys(self.orders["fwd_pre"]))
        order += [f for f in self._states if f not in out and f not in order]
        for fqn in order:
            st = self._states[fqn]
            for phase, snap in st.snapshots.items():
                st.profile.memory[phase] = snap
            if st.profile.calls and (not st.profile.is_leaf or st.has_parameters):
                stats = self.graph.module_stats(
                    (st.op_start, st.op_end),
                    (st.pack_start, st.pack_end),
                    self._saved,
                    st.force_store_random,
                    st.output_keys,
                )
                # A leaf with weights that runs several allocating ops (an LSTM) can be checkpointed on its own; one
                # op (a Linear, a norm) cannot be split, and its op stats would only grow the profile.
                if not st.profile.is_leaf or sum(1 for m in stats.memory if m > 0) >= 2:
                    st.profile.op_stats = stats
            out[fqn] = st.profile
        return out
