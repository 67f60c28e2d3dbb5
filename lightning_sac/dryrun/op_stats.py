"""A non-leaf module's forward as selective checkpointing sees it: its aten ops, in order, with their facts.

Part of the profile's data model (:mod:`lightning_sac.dryrun.data`): numbers and names only, JSON round trip.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ModuleOpStats"]


@dataclass(kw_only=True)
class ModuleOpStats:
    """The aten ops a non-leaf module ran in its forward, in order, as selective checkpointing sees them.

    Ops that ``torch.utils.checkpoint`` ignores for SAC (``SAC_IGNORED_OPS``) are left out, so index ``i`` here
    is the ``i``-th op a SAC policy for this module is asked about.

    Attributes:
        func_names: Overload name of each op, e.g. ``"aten.mm.default"``.
        runtimes: Estimated runtime of each op on the target device, ms.
        memory: Bytes of new storage each op's outputs allocate on the target (after allocator rounding).
            Views and in-place ops allocate nothing; the module's last op that is neither is counted too (the
            trade-off stage decides that keeping it is free).
        view_like_ops: Indices of ops whose outputs alias an input (views, in-place views).
        rand_ops: Indices of ops that draw random numbers (dropout, ``rand*``, attention with dropout).
        saved_autograd_ops: Indices of ops all of whose output storages autograd saved for backward.
        inplace_ops: Pairs ``(op index, parent index)`` for in-place ops, the parent being the first op of this
            module whose output holds the storage the op mutates, or the op itself when that storage came from
            outside the module.
        force_store_random: Whether random ops must be stored rather than recomputed: true when the module
            received no tensor inputs, so that its random ops cannot be tied to a replayed input.
        op_inputs: Per op, the indices of this module's ops whose output tensors it reads (the graph edges;
            tensors from outside the module have none). Ops SAC ignores pass their inputs' makers through.
        packed_ops: Indices of ops any output tensor of which autograd saved during the module's forward: what
            a backward through the module unpacks.
        mutated_later: Indices of ops whose output storage a later in-place op of the module writes to.
        recompute_stop: How many of the module's ops had run when autograd saved its last tensor in the
            module's forward. A checkpoint's recompute stops there; ``None`` (a profile from an older version)
            means unknown: all ops.
        stateful_ops: Indices of ops that write to a tensor that is not among their outputs (BatchNorm's running
            statistics in training, found by what the op really writes: see
            :func:`lightning_sac.ops.aten.mutated_tensors`). Running one twice would update that state
            twice, so they are always saved, never recomputed.
        reads_before_overwrite: Pairs ``(reader, maker)``: the reader reads the maker's output before a later
            in-place op of the module overwrites it (autograd's copy of an input an in-place op needs, as
            ``hardtanh_`` has). A recompute of the reader must see the value before that write, which neither a
            checkpoint's cache of the maker (it holds the overwritten value) nor a second run of a stateful maker
            can give, so the two are saved or recomputed together.
        freed_at: Per op, how many of the module's ops had run when the forward freed every storage the op made
            (its outputs were temporaries), or ``-1`` when one outlives the forward or it made none: a recompute
            holds the temporaries it reruns for the same span
            (:func:`lightning_sac.solver.recompute.recompute_transient`).
        freed_parts: ``(op index, bytes, freed at)`` for an op some of whose storages the forward frees, after
            that many of the module's ops had run, while another outlives it (``freed_at`` is ``-1``): a
            LayerNorm's output held only by a local variable until the forward returns, its saved mean and rstd.
            The plain step keeps those bytes no longer; a recompute that reruns the op holds them again for that
            span (a Transformer block's recompute measured 131,072 bytes above its prediction without them).
        output_ops: Indices of the ops that made the storages of the module's output (an in-place op that
            returns its input's storage points to the op that made it).
        output_saved_inside: Whether autograd saved the module's output for a backward of the module's own ops
            (a ReLU saves its result): then a checkpoint's cache keeping it costs nothing (see
            :func:`lightning_sac.solver.tradeoff.effective_memory`).
        mask_ops: Indices of random ops that fill a floating tensor with 0 and 1 in place (``bernoulli_``, the
            noise of dropout on a CPU): their result can be kept as a ``bool`` mask and copied back in recompute
            (:mod:`lightning_sac.solver.masks`).
        mask_bytes: Per mask op, the bytes its mask allocates on the target.
        mask_ms: Per mask op, what copying its mask back costs on the target, ms.
        workspace_ops: Indices of ops whose kernel allocates and frees memory inside its call on the target (a
            workspace, a composite's scratch): a recompute that reruns one holds it for that moment as well.
        workspace_bytes: Per workspace op, those bytes.
    """

    func_names: list[str] = field(default_factory=list)
    runtimes: list[float] = field(default_factory=list)
    memory: list[int] = field(default_factory=list)
    view_like_ops: list[int] = field(default_factory=list)
    rand_ops: list[int] = field(default_factory=list)
    saved_autograd_ops: list[int] = field(default_factory=list)
    inplace_ops: list[tuple[int, int]] = field(default_factory=list)
    force_store_random: bool = False
    op_inputs: list[list[int]] = field(default_factory=list)
    packed_ops: list[int] = field(default_factory=list)
    mutated_later: list[int] = field(default_factory=list)
    recompute_stop: int | None = None
    stateful_ops: list[int] = field(default_factory=list)
    reads_before_overwrite: list[tuple[int, int]] = field(default_factory=list)
    freed_at: list[int] = field(default_factory=list)
    freed_parts: list[tuple[int, int, int]] = field(default_factory=list)
    output_ops: list[int] = field(default_factory=list)
    output_saved_inside: bool = False
    mask_ops: list[int] = field(default_factory=list)
    mask_bytes: list[int] = field(default_factory=list)
    mask_ms: list[float] = field(default_factory=list)
    workspace_ops: list[int] = field(default_factory=list)
    workspace_bytes: list[int] = field(default_factory=list)

    def rerun_workspaces(self, stop: int) -> dict[int, int]:
        """Workspace bytes by op index, for the ops before ``stop`` (a recompute's early stop).

        Each rerun op holds its own while it runs, in a recompute as in the step.
        """
        return {i: w for i, w in zip(self.workspace_ops, self.workspace_bytes, strict=True) if i < stop}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModuleOpStats:
        """Rebuild from :func:`dataclasses.asdict` output (JSON turns the pairs into lists)."""
        d = dict(d)
        d["inplace_ops"] = [(int(a), int(b)) for a, b in d["inplace_ops"]]
        d["reads_before_overwrite"] = [(int(a), int(b)) for a, b in d.get("reads_before_overwrite", [])]
        d["freed_parts"] = [(int(a), int(b), int(c)) for a, b, c in d.get("freed_parts", [])]
        return cls(**d)
