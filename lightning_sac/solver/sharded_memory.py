"""What one rank holds at each moment of a sharded (FSDP) step, from the unsharded profile and the units.

The dry run profiles the model unsharded (:mod:`lightning_sac.sharding.unsharded`); its timeline gives, at every
module boundary, the activations, temporaries and inputs, which sharding does not change. Parameters, gradients
and optimizer state are replaced by what FSDP keeps on one rank:

- every unit's parameter shard, always; its gathered parameters from the moment they are all-gathered (its
  forward, or the forward of the unit that prefetches it) until its forward ends, or until its backward ends
  when it does not reshard after forward (the root, by default); again from its backward (or from the backward
  of the unit before it in backward order, which prefetches it by default) until its backward ends;
- FSDP2's flat all-gather buffer: a unit's parameters are copied out of it, and it stays alive until the next
  all-gather, the end of a root unit's forward, or the end of backward; at the moment of a gather the previous one
  is still alive too;
- gradients: outside backward, every unit's gradient shard (Lightning sets gradients to ``None`` just before
  backward, so during backward only the units done so far have theirs); during a unit's backward its unsharded
  gradients (FSDP2: each parameter's from when backward reaches it, as the dry run made them; FSDP1: the unit's
  flat gradient whole), and at its end a second copy of them, the reduce-scatter's input;
- optimizer state divided as the parameters are, and so are the optimizer step's temporaries (it steps the shards).

A unit resharded after forward over fewer ranks than it is sharded over (FSDP2's ``reshard_after_forward=N``)
keeps 1/N of its gathered parameters from the end of its forward until its backward copies them out again.

A unit whose shards FSDP offloads to the host (:attr:`~lightning_sac.sharding.FSDPUnit.offload`) holds on the
device only what it gathers: no parameter shard, gradient shard or optimizer state, and the optimizer's step runs
on the host (its temporaries too, in proportion to the offloaded shards). Its all-gather copies its shard to the
device first (``FSDPParam.all_gather_inputs``: ``.to(device)``), a copy alive at the moment of the gather; its
reduce-scatter's output, its new gradient shard, is on the device at the end of its backward until it is copied
to the host. A cast of the copied shard to ``param_dtype`` under mixed precision is not counted.

A checkpointed module that contains units gathers them again for its recompute, at the start of its backward,
and they stay gathered until each one's own backward ends (FSDP does not reshard after a recompute's forward):
:meth:`ShardedStep.recompute_gathers` is that extra, counted only when the module is checkpointed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from lightning_sac.dryrun import MemorySnapshot, ModelProfile
from lightning_sac.sharding import FSDPUnit, ShardedLayout, inside_a_unit

__all__ = ["ShardedStep"]


def _inside(fqn: str, outer: str) -> bool:
    return outer == "" or fqn == outer or fqn.startswith(outer + ".")


def _union(intervals: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The inclusive intervals' union within ``[lo, hi]``, as disjoint inclusive intervals in order."""
    out: list[tuple[int, int]] = []
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if a > b:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


