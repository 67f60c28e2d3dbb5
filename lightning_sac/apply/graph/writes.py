"""Writes in a graph-based AC region: every tensor on a written storage resolves to a value with all its writes.

An op that writes in place (``add_`` on a tensor, ``copy_`` into ``buf[:, t]``, ``index_put_``, ``scatter_``,
``masked_fill_`` on a view, an ``as_strided`` write) changes the whole storage it writes, and every tensor that
aliases that storage sees the change: the buffer a loop fills slice by slice, and views taken before the write.
So a written storage gets versions: the write's node produces, besides the op's own outputs, the new value of the
whole storage (recomputed by writing into a copy of the previous version's storage, the same layout), and from then
on any tensor on that storage resolves to a view (:class:`StorageView`) of its latest version, with its own size,
strides and offset. A recompute of what reads the buffer thus replays its producer and then every write, in order.

The copy costs nothing where the previous version is the recompute's own and nothing else holds it
(:func:`writable_copies`): a loop of slice writes is replayed in place into one buffer, as the forward filled it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from lightning_sac.apply.graph.nodes import Leaf, Node, Ref, leaves
from lightning_sac.ops import is_view_like

__all__ = ["StorageView", "Versions", "from_outside", "read_later", "writable_copies", "written_storages"]


class StorageView:
    """The op of an alias node: a tensor's own view (size, strides, offset) of its storage's latest version."""

    __slots__ = ("dtype", "offset", "size", "stride")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.size = tuple(tensor.size())
        self.stride = tuple(tensor.stride())
        self.offset = tensor.storage_offset()
        self.dtype = tensor.dtype

    @property
    def key(self) -> tuple[Any, ...]:
        """What tells two views of one storage apart."""
        return self.size, self.stride, self.offset, self.dtype

    def __call__(self, version: torch.Tensor) -> torch.Tensor:
        """This view of ``version``'s storage (the same layout as the storage it was taken of)."""
        if version.dtype == self.dtype:
            return version.as_strided(self.size, self.stride, self.offset)
        # Another dtype on the same storage (a view(dtype)): the same bytes, read as this view's elements.
        return torch.empty(0, dtype=self.dtype, device=version.device).set_(
            version.untyped_storage(), self.offset, self.size, self.stride
        )

    def __repr__(self) -> str:
        return f"storage_view(size={self.size}, stride={self.stride}, offset={self.offset}, dtype={self.dtype})"


class Versions:
    """Storage -> the :class:`Ref` of its latest version, for the storages written inside the region.

    Keyed by the storage's ``id`` with a weak reference to check identity, like
    :class:`~lightning_sac.apply.graph.nodes.Refs`; the whole table is dropped when the outermost region ends.
    """

    def __init__(self) -> None:
        # storage id -> (the storage, its latest version, that version's own view)
        self._table: dict[int, tuple[weakref.ref[torch.UntypedStorage], Ref, tuple[Any, ...]]] = {}
        self._views: dict[tuple[int, int, tuple[Any, ...]], Ref] = {}  # one alias node per version and view

    def __bool__(self) -> bool:
        return bool(self._table)

    def set(self, tensor: torch.Tensor, ref: Ref) -> None:
        """``ref`` (whose value is ``tensor``'s view of its storage) is now the latest version of that storage."""
        storage = tensor.untyped_storage()
        self._table[id(storage)] = (weakref.ref(storage), ref, StorageView(tensor).key)

    def resolve(self, tensor: torch.Tensor) -> tuple[Ref, bool] | None:
        """``tensor`` as a view of its storage's latest version, and whether its alias node is new.

        ``None`` when nothing in the region wrote that storage. The version itself when ``tensor`` is that
        version's own view; otherwise an alias node, one per version and view.
        """
        storage = tensor.untyped_storage()
        entry = self._table.get(id(storage))
        if entry is None or entry[0]() is not storage:
            return None
        _, version, own = entry
        view = StorageView(tensor)
        if view.key == own:
            return version, False
        key = (id(version.node), version.index, view.key)
        ref = self._views.get(key)
        if ref is not None:
            return ref, False
        ref = self._views[key] = Ref(Node(view, (version,), {}, [], None, 1), 0)
        return ref, True


