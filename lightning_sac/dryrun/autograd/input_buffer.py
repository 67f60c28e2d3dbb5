"""Autograd's input buffers: the gradient sums eager computes in place and the dry run cannot.

A tensor used several times in forward gets one gradient contribution per use, and the engine sums them in the
input buffer of the node that takes its gradient (``accumulate`` in torch's ``torch/csrc/autograd/input_buffer.cpp``,
called by ``InputBuffer::add`` once per contribution after the first, on every device). With grad mode off (no
``create_graph``) it sums in place, ``old.add_(new)``, when ``old``, the sum so far, is a strided tensor that is
not subclass-like, not a zero tensor and not nested, non-overlapping and dense, and the buffer holds the last
reference to it and to its storage (``can_accumulate_inplace``), and ``new`` is not subclass-like; otherwise
``old + new`` out of place (a sparse ``old`` takes ``new.add_(old)``, which this module leaves out of place).

Under any dispatch mode every tensor is subclass-like (``at::isTensorSubclassLike``), so in the dry run autograd always
sums out of place: a full-size tensor more than eager for each tensor with two or more contributions, alive at the
moment of the sum. :class:`InputBuffers` tells the recorder which of its sums eager computes in place, so that it
counts them as eager allocates them: not at all.

The sum has no context of its own: the engine runs it after a node's ``apply`` returned and before the next node
runs, while that node is still the current one. A post hook on every node of the graph marks that moment. The
graph is hooked at the first op of each backward pass, from the node running it (a pass's root, or with several
roots, ``torch.autograd.backward([a, b])``, the first one that runs an op: the others' sums stay out of place).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle

__all__ = ["InputBuffers"]

_ADD = torch.ops.aten.add.Tensor
_ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"  # the node that writes a leaf's .grad
# The tensors eager runs as plain tensors: the fake ones, and the batch values kept real (dryrun/values/).
_PLAIN = (FakeTensor, torch.Tensor)


class InputBuffers:
    """Finds the gradient sums of autograd's input buffers that eager computes in place.

    Call :meth:`watch` on every op of a backward phase, and :meth:`summed_in_place` to ask about one.

    Args:
        handles: Where the post hooks' handles go, to be removed with the recorder's.
    """

    def __init__(self, handles: list[RemovableHandle]) -> None:
        self.handles = handles
        self._passes: set[int] = set()  # the graph tasks (backward passes) whose graph is hooked
        self._summing: Node | None = None  # the node whose outputs the engine adds to input buffers now
        self._outputs: Counter[int] = Counter()  # how many of that node's outputs each tensor (by id) is

    def watch(self) -> None:
        """Hook the graph of the backward pass running this op, if it is a new one."""
        task = torch._C._current_graph_task_id()
        if task == -1 or task in self._passes:
            return
        self._passes.add(task)
        root = torch._C._current_autograd_node()
        if root is None:
            return
        for node in _nodes(root):
            # Not AccumulateGrad: it moves its gradient into .grad when it holds the last reference, and a post hook
            # makes the engine keep a copy of a node's inputs (it would copy the gradient instead). It sends no
            # gradient on, so it has no sums to mark either.
            if node.name() != _ACCUMULATE_GRAD:
                self.handles.append(node.register_hook(self._outputs_ready))

    def done(self) -> None:
        """Forget the node last run (a backward pass ended): the recorder must not keep its graph alive."""
        self._summing = None
        self._outputs.clear()

    def _outputs_ready(self, outputs: Sequence[torch.Tensor | None], _inputs: Sequence[torch.Tensor | None]) -> None:
        # Ids only: a reference held here would count in the use counts that summed_in_place reads.
        self._summing = torch._C._current_autograd_node()
        self._outputs = Counter(id(t) for t in outputs if t is not None)

    def summed_in_place(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
        """The sum so far, if ``func`` is the engine summing two gradient contributions and eager adds in place.

        Call it before the op runs. The op's result is then, in eager, the returned tensor itself.
        """
        if func is not _ADD or kwargs or len(args) != 2 or self._summing is None:
            return None
        if torch._C._current_autograd_node() is not self._summing:
            self.done()  # another node runs: the last one's sums are over
            return None
        old, new = args
        if torch.is_grad_enabled() or type(old) not in _PLAIN or type(new) not in _PLAIN:
            return None
        if old.layout != torch.strided or old.is_nested or old._is_zerotensor():
            return None
        if not _non_overlapping_and_dense(old) or _storage_holders(old) != 1:
            return None
        # The same calls passed both tensors here, so each holds as many references more than in eager. In eager,
        # `new` is held by each of the node's outputs that it is (those before it moved into buffers, those after it
        # still in the outputs); what `old` has besides is what eager has besides the buffer's.
        extra = new._use_count() - self._outputs[id(new)]
        return old if old._use_count() - extra == 1 else None


def _non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Whether some order of ``t``'s dimensions is contiguous (c10's ``compute_non_overlapping_and_dense``)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz >= 2):
        if stride != expected:
            return False
        expected *= size
    return True


def _storage_holders(t: torch.Tensor) -> int:
    """How many tensors hold ``t``'s storage (the storage object asked for holds it once more while it lives)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1


def _nodes(root: Node) -> Iterator[Node]:
    """Every node of the graph ``root`` reaches, ``root`` first."""
    seen, stack = {root}, [root]
    while stack:
        node = stack.pop()
        yield node
        for fn, _ in node.next_functions:
            if fn is not None and fn not in seen:
                seen.add(fn)
                stack.append(fn)