@dataclass
class ShardedStep:
    """The sharded memory model of one profiled step (see the module docstring).

    Args:
        profile: The unsharded profile, with its timeline.
        layout: The model's FSDP units.
    """

    profile: ModelProfile
    layout: ShardedLayout
    _gathered: list[list[tuple[int, int]]] = field(init=False, repr=False)  # per unit: [start, end] intervals
    _starts: dict[int, int] = field(init=False, repr=False)  # timeline index -> all-gather buffer bytes there
    _held: list[int] = field(init=False, repr=False)  # per timeline index, the last all-gather's buffer bytes
    _bwd: list[tuple[int, int]] = field(init=False, repr=False)  # per unit: its backward's [start, end]
    _phase: list[str] = field(init=False, repr=False)  # per timeline index, the step's phase
    _first: dict[tuple[str, str], int] = field(init=False, repr=False)  # (kind, name) -> first timeline index
    _gathered_at: list[int] = field(init=False, repr=False)  # per timeline index, the gathered bytes there
    _param_bytes: int = field(init=False, repr=False)  # all units' parameters, gathered
    _shards: int = field(init=False, repr=False)  # all units' parameter shards on one rank
    _grad_shards: int = field(init=False, repr=False)  # all units' gradient shards on one rank
    _host_shards: int = field(init=False, repr=False)  # the offloaded units' parameter shards (on the host)
    _host_grad_shards: int = field(init=False, repr=False)  # the offloaded units' gradient shards (on the host)
    _copies: dict[int, int] = field(init=False, repr=False)  # timeline index -> offloaded shards copied in there
    # timeline index in backward -> (finished units' gradient shards, their unsharded gradients as the dry run
    # counts them, the reduce-scatter inputs of the units ending there)
    _backward_grads: dict[int, tuple[int, int, int]] = field(init=False, repr=False)
    _recompute_series: dict[str, list[int]] = field(init=False, repr=False)  # fqn -> recompute_gathers per index

    def __post_init__(self) -> None:
        timeline = self.profile.timeline
        last = len(timeline) - 1
        first: dict[tuple[str, str], int] = {}
        for k, e in enumerate(timeline):
            first.setdefault((e.kind, e.name), k)
        self._first, self._phase = first, self.profile.timeline_phases()
        fwd_begin = first.get(("phase", "forward"), 0)
        bwd_begin = first.get(("phase", "backward"), last)
        bwd_end = first.get(("phase", "optimizer"), last)
        units = self.layout.units
        spans = []
        for u in units:
            # A unit whose forward is not a module call of the step (FSDP1's root wraps the LightningModule,
            # whose training_step runs instead) is gathered for the whole forward and backward.
            spans.append(
                (
                    first.get(("fwd_pre", u.fqn), fwd_begin),
                    first.get(("fwd_post", u.fqn), bwd_begin),
                    first.get(("bwd_pre", u.fqn), bwd_begin),
                    first.get(("bwd_post", u.fqn), bwd_end),
                )
            )
        self._bwd = [(s[2], s[3]) for s in spans]
        fqns = {u.fqn: i for i, u in enumerate(units)}
        # FSDP's default backward prefetch: a unit's backward gathers the unit whose forward ended just before
        # its own (FSDP2), or began just before its own (FSDP1's BACKWARD_PRE).
        by = 1 if self.layout.kind == "fsdp2" else 0
        order = sorted(range(len(units)), key=lambda i: spans[i][by])
        self._gathered, self._starts, self._copies = [], {}, {}
        kept: list[tuple[int, int, int]] = []
        buffer_starts: list[list[int]] = []
        for i, u in enumerate(units):
            fwd_pre, fwd_post, bwd_pre, bwd_post = spans[i]
            fwd_start = min([fwd_pre] + [spans[fqns[p.fqn]][0] for p in units if u.fqn in p.forward_prefetch])
            bwd_start = bwd_pre
            if u.backward_prefetch is None:  # FSDP's default: the unit after it in that order gathers it
                rank = order.index(i)
                if rank + 1 < len(order):
                    bwd_start = min(bwd_start, spans[order[rank + 1]][2])
            else:
                prefetchers = [spans[fqns[p.fqn]][2] for p in units if u.fqn in (p.backward_prefetch or [])]
                bwd_start = min([bwd_start, *prefetchers])
            # A prefetch issues the all-gather (its buffer) early; FSDP2 copies the parameters out of it only when
            # the unit's own forward or backward begins (``wait_for_unshard``), FSDP1 gathers into them at once.
            copy_fwd, copy_bwd = (fwd_pre, bwd_pre) if self.layout.kind == "fsdp2" else (fwd_start, bwd_start)
            if u.reshard_after_forward:
                intervals, starts = [(copy_fwd, fwd_post), (copy_bwd, bwd_post)], [fwd_start, bwd_start]
                if u.post_forward_bytes:  # resharded over fewer ranks: kept until the backward's copy-out
                    kept.append((fwd_post + 1, copy_bwd - 1, u.post_forward_bytes))
            else:
                intervals, starts = [(copy_fwd, bwd_post)], [fwd_start]
            self._gathered.append(intervals)
            buffer_starts.append(starts)
            for start in starts:
                self._starts[start] = self._starts.get(start, 0) + u.buffer_bytes
                if u.offload:
                    self._copies[start] = self._copies.get(start, 0) + u.shard_bytes
        # FSDP2 keeps the last all-gather's buffer until the next one (when several start together, the largest
        # is counted); a root's post-forward frees it (``FSDPState._post_forward``, for the forward's root state),
        # and so does the end of backward.
        largest = {
            k: max(u.buffer_bytes for u, st in zip(units, buffer_starts, strict=True) if k in st) for k in self._starts
        }
        roots = [u.fqn for u in units if not inside_a_unit(u.fqn, units)]
        root_ends = {first[("fwd_post", fqn)] for fqn in roots if ("fwd_post", fqn) in first}
        self._held, held = [], 0
        for k in range(len(timeline)):
            if k in root_ends:
                # What a prefetch issued and the unit has not copied out yet stays: its group still holds it.
                issued = zip(units, buffer_starts, spans, strict=True)
                held = max((u.buffer_bytes for u, st, sp in issued if st[0] < k < sp[0]), default=0)
            held = 0 if k >= bwd_end else largest.get(k, held)
            self._held.append(held)
        # What bytes_at sums at every call but depends on the timeline index alone, once (the solver asks at every
        # index of a step thousands of events long).
        self._param_bytes = sum(u.param_bytes for u in units)
        self._shards = sum(u.shard_bytes for u in units)
        self._grad_shards = sum(u.grad_shard_bytes for u in units)
        self._host_shards = sum(u.shard_bytes for u in units if u.offload)
        self._host_grad_shards = sum(u.grad_shard_bytes for u in units if u.offload)
        gathered = [0] * (len(timeline) + 1)
        for u, intervals in zip(units, self._gathered, strict=True):
            for a, b in _union(intervals, 0, len(timeline) - 1):
                gathered[a] += u.gathered_bytes
                gathered[b + 1] -= u.gathered_bytes
        for a, b, nbytes in kept:
            if a <= b:
                gathered[a] += nbytes
                gathered[b + 1] -= nbytes
        self._gathered_at = list(itertools.accumulate(gathered[:-1]))
        self._backward_grads, self._recompute_series = {}, {}

    # ------------------------------------------------------------------ per moment
    def is_gathered(self, i: int, k: int) -> bool:
        """Whether unit ``i``'s parameters are gathered at timeline index ``k`` without any checkpointing."""
        return any(a <= k <= b for a, b in self._gathered[i])

    def _gradients(self, k: int, snapshot: MemorySnapshot) -> int:
        units = self.layout.units
        if self._phase[k] != "backward":
            return self._grad_shards - self._host_grad_shards if snapshot.get("gradient", 0) > 0 else 0
        if self.layout.kind == "fsdp2":
            # FSDP2's unsharded gradients are the parameters' own, each made as backward reaches it: those of the
            # units still in backward are what the dry run holds less what the finished units made.
            if k not in self._backward_grads:
                shards = made = scatters = 0
                for u, (_, end) in zip(units, self._bwd, strict=True):
                    if end < k:
                        shards += 0 if u.offload else u.grad_shard_bytes
                        made += u.grad_bytes if u.compute_grad_bytes is None else u.compute_grad_bytes
                    elif k == end:  # at its end, the reduce-scatter's input (and an offloaded unit's output)
                        scatters += u.grad_bytes if u.scatter_bytes is None else u.scatter_bytes
                        scatters += u.grad_shard_bytes if u.offload else 0
                self._backward_grads[k] = (shards, made, scatters)
            shards, made, scatters = self._backward_grads[k]
            return shards + max(0, snapshot.get("gradient", 0) - made) + scatters
        # FSDP1's flat gradient of a unit comes whole: from the unit's backward on.
        total = 0
        for u, (start, end) in zip(units, self._bwd, strict=True):
            if end < k:
                total += 0 if u.offload else u.grad_shard_bytes
            elif start <= k:
                scatter = u.grad_bytes if u.scatter_bytes is None else u.scatter_bytes
                scatter += u.grad_shard_bytes if u.offload else 0
                total += u.grad_bytes + (scatter if k == end else 0)  # at its end, the reduce-scatter's input
        return total

    def bytes_at(self, k: int, snapshot: MemorySnapshot, *, moment: bool = False) -> int:
        """Bytes on one rank at timeline index ``k`` whose unsharded snapshot is ``snapshot``.

        Args:
            k: Timeline index.
            snapshot: The unsharded profile's bytes by category there (at the event, or its interval's peak).
            moment: ``snapshot`` is the event's own (``at``): add what FSDP holds only at that moment (the
                all-gather buffers of the units gathered there, beside the previous gather's).
        """
        param_bytes, shards = self._param_bytes, self._shards
        profiled = snapshot.get("parameter", 0)
        unmanaged = max(profiled - param_bytes, 0)
        # The optimizer's state is made from the shards. The profile's state is of its parameters, which are in
        # the compute dtype when FSDP1's mixed precision computes on cast parameters.
        ratio = shards / min(profiled, param_bytes) if profiled and param_bytes else 1.0
        other = sum(v for c, v in snapshot.items() if c not in ("parameter", "gradient", "optimizer_state"))
        gathered = self._gathered_at[k] if 0 <= k < len(self._gathered_at) else self._gathered_sum(k)
        host = self._host_shards
        if host and shards:  # what the optimizer holds and makes for the offloaded shards is on the host
            ratio *= (shards - host) / shards
        if 0 <= k < len(self._phase) and self._phase[k] == "optimizer":
            # The optimizer steps the shards: its temporaries are the shards' (a foreach step's, as large as all
            # the parameters it steps, are 1/world size of the profile's), and whole for parameters no unit manages.
            temporary = snapshot.get("temporary", 0)
            kept = min(1.0, ratio + unmanaged / profiled) if profiled else 1.0
            other -= temporary - round(temporary * kept)
        optimizer = round(snapshot.get("optimizer_state", 0) * ratio)
        total = other + unmanaged + shards - host + gathered + optimizer + self._gradients(k, snapshot)
        if moment and k in self._starts:  # the gathers of this moment, beside the previous gather's buffer
            return total + self._starts[k] + self._copies.get(k, 0) + (self._held[k - 1] if k > 0 else 0)
        return total + self._held[k]

    def _gathered_sum(self, k: int) -> int:
        return sum(u.gathered_bytes for i, u in enumerate(self.layout.units) if self.is_gathered(i, k))

    def recompute_gathers(self, fqn: str, k: int) -> int:
        """Bytes a checkpoint of ``fqn`` gathers at timeline index ``k`` that the step without it does not.

        Units inside ``fqn`` (not ``fqn`` itself) are gathered by its recompute, from its backward's start until
        their own backward ends.
        """
        start = self._first.get(("bwd_pre", fqn))
        if start is None or k < start:
            return 0
        extra = 0
        for i, u in enumerate(self.layout.units):
            if u.fqn == fqn or not _inside(u.fqn, fqn):
                continue
            if k <= self._bwd[i][1] and not self.is_gathered(i, k):
                extra += u.gathered_bytes
        return extra

    def recompute_gathers_series(self, fqn: str) -> list[int]:
        """:meth:`recompute_gathers` of ``fqn`` at every timeline index, computed once per module."""
        if fqn in self._recompute_series:
            return self._recompute_series[fqn]
        length = len(self.profile.timeline)
        series = [0] * (length + 1)
        start = self._first.get(("bwd_pre", fqn))
        for i, u in enumerate(self.layout.units):
            if start is None or u.fqn == fqn or not _inside(u.fqn, fqn):
                continue
            # From the module's backward until the unit's own backward ends, less where the step gathers it anyway.
            end = min(self._bwd[i][1], length - 1)
            if start > end:
                continue
            series[start] += u.gathered_bytes
            series[end + 1] -= u.gathered_bytes
            for a, b in _union(self._gathered[i], start, end):
                series[a] -= u.gathered_bytes
                series[b + 1] += u.gathered_bytes
        self._recompute_series[fqn] = list(itertools.accumulate(series[:-1]))
        return self._recompute_series[fqn]

    def units_inside(self, fqn: str) -> list[FSDPUnit]:
        """The units strictly inside module ``fqn``."""
        return [u for u in self.layout.units if u.fqn != fqn and _inside(u.fqn, fqn)]