def _holders(storage: torch.UntypedStorage, tensors: list[torch.Tensor]) -> int:
    """How many tensor objects among ``tensors`` (and the bases they keep alive) hold ``storage``."""
    held: set[int] = set()
    for t in tensors:
        if t.untyped_storage() is storage:
            held.add(id(t))
            if t._base is not None:
                held.add(id(t._base))
    return len(held)


def writable_copies(
    flat: list[Any], written: list[int], read_later: frozenset[int] = frozenset()
) -> dict[int, torch.Tensor]:
    """For each written argument (its ``id``), a tensor of the same view on a storage the recompute may write.

    A storage no tensor outside ``flat`` holds (the recompute's own previous version, freed by its last consumer)
    is written as it is; any other (a saved tensor, a cached version another consumer still reads) is copied
    first, keeping its layout so that every view's offsets still hold. Arguments on one storage share one copy.
    ``read_later``: positions of written arguments the graph knows other consumers still read (a cached output
    is the very tensor object the recompute got, which the storage's use count cannot tell apart).
    """
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    storages: dict[int, torch.UntypedStorage] = {}
    copies: dict[int, torch.Tensor] = {}
    for i in written:
        t = flat[i]
        storage = t.untyped_storage()
        if id(storage) not in storages:
            # The use count holds the tensors' references and the one of the storage object we hold here.
            shared = i in read_later or torch._C._storage_Use_Count(storage._cdata) > _holders(storage, tensors) + 1
            storages[id(storage)] = storage.clone() if shared else storage
        target = storages[id(storage)]
        if target is storage:
            copies[id(t)] = t
        else:
            copies[id(t)] = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                target, t.storage_offset(), t.size(), t.stride()
            )
    return copies


def read_later(ref: Any) -> bool:
    """Whether a consumer other than the one recomputing now still reads ``ref``'s value, or what it views.

    ``w /= w.sum()``: autograd keeps a clone of ``w`` taken before the write (the divisor's gradient reads it),
    and the clone's recompute reads the same cached output of ``w``'s maker as the write's: written in place,
    the clone would read the divided values (gradients off by orders of magnitude).
    """
    while isinstance(ref, Ref):
        node = ref.node
        if node.uses[ref.index] > 0 or (node.saved is not None and node.saved[ref.index] is not None):
            return True
        if not (isinstance(node.func, StorageView) or is_view_like(node.func)):
            return False
        ref = leaves((node.args, node.kwargs))[0]  # a view's first argument is the tensor it views
    return False


def from_outside(ref: Any) -> bool:
    """Whether a written argument's storage comes from outside the region.

    A leaf; a view (a chain of views) the region took of one (``x[:, 0] = y`` on the module's input); or the
    output of an op that already wrote outside (``x.mul_(2)``), which is saved and never rerun.
    """
    while isinstance(ref, Ref):
        if not ref.node.recomputable:
            return True
        if not is_view_like(ref.node.func):
            return False
        ref = leaves((ref.node.args, ref.node.kwargs))[0]  # a view op's first argument is the tensor it views
    return isinstance(ref, Leaf)


def written_storages(flat_args: list[Any], mutates: list[int], refs: list[Any]) -> list[torch.Tensor]:
    """One written argument per storage an op writes inside the region, in order.

    Not those from outside the region (:func:`from_outside`): such an op is saved and never rerun.
    """
    seen: set[int] = set()
    written = []
    for i in mutates:
        storage = flat_args[i].untyped_storage()
        if id(storage) not in seen and not from_outside(refs[i]):
            seen.add(id(storage))
            written.append(flat_args[i])
    return written
