"""The graph a graph-based AC region records: one node per op call, references between nodes, and leaves.

A node keeps how to recompute its op (the op, its arguments as :class:`Ref` to other nodes' outputs or
:class:`Leaf` tensors from outside the region, grad mode and generator state) or its saved outputs, and per
output how many consumers still need it. :mod:`lightning_sac.apply.graph.backend` records, packs and realizes them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Leaf", "Node", "Ref", "Refs", "RngState", "leaves", "map_args", "missing_ancestors", "rng_state"]


#: The CPU generator state and each CUDA device's, taken before a random op.
RngState = tuple[torch.Tensor, dict[int, torch.Tensor]]


def rng_state(args: Any, kwargs: Any) -> RngState:
    """The generator states a random op draws from: the CPU's, and each CUDA device's it runs on."""
    devices = {
        t.device.index or 0 for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.device.type == "cuda"
    }
    return torch.random.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in sorted(devices)}


class Leaf:
    """A tensor from outside every region, held as it is, with its version when the op read it."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = tensor._version


class Node:
    """One recorded op call: how to recompute it, or its saved outputs, and how many consumers still need each."""

    __slots__ = (
        "args",
        "cache",
        "func",
        "grad",
        "held",
        "kwargs",
        "mutates",
        "recomputable",
        "rng",
        "saved",
        "stale",
        "uses",
        "versions",
    )

    def __init__(
        self, func: Any, args: Any, kwargs: Any, mutates: list[int], rng: RngState | None, outputs: int
    ) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.mutates = mutates  # positions of flattened args the op writes to
        self.rng = rng  # generator state before a random op, to draw the same numbers again
        # Kernels may branch on grad mode, not only on their arguments (mkldnn_rnn_layer returns its workspace,
        # which its backward needs, only when grad mode is on): recompute under the mode the op ran under.
        self.grad = torch.is_grad_enabled()
        self.saved: list[torch.Tensor | None] | None = None
        # Per output: an in-place op in the region wrote to the saved output after it was saved.
        self.stale = [False] * outputs
        self.versions: list[int] = []  # saved outputs' versions when the region ended
        self.cache: list[torch.Tensor | None] | None = None
        self.uses = [0] * outputs  # per output: consumers that will still unpack it
        self.held = False  # a use of each input is taken, for a recompute that has not run yet
        self.recomputable = True


@dataclass(frozen=True)
class Ref:
    """One output (``index``) of a recorded node."""

    node: Node
    index: int


CONTAINERS = (tuple, list, dict)


def map_args(x: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` applied to every leaf of nested tuples, lists and dicts, the containers rebuilt."""
    # Called on every op's arguments: recurse only into containers, most arguments are tensors or scalars.
    if isinstance(x, (tuple, list)):
        return type(x)([map_args(v, fn) if isinstance(v, CONTAINERS) else fn(v) for v in x])
    if isinstance(x, dict):
        return {k: map_args(v, fn) if isinstance(v, CONTAINERS) else fn(v) for k, v in x.items()}
    return fn(x)


def leaves(x: Any) -> list[Any]:
    """The leaves of nested tuples, lists and dicts, in order."""
    if isinstance(x, (tuple, list)):
        return [leaf for v in x for leaf in (leaves(v) if isinstance(v, CONTAINERS) else (v,))]
    if isinstance(x, dict):
        return [leaf for v in x.values() for leaf in (leaves(v) if isinstance(v, CONTAINERS) else (v,))]
    return [x]


def missing_ancestors(node: Node, available: Callable[[Node, int], bool]) -> list[Node]:
    """The node's missing ancestors, each after its own missing inputs (a depth-first post-order).

    Missing: an input's node that is not ``available`` for that output, and so on up. Without recursion: a
    recurrent scan's ancestry is as deep as its sequence is long.
    """

    def missing(n: Node, visited: set[int]) -> list[tuple[Node, bool]]:
        return [
            (arg.node, False)
            for arg in reversed(leaves((n.args, n.kwargs)))
            if isinstance(arg, Ref) and id(arg.node) not in visited and not available(arg.node, arg.index)
        ]

    order: list[Node] = []
    visited: set[int] = {id(node)}
    stack = missing(node, visited)
    while stack:
        current, expanded = stack.pop()
        if expanded:
            order.append(current)
            continue
        if id(current) in visited:
            continue
        visited.add(id(current))
        stack.append((current, True))
        stack.extend(missing(current, visited))
    return order


class Refs:
    """Tensor -> the :class:`Ref` of the op that last wrote it, holding no tensor alive.

    A plain dict by ``id`` with a weak reference to check identity: every recorded op looks up each of its
    arguments, and ``WeakIdKeyDictionary`` costs several times more per lookup. Entries of dead tensors stay
    until the outermost region ends, when the whole table is dropped.
    """

    def __init__(self) -> None:
        self._table: dict[int, tuple[weakref.ref[torch.Tensor], Ref]] = {}

    def get(self, tensor: torch.Tensor) -> Ref | None:
        """The reference of the op that last wrote ``tensor``, or ``None`` for a tensor from outside the region."""
        entry = self._table.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None

    def __getitem__(self, tensor: torch.Tensor) -> Ref:
        ref = self.get(tensor)
        if ref is None:
            raise KeyError("this tensor was not made by an op recorded in the current graph_ac region")
        return ref

    def __setitem__(self, tensor: torch.Tensor, ref: Ref) -> None:
        self._table[id(tensor)] = (weakref.ref(tensor), ref)
