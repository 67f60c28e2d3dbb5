"""The forward's ops as a graph: which op made each tensor an op reads, and which tensors autograd saved.

The recorder appends every forward op here once. Besides what the op costs, it keeps the edges to the ops
that made its inputs and, for every tensor autograd packs, the op that made it and how many ops had run. From
these a module's :class:`ModuleOpStats` tells not only what a policy saves but what backward will really
recompute: selective checkpointing stops recomputing after the last tensor backward needs, and graph
checkpointing recomputes only the ancestors of what backward unpacks (see :mod:`lightning_sac.solver.recompute`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch
from torch.utils.weak import WeakIdKeyDictionary

from lightning_sac.dryrun.data import ModuleOpStats

__all__ = ["OpGraph", "OpRecord"]


@dataclass
class OpRecord:
    """One forward op as recorded, with global indices into :attr:`OpGraph.ops`."""

    name: str
    ms: float
    new_bytes: int
    view_like: bool
    rand: bool
    inplace_parent: int | None  # the op that created the mutated storage; -1: from outside the step
    outputs: tuple[tuple[int, int], ...]  # (storage id, serial) of each output, to match saved storages
    inputs: tuple[int, ...]  # the ops whose output tensors this op reads
    storage_roots: tuple[int, ...]  # per output, the op that created its storage; -1: from outside
    stateful: bool = False  # writes a tensor that is not among its outputs (BatchNorm's running statistics)
    mask: tuple[int, float] | None = None  # random noise of 0 and 1: (bytes, ms) of its bool mask (profiling.noise)
    workspace: int = 0  # bytes its kernel allocates and frees inside the call on the target


@dataclass
class _Deferred:
    """A view op of a written storage, recorded only if its output lives on (see :meth:`OpGraph.append`)."""

    record: OpRecord
    outputs: list[weakref.ref[torch.Tensor]]
    output_ids: set[int]
    input_ids: set[int]


class OpGraph:
    """Forward ops, the tensors' makers, and autograd's packs, for one recorded step.

    On fake tensors, autograd rebuilds a view's history after a write to its storage by running the view op
    again (``view_fn`` replay, for tensors with a Python dispatch key), where on real tensors it builds an
    ``AsStridedBackward`` without running an op: the dry run would see a ``select`` after each ``buf[:, t] = y``
    that the real step never runs, and every later op index would be off. Such a replayed view is dropped at once
    (only its history is kept), so a view op on a written storage is held back until the next op: recorded (in
    order, with its edges) if its output is still alive or a held-back view that is recorded reads it, dropped
    otherwise.
    """

    def __init__(self) -> None:
        self._ops: list[OpRecord] = []
        self._deferred: list[_Deferred] = []
        self._written: set[int] = set()  # storages an in-place op of the step wrote
        # (ops run when autograd packed a tensor, the ops that made it, its storage's key). An op's inputs are
        # packed before it runs and its outputs after, so the count says exactly which ops a recompute must have run.
        self.packs: list[tuple[int, tuple[int, ...], tuple[int, int]]] = []
        self._made_by: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> ops that last wrote it
        # op -> (ops run, bytes) when each storage it made was freed (forward)
        self.deaths: dict[int, list[tuple[int, int]]] = {}

    @property
    def ops(self) -> list[OpRecord]:
        """The recorded forward ops, in order (held-back views decided first)."""
        self._settle()
        return self._ops

    def may_replay(self, inputs: list[torch.Tensor]) -> bool:
        """Whether a view op of ``inputs`` may be autograd's replay: one reads a storage written in place."""
        return any(id(t.untyped_storage()) in self._written for t in inputs)

    def makers(self, tensors: list[torch.Tensor], settle: bool = True) -> tuple[int, ...]:
        """The recorded ops whose outputs are among ``tensors`` (tensors from outside have none).

        ``settle=False`` for an op to hold back: its edges to held-back views are added when it is recorded.
        """
        if settle:
            self._settle()
        return tuple(sorted({i for t in tensors for i in self._made_by.get(t, ())}))

    def pass_through(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        """An op SAC ignores (``detach``...): its outputs are made by whatever made its inputs."""
        made = self.makers(inputs)
        for t in outputs:
            self._made_by[t] = made

    def append(
        self, record: OpRecord, outputs: list[torch.Tensor], held_back: list[torch.Tensor] | None = None
    ) -> None:
        """Record an op; it becomes the maker of its outputs (of a mutated tensor too: it wrote last).

        With ``held_back`` (the op's inputs), a view op is held back until the next op (see the class docstring).
        """
        if held_back is not None:
            refs = [weakref.ref(t) for t in outputs]
            self._deferred.append(_Deferred(record, refs, {id(t) for t in outputs}, {id(t) for t in held_back}))
            return
        self._settle()
        self._add(record, outputs)
        if record.inplace_parent is not None:
            self._written.update(id(t.untyped_storage()) for t in outputs)

    def _add(self, record: OpRecord, outputs: list[torch.Tensor]) -> None:
        index = len(self._ops)
        self._ops.append(record)
        for t in outputs:
            self._made_by[t] = (index,)

    def _settle(self) -> None:
        """Record the held-back views whose outputs live on or feed a recorded one; drop autograd's replays."""
        if not self._deferred:
            return
        deferred, self._deferred = self._deferred, []
        keep = [False] * len(deferred)
        needed: set[int] = set()
        for i in range(len(deferred) - 1, -1, -1):
            entry = deferred[i]
            if any(ref() is not None for ref in entry.outputs) or entry.output_ids & needed:
                keep[i] = True
                needed |= entry.input_ids
        made: dict[int, int] = {}  # output id of a recorded held-back view -> its op index
        for entry, kept in zip(deferred, keep, strict=True):
            if not kept:
                continue
            edges = {made[i] for i in entry.input_ids if i in made}
            record = replace(entry.record, inputs=tuple(sorted({*entry.record.inputs, *edges})))
            made.update((i, len(self._ops)) for i in entry.output_ids)
            self._add(record, [t for t in (ref() for ref in entry.outputs) if t is not None])

    def freed(self, maker: int, nbytes: int = 0) -> None:
        """A storage (``nbytes``) op ``maker`` made was freed in forward, now (after ``len(ops)`` ops)."""
        self.deaths.setdefault(maker, []).append((len(self.ops), nbytes))

    def pack(self, tensor: torch.Tensor, key: tuple[int, int]) -> None:
        """Autograd saved ``tensor`` (its storage's ``key``) for backward."""
        made = self.makers([tensor])
        self.packs.append((len(self.ops), made, key))

    def module_stats(
        self,
        op_range: tuple[int, int],
        pack_range: tuple[int, int],
        saved: set[tuple[int, int]],
        force_store_random: bool,
        output_keys: set[tuple[int, int]] | None = None,
    ) -> ModuleOpStats:
        """The op stats of one module call.

        Args:
            op_range: The call's ops, ``[start, end)`` in :attr:`ops`.
            pack_range: The packs made during the call, ``[start, end)`` in :attr:`packs`.
            saved: Keys of every storage autograd saved during the step's forward.
            force_store_random: Whether the module received no tensor inputs.
            output_keys: Keys of the storages of the call's output.
        """
        start, end = op_range
        ops = self.ops[start:end]
        stats = ModuleOpStats(force_store_random=force_store_random)

        def local(i: int) -> int | None:
            return i - start if start <= i < end else None

        for i, op in enumerate(ops):
            stats.func_names.append(op.name)
            stats.runtimes.append(op.ms)
            stats.memory.append(op.new_bytes)
            if op.view_like:
                stats.view_like_ops.append(i)
            if op.rand:
                stats.rand_ops.append(i)
            if op.stateful:
                stats.stateful_ops.append(i)
            if op.mask is not None:
                stats.mask_ops.append(i)
                stats.mask_bytes.append(op.mask[0])
                stats.mask_ms.append(op.mask[1])
            if op.outputs and all(k in saved for k in op.outputs):
                stats.saved_autograd_ops.append(i)
            if op.workspace:
                stats.workspace_ops.append(i)
                stats.workspace_bytes.append(op.workspace)
            if op.inplace_parent is not None:
                parent = op.inplace_parent - start
                stats.inplace_ops.append((i, parent if 0 <= parent < i else i))
            stats.op_inputs.append(sorted({j for j in map(local, op.inputs) if j is not None and j < i}))
            made = sum(1 for root in op.storage_roots if root == start + i)
            deaths = self.deaths.get(start + i, [])
            whole = made and len(deaths) >= made and max(c for c, _ in deaths) <= end
            stats.freed_at.append(max(c for c, _ in deaths) - start if whole else -1)
            # Some of its storages are freed within the call and others outlive it (a LayerNorm's output that only
            # a local variable held, its saved mean and rstd): the plain step does not keep those, a recompute
            # makes them again and holds them as long as the forward did.
            within = [(c, n) for c, n in deaths if c <= end]
            if made and not whole and within:
                stats.freed_parts.append((i, sum(n for _, n in within), max(c for c, _ in within) - start))
        # A saved output that a later op of the module writes in place no longer holds what its op made: an
        # op's output is overwritten later when the module's last write to one of its storages comes after it.
        last_write = {op.inplace_parent: j for j, op in enumerate(ops) if op.inplace_parent is not None}
        for i, op in enumerate(ops):
            if any(last_write.get(r, -1) > i for r in op.storage_roots if r >= 0):
                stats.mutated_later.append(i)
            # It reads a tensor that a later op overwrites: a recompute must see the value before that write. (A
            # view sees the write in forward too: it aliases the storage.)
            for j in [] if op.view_like else stats.op_inputs[i]:
                if any(last_write.get(r, -1) > i for r in ops[j].storage_roots if start <= r):
                    stats.reads_before_overwrite.append((i, j))
            # A storage from before the module (its input, written through a view): only the write, which is
            # always kept, can stand for the value the read saw, so the reader is kept with it.
            makers = [] if op.view_like else [self._ops[g] for g in op.inputs]
            for w in sorted({last_write.get(r, -1) for m in makers for r in m.storage_roots if 0 <= r < start}):
                if w > i:
                    stats.reads_before_overwrite.append((i, w))
        packs = self.packs[pack_range[0] : pack_range[1]]
        stats.packed_ops = sorted({j for _, made, _ in packs for j in map(local, made) if j is not None})
        stats.recompute_stop = min(max((count - start for count, _, _ in packs), default=0), len(ops))
        outputs = output_keys or set()
        stats.output_saved_inside = bool(outputs) and outputs <= {key for _, _, key in packs}
        # The ops that made the storages the call returns (an in-place ReLU returns its parent's storage).
        roots = {root for op in ops if set(op.outputs) & outputs for root in op.storage_roots}
        stats.output_ops = sorted({j for j in map(local, roots) if j is not None})
        return stats
