"""The allocator's fragmentation of a planned step: the dry run's allocations as the plan changes them, replayed.

The dry run keeps a CUDA target's allocations and frees in order (:class:`~lightning_sac.dryrun.AllocationTrace`).
A plan changes them where the solver's memory model (:mod:`lightning_sac.solver.memory_model`) says it changes the
step's memory, module by module, for each checkpointed module ``j`` and its op policy (1: saved, 0: recomputed):

- the storages ``j``'s forward ops make that the plain step keeps past ``j``'s forward (its activations), whose op the
  policy recomputes, are freed at the end of ``j``'s forward. Those the plain step still holds when ``j``'s backward
  begins are allocated again there, by the recompute, and freed where the plain step frees them; the others are not
  allocated again (their plain free is dropped). Not the module's output (its caller holds it), nor a storage that
  outlives the step (something besides autograd holds it), nor an op after the recompute's stop;
- at the start of ``j``'s backward the recompute reruns ``j``'s forward up to its stop: the allocations and frees of
  the recomputed ops, in the forward's order, in storages of their own (its temporaries come and go as in the
  forward; a second copy of the module's output lives until the recompute is over);
- a temporary the policy saves is kept by the checkpoint's cache from the forward until the recompute is over.

The inputs a checkpoint keeps until its backward ends are freed where the plain step frees them: that moves bytes,
which the solver counts, more than it fragments. Under FSDP (``sharding="sharded"``) every storage the trace marks
as sharded (parameters, gradients, optimizer state, what the optimizer step makes) takes ``1 / world_size`` of its
bytes; FSDP's gathered parameters and reduce-scatter buffers are allocated on its own streams, whose blocks the
allocator keeps apart from the compute stream's (``get_free_block`` matches the stream), and are not replayed.

The fragmentation is the replayed reserved peak minus the replayed tensors' peak. Without memory pressure the
allocator keeps every segment and the replay runs unbounded; only where that would not fit the room the device
leaves (its memory, not the budget: the allocator does not know the budget) does torch release cached segments and
retry before it runs out of memory, and the step needs only :func:`~lightning_sac.dryrun.needed_reserved`. On an
H100 a ResNet step with 919 MiB of tensors reserved 1409-1474 MiB under a 1.97 GiB budget, where its unbounded
replay predicts 1380 MiB and the least it runs in is 23 MiB above its tensors.
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning_sac.dryrun import AllocationTrace, ModelProfile, Replayed, needed_reserved, replay
from lightning_sac.plan.decisions import ModuleDecision

__all__ = ["StepFragmentation", "planned_trace"]


def _first_events(profile: ModelProfile) -> dict[tuple[str, str], int]:
    first: dict[tuple[str, str], int] = {}
    for k, e in enumerate(profile.timeline):
        first.setdefault((e.kind, e.name), k)
    return first


def _lifetimes(trace: AllocationTrace) -> list[int]:
    """Per storage, the trace position of its free; ``len(events)`` for one that outlives the step."""
    freed = [len(trace.events)] * len(trace.sizes)
    for p, e in enumerate(trace.events):
        if e < 0:
            freed[-e - 1] = p
    return freed


def planned_trace(
    profile: ModelProfile,
    decisions: Mapping[str, ModuleDecision],
    *,
    world_size: int = 1,
    sharding: str = "replicated",
) -> tuple[list[int], list[int]]:
    """The events and storage sizes of the step under ``decisions`` (see the module docstring).

    Raises:
        ValueError: The profile has no allocation trace (a CPU target, or a profile saved before it was kept).
    """
    trace = profile.allocations
    if trace is None:
        raise ValueError("planned_trace: the profile has no allocation trace; profile the step for a CUDA target")
    events, ops = trace.events, trace.ops
    sizes = list(trace.sizes)
    if sharding == "sharded" and world_size > 1:
        per_rank = profile.device.round_bytes
        sizes = [per_rank(-(-n // world_size)) if s else n for n, s in zip(sizes, trace.sharded, strict=True)]
    end = len(events)
    freed = _lifetimes(trace) if decisions else []
    first = _first_events(profile)
    insert: dict[int, list[int]] = {}
    drop: set[int] = set()
    for fqn, decision in decisions.items():
        stats = profile.modules[fqn].op_stats
        keys = [("fwd_pre", fqn), ("fwd_post", fqn), ("bwd_pre", fqn)]
        if stats is None or fqn not in trace.module_ops or any(k not in first for k in keys):
            continue
        a, b, c = (trace.marks[first[k]] for k in keys)
        start, n, policy = trace.module_ops[fqn], len(stats.func_names), decision.op_policy
        stop = n if stats.recompute_stop is None else stats.recompute_stop
        outputs = set(stats.output_ops)
        rerun: list[int] = []  # the recompute's events
        copies: dict[int, int] = {}  # storage -> its copy in the recompute
        kept: list[int] = []  # freed once the recompute is over
        for p in range(a, b):
            e = events[p]
            s = e if e >= 0 else -e - 1
            i = ops[s] - start
            if not 0 <= i < n:
                continue
            if e < 0:
                if s in copies:
                    rerun.append(-copies[s] - 1)
                continue
            temporary = freed[s] < b
            if policy[i]:
                if temporary:  # the checkpoint's cache keeps it
                    drop.add(freed[s])
                    kept.append(s)
                continue
            if i >= stop:
                continue
            if not temporary and i not in outputs and freed[s] < end:
                insert.setdefault(b, []).append(-s - 1)  # gone from the forward's end
                if freed[s] > c:
                    rerun.append(s)  # made again by the recompute, freed where the plain step frees it
                else:
                    drop.add(freed[s])
                continue
            copies[s] = len(sizes)
            sizes.append(sizes[s])
            rerun.append(copies[s])
            if not temporary:
                kept.append(copies[s])
        insert.setdefault(c, []).extend(rerun + [-s - 1 for s in kept])
    if not insert and not drop:
        return events, sizes
    out: list[int] = []
    for p, e in enumerate(events):
        out += insert.get(p, ())
        if p not in drop:
            out.append(e)
    out += insert.get(end, ())
    return out, sizes


class StepFragmentation:
    """The fragmentation of the step under a plan, bytes, replayed once per plan (see the module docstring).

    Args:
        profile: The step's profile. Without an allocation trace (a CPU target, an older profile), every plan has
            the fragmentation the profile recorded for the plain step.
        world_size: Devices the step runs on.
        sharding: ``"replicated"`` or ``"sharded"``.
    """

    def __init__(self, profile: ModelProfile, world_size: int = 1, sharding: str = "replicated") -> None:
        self.profile = profile
        self.world_size = world_size
        self.sharding = sharding
        self._unbounded: dict[tuple[tuple[str, tuple[int, ...]], ...], Replayed] = {}
        self._needed: dict[tuple[tuple[str, tuple[int, ...]], ...], Replayed] = {}

    def __call__(self, decisions: Mapping[str, ModuleDecision], room: int | None = None) -> int:
        """Bytes the allocator reserves beyond the tensors' peak under ``decisions``.

        Args:
            decisions: The plan's decisions (empty: the step without a plan).
            room: The bytes the device leaves for fragmentation beside the plan's tensors. When the unbounded
                replay reserves more, the allocator releases cached segments and retries: the step's need is the
                least reserved it runs in. ``None``: no limit.
        """
        profile, trace = self.profile, self.profile.allocations
        if trace is None:
            return max(0, profile.reserved_peak_bytes - profile.peak_bytes) if profile.reserved_peak_bytes else 0
        key = tuple(sorted((fqn, tuple(d.op_policy)) for fqn, d in decisions.items()))
        if key not in self._unbounded:
            events, sizes = planned_trace(profile, decisions, world_size=self.world_size, sharding=self.sharding)
            self._unbounded[key] = replay(events, sizes, trace.config)
        run = self._unbounded[key]
        if room is None or run.fragmentation <= room:
            return run.fragmentation
        if key not in self._needed:
            events, sizes = planned_trace(profile, decisions, world_size=self.world_size, sharding=self.sharding)
            self._needed[key] = needed_reserved(events, sizes, trace.config, run)
        return self._needed[key].fragmentation
