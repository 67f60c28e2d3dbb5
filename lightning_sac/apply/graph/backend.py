"""Graph-based activation checkpointing: recompute only the missing ancestors of what backward unpacks.

Inside a region every op is recorded as a node of a graph (the op, its inputs as references to other nodes'
outputs, and whether grad mode was on; tensors from outside the region are leaves). A node the policy saves
keeps its outputs (detached); the others keep only how to recompute them. Tensors autograd saves for backward
are packed as references to one output of a node. Freshness is per output: a saved output that an in-place op
overwrites afterwards is stale, and only a consumer of a stale (or unsaved) output makes the node recompute;
its other saved outputs are still served as they are. Unpacking realizes the output, recursively recomputing
only the missing ancestors and caching them; per-output use counts, taken at pack time along the same
recursion (and when an output that was packed goes stale), free each cached or saved tensor as soon as its last
user has consumed it. Unlike module-bounded checkpoints, nothing outside the needed ancestry is ever
recomputed, and nothing is recomputed twice in one backward.

How nested regions' policies combine is in :mod:`lightning_sac.apply.graph.policy`; the recorded graph's nodes
are in :mod:`lightning_sac.apply.graph.nodes`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from lightning_sac.apply.graph.nodes import Leaf, Node, Ref, Refs, leaves, map_args, missing_ancestors, rng_state
from lightning_sac.apply.graph.policy import (
    POLICY_SHORTCUTS,
    SAVE_DECISIONS,
    PolicyContext,
    PolicyFn,
    compose_policies,
)
from lightning_sac.apply.graph.writes import Versions, from_outside, read_later, writable_copies, written_storages
from lightning_sac.apply.planned import CallState, PlannedForward
from lightning_sac.ops import is_random, is_sac_ignored, mutated_tensors

__all__ = [
    "GraphCheckpointForward",
    "PolicyContext",
    "PolicyFn",
    "compose_policies",
    "recompute_count",
    "save_recompute_policy",
]


class _Graph:
    """Recording (a dispatch mode) and packing (saved-tensor hooks) for the regions of one thread."""

    def __init__(self) -> None:
        self.policies: list[tuple[PolicyFn, list[int]]] = []  # (policy, [op counter of its region])
        self.refs = Refs()  # tensor -> Ref of the op that last wrote it
        self.versions = Versions()  # written storage -> Ref of its latest version
        self.mode: _RecordMode | None = None
        self.hooks: Any = None
        self.recomputes = 0  # op calls made by recompute, for tests and diagnostics
        self.recomputing = False  # a backward run inside a region must not record its recompute
        # (node, output index) of the saved outputs that live on each storage. Version counters cannot tell
        # staleness inside the region: autograd bumps an in-place op's version only after the dispatch mode has
        # returned.
        self.saved_on: dict[int, list[tuple[Node, int]]] = {}

    # ------------------------------------------------------------------ recording
    def record(self, func: Any, args: Any, kwargs: Any) -> Any:
        if self.recomputing:
            return func(*args, **kwargs)
        ignored = is_sac_ignored(func)
        answers = []
        if not ignored:
            for policy, counter in self.policies:
                answers.append(policy(PolicyContext(counter[0]), func, *args, **kwargs))
                counter[0] += 1
        decision = compose_policies(answers) if not ignored else CheckpointPolicy.PREFER_RECOMPUTE
        rng = rng_state(args, kwargs) if is_random(func, args, kwargs) else None
        out = func(*args, **kwargs)
        written = {id(t) for t in mutated_tensors(func, args, kwargs)}
        flat_args = leaves((args, kwargs)) if written else []
        mutates = [i for i, a in enumerate(flat_args) if isinstance(a, torch.Tensor) and id(a) in written]

        for i in mutates:
            # Only the outputs on the written storage are stale: the node's others are still served as saved.
            for earlier, index in self.saved_on.get(id(flat_args[i].untyped_storage()), []):
                self._mark_stale(earlier, index)
        outputs = [o if isinstance(o, torch.Tensor) else None for o in leaves(out)]
        node_args, node_kwargs = map_args(args, self._ref_of), map_args(kwargs, self._ref_of)
        # A write changes its whole storage: the node also produces the new value of each storage it writes
        # (apply.graph_writes), which every tensor on that storage resolves to from now on.
        versions = written_storages(flat_args, mutates, leaves((node_args, node_kwargs)))
        node = Node(func, node_args, node_kwargs, mutates, rng, len(outputs) + len(versions))
        # An op writing to a tensor from outside the region (BatchNorm's running stats) must not run twice.
        if mutates:
            refs = leaves((node.args, node.kwargs))
            node.recomputable = not any(from_outside(refs[i]) for i in mutates)
        produced = outputs + versions
        if decision in SAVE_DECISIONS or not node.recomputable:
            node.saved = [None if o is None else o.detach() for o in produced]
            for index, o in enumerate(produced):
                if o is not None:
                    self.saved_on.setdefault(id(o.untyped_storage()), []).append((node, index))
        for i, o in enumerate(outputs):
            if o is not None:
                self.refs[o] = Ref(node, i)
        if node.recomputable:
            for j, t in enumerate(versions):
                self.versions.set(t, Ref(node, len(outputs) + j))
        return out

    def _ref_of(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if self.versions:
            resolved = self.versions.resolve(x)
            if resolved is not None:  # its storage was written: its own view of the latest version
                view, new = resolved
                version = view.node.args[0] if new else None
                if version is not None and self._fresh(version.node, version.index):
                    # The version is kept as it is: so is this view of it, which costs no memory.
                    view.node.saved = [x.detach()]
                    self.saved_on.setdefault(id(x.untyped_storage()), []).append((view.node, 0))
                return view
        ref = self.refs.get(x)
        return ref if ref is not None else Leaf(x)

    # ------------------------------------------------------------------ packing
    def _acquire(self, ref: Ref) -> None:
        # Without recursion: a recurrent scan's ancestry is as deep as its sequence is long.
        todo = [ref]
        while todo:
            ref = todo.pop()
            node = ref.node
            node.uses[ref.index] += 1
            if not node.held and not self._available(node, ref.index):
                node.held = True  # once per recompute, however many of the node's outputs it serves
                todo.extend(arg for arg in leaves((node.args, node.kwargs)) if isinstance(arg, Ref))

    def _hold(self, node: Node) -> None:
        node.held = True
        for arg in leaves((node.args, node.kwargs)):
            if isinstance(arg, Ref):
                self._acquire(arg)

    def _mark_stale(self, node: Node, index: int) -> None:
        node.stale[index] = True
        # Consumers packed this output while it was fresh and took no use of the node's inputs: the recompute
        # they now need does.
        if node.uses[index] > 0 and not node.held:
            self._hold(node)

    @staticmethod
    def _fresh(node: Node, index: int) -> bool:
        # A saved output mutated in place after it was saved no longer holds the value the op produced.
        saved = node.saved[index] if node.saved is not None else None
        if saved is None or node.stale[index]:
            return False
        return index >= len(node.versions) or saved._version == node.versions[index]

    @staticmethod
    def _available(node: Node, index: int) -> bool:
        return _Graph._fresh(node, index) or (node.cache is not None and node.cache[index] is not None)

    def pack(self, tensor: torch.Tensor) -> Any:
        ref = self._ref_of(tensor)
        if not isinstance(ref, Ref):
            return tensor
        self._acquire(ref)
        return ref

    # ------------------------------------------------------------------ unpacking
    def _compute(self, node: Node) -> list[torch.Tensor | None]:
        if not node.recomputable:
            raise RuntimeError(
                f"graph_ac cannot recompute {node.func}: it writes to a tensor from outside the region and a saved "
                "output that backward needs was modified in place afterwards. Save the op that modifies it."
            )

        def value(x: Any) -> Any:
            if isinstance(x, Ref):
                return self._realize(x)
            if isinstance(x, Leaf):
                if x.tensor._version != x.version:
                    raise RuntimeError(
                        f"graph_ac cannot recompute {node.func}: its input from outside the region was modified "
                        "in place after the op read it. Save this op (return MUST_SAVE for it)."
                    )
                # Detached, so that running under grad mode records no autograd graph onto parameters.
                return x.tensor.detach() if node.grad and x.tensor.requires_grad else x.tensor
            return x

        args, kwargs = map_args(node.args, value), map_args(node.kwargs, value)
        written: list[torch.Tensor] = []
        if node.mutates:
            # Never write into a cached or saved tensor other consumers may still read: write into a copy.
            flat, refs = leaves((args, kwargs)), leaves((node.args, node.kwargs))
            copies = writable_copies(flat, node.mutates, frozenset(i for i in node.mutates if read_later(refs[i])))
            args, kwargs = map_args(
                (args, kwargs), lambda t: copies.get(id(t), t) if isinstance(t, torch.Tensor) else t
            )
            written = written_storages(leaves((args, kwargs)), node.mutates, leaves((node.args, node.kwargs)))
        self.recomputes += 1
        self.recomputing = True
        try:
            # Inputs are detached, saved or recomputed tensors: none requires grad, so grad mode records nothing.
            with torch.set_grad_enabled(node.grad):
                if node.rng is not None:
                    cpu_state, cuda_states = node.rng
                    with torch.random.fork_rng(devices=list(cuda_states)):
                        torch.random.set_rng_state(cpu_state)
                        for device, state in cuda_states.items():
                            torch.cuda.set_rng_state(state, device)
                        out = node.func(*args, **kwargs)
                else:
                    out = node.func(*args, **kwargs)
        finally:
            self.recomputing = False
        return [o if isinstance(o, torch.Tensor) else None for o in leaves(out)] + written

    def _fill(self, node: Node, index: int = -1) -> None:
        """Recompute ``node`` and cache the outputs consumers still need (``index``: the one asked for)."""
        if not node.held:
            # Code after the region overwrote this saved output, or a second backward needs one already
            # freed: no use of the inputs was taken for it at pack time.
            self._hold(node)
        outputs = self._compute(node)
        node.held = False  # the recompute consumed its uses of the inputs
        # Cache only the outputs consumers still need that the saved copies cannot serve.
        node.cache = [
            o if i == index or (node.uses[i] > 0 and not self._fresh(node, i)) else None for i, o in enumerate(outputs)
        ]

    def _realize(self, ref: Ref) -> torch.Tensor:
        node, index = ref.node, ref.index
        result: torch.Tensor | None
        if self._fresh(node, index):
            assert node.saved is not None
            result = node.saved[index]
        else:
            if node.cache is None or node.cache[index] is None:
                # Deepest first, so that each recompute finds its inputs ready: no recursion along a long chain.
                for ancestor in missing_ancestors(node, self._available):
                    self._fill(ancestor)
                self._fill(node, index)
            assert node.cache is not None
            result = node.cache[index]
        if result is None:
            raise RuntimeError(
                f"graph_ac: recomputing {node.func} did not produce its output {index} that backward needs."
            )
        node.uses[index] -= 1
        if node.uses[index] <= 0:  # its last consumer has it: free it, the node's other outputs may live on
            if node.cache is not None:
                node.cache[index] = None
                if not any(c is not None for c in node.cache):
                    node.cache = None
            if node.saved is not None:
                node.saved[index] = None
        return result

    def unpack(self, packed: Any) -> torch.Tensor:
        return self._realize(packed) if isinstance(packed, Ref) else packed

    # ------------------------------------------------------------------ regions
    def push(self, policy: PolicyFn) -> None:
        if not self.policies:
            self.mode = _RecordMode(self)
            self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            self.hooks.__enter__()
            self.mode.__enter__()
        self.policies.append((policy, [0]))

    def pop(self) -> None:
        self.policies.pop()
        if not self.policies:
            assert self.mode is not None
            self.mode.__exit__(None, None, None)
            self.hooks.__exit__(None, None, None)
            self.mode = None
            self.refs = Refs()
            self.versions = Versions()
            for entries in self.saved_on.values():
                for node, index in entries:
                    if node.saved is None:
                        continue
                    # A saved output no packed tensor nor recompute reads (a rotary embedding's pieces before their
                    # saved cat) is never unpacked: let it go now, not when backward drops the graph (a DeepSeek-V3
                    # attention's backward held them, 0.24 MiB over the plan), unless it cannot be recomputed.
                    if node.recomputable and not node.held and node.uses[index] == 0:
                        node.saved[index] = None
                    # From here on, version counters tell whether code after the region mutates a saved output.
                    if not node.versions:
                        node.versions = [-1 if t is None else t._version for t in node.saved]
            self.saved_on.clear()


class _RecordMode(TorchDispatchMode):
    def __init__(self, graph: _Graph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return self.graph.record(func, args, kwargs or {})


_local = threading.local()


def _graph() -> _Graph:
    if not hasattr(_local, "graph"):
        _local.graph = _Graph()
    graph: _Graph = _local.graph
    return graph


@contextmanager
def save_recompute_policy(policy_fn: PolicyFn | str) -> Iterator[None]:
    """Record the ops run inside as a graph region whose saves and recomputes ``policy_fn`` decides.

    Args:
        policy_fn: ``policy(ctx: PolicyContext, func, *args, **kwargs) -> CheckpointPolicy | bool``, or
            ``"recompute_all"`` (``PREFER_RECOMPUTE``) or ``"must_save_all"`` (``MUST_SAVE``).
    """
    if isinstance(policy_fn, str):
        if policy_fn not in POLICY_SHORTCUTS:
            raise ValueError(
                f"Unknown policy shortcut {policy_fn!r}; use one of {sorted(POLICY_SHORTCUTS)} or a callable."
            )
        policy_fn = POLICY_SHORTCUTS[policy_fn]
    graph = _graph()
    graph.push(policy_fn)
    try:
        yield
    finally:
        graph.pop()


def recompute_count() -> int:
    """Op calls graph recompute has made on this thread (to check that nothing is recomputed twice)."""
    return _graph().recomputes


class GraphCheckpointForward(PlannedForward):
    """A module's forward run as a graph region with a plan's per-op decisions (the ``"graph"`` backend)."""

    def run(self, state: CallState, /, *args: Any, **kwargs: Any) -> Any:
        """Run the forward inside a graph region whose policy is :meth:`PlannedForward.decide`."""
        with save_recompute_policy(lambda ctx, func, *a, **k: self.decide(state, func, a, k)):
            return self.inner(*args, **kwargs)
