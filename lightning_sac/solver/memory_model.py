"""The memory model of a training step under a checkpointing plan, shared by the MILP and by plain evaluation.

The profile's timeline holds the live bytes at every module boundary and the peak until the next one. A
checkpointed module ``j`` frees ``d_j`` bytes of activations from the end of its forward until its backward
begins, when recompute brings them back with its forward's temporaries. A checkpoint also keeps its inputs until
its backward is over: one the plain step frees meanwhile stays alive from then on (``freed_inputs``). So every
timeline interval gives one constraint: its peak, minus what the checkpointed modules whose activations are absent
throughout it free, plus what they keep, is within the budget. Parameters, gradients and optimizer state are
divided by the world size when sharded.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from lightning_sac.dryrun import MemorySnapshot, ModelProfile, ModuleProfile
from lightning_sac.solver.sharded_memory import ShardedStep

#: Bytes on one device at timeline index ``k`` given the unsharded snapshot there (see :func:`device_model`).
OnDevice = Callable[..., int]
#: ``(holders, bytes)`` kept at one moment: see :attr:`MemoryConstraint.kept`.
Kept = tuple[tuple[tuple[str, ...], int], ...]

__all__ = [
    "MemoryConstraint",
    "OnDevice",
    "activation_windows",
    "backward_ends",
    "checkpoint_state_bytes",
    "constant_floor",
    "ddp_bucket_bytes",
    "device_bytes",
    "device_model",
    "memory_constraints",
    "peak_with_plan",
    "recompute_state_bytes",
]

_SHARDED = ("parameter", "gradient", "optimizer_state")


def device_bytes(
    snapshot: MemorySnapshot, world_size: int, sharding: str, bucket_bytes: int = 0, optimizer_step: bool = False
) -> int:
    """Bytes on one device: sharded training keeps 1/world_size of parameters, gradients and optimizer state.

    Replicated training adds ``bucket_bytes``: DDP's reducer keeps its gradient buckets (one flat copy of the
    trainable gradients) from its construction on (:func:`ddp_bucket_bytes`); pass 0 without DDP. In the
    optimizer's step (``optimizer_step``) sharded training's temporaries are divided too: it steps the shards (a
    foreach step's temporaries are as large as all the parameters it steps).
    """
    total = sum(snapshot.values())
    if sharding == "sharded" and world_size > 1:
        shardable = sum(snapshot.get(k, 0) for k in _SHARDED)
        shardable += snapshot.get("temporary", 0) if optimizer_step else 0
        total -= shardable - -(-shardable // world_size)  # keep the ceiling of the per-device share
    if sharding == "replicated":
        total += bucket_bytes
    return total


def ddp_bucket_bytes(profile: ModelProfile, world_size: int = 2) -> int:
    """Bytes of DDP's gradient buckets for this model: every trainable parameter's gradient, once.

    Measured on 2 gloo processes: a DDP step's peak is the single-process peak plus exactly these bytes, with
    ``gradient_as_bucket_view`` on or off (Lightning sets gradients to ``None``, so the views do not persist).
    A replicated plan for more than one device runs under DDP; one for a single device only when the profile
    says so (:attr:`ModelProfile.data_parallel`: Lightning's DDP strategy with one process still wraps the model).
    """
    root = profile.modules.get("")
    if root is None or not (world_size > 1 or profile.data_parallel):
        return 0
    return root.gradient_bytes


def device_model(profile: ModelProfile, world_size: int = 1, sharding: str = "replicated") -> OnDevice:
    """The bytes on one device at a moment of the step: ``on_device(k, snapshot, moment=False)``.

    ``k`` is the timeline index and ``snapshot`` the unsharded profile's bytes there (the event's own with
    ``moment=True``, which adds what exists only at the event, or its interval's peak). Replicated: the snapshot
    plus DDP's buckets. Sharded with the model's FSDP units known (:attr:`ModelProfile.sharded`): what the
    sharded memory model says (:class:`~lightning_sac.solver.sharded_memory.ShardedStep`); sharded without them:
    parameters, gradients and optimizer state divided by the world size, and the optimizer step's temporaries.
    """
    if sharding == "sharded" and profile.sharded is not None:
        return ShardedStep(profile, profile.sharded).bytes_at
    bucket = ddp_bucket_bytes(profile, world_size)
    stepping = [phase == "optimizer" for phase in profile.timeline_phases()]

    def on_device(k: int, snapshot: MemorySnapshot, *, moment: bool = False) -> int:
        return device_bytes(snapshot, world_size, sharding, bucket, 0 <= k < len(stepping) and stepping[k])

    return on_device


def _held(module: ModuleProfile) -> list[list[int]]:
    """``[index, bytes]`` of inputs (and a stateful output op's output) a checkpoint keeps and plain frees earlier."""
    stats = module.op_stats
    keeps_output = stats is not None and bool(stats.output_ops) and stats.output_ops[-1] in stats.stateful_ops
    return module.freed_inputs + (module.freed_outputs if keeps_output else [])


def checkpoint_state_bytes(profile: ModelProfile, fqn: str | None = None, backend: str = "sac") -> int:
    """Device bytes a checkpoint region keeps from its forward until its backward, besides activations.

    ``torch.utils.checkpoint`` stashes the CPU generator's state once per region (a few KiB) to replay its random
    ops; the graph backend stashes it at each random op of the region (module ``fqn``), to replay any alone (an
    Informer's graph plans measured up to 2.8% above their budget before it was counted). The target's memory on
    this CPU; host memory (not counted) for a GPU, whose own generator state is stashed on the host too.
    """
    state = _generator_state_bytes(profile)
    if backend == "sac" or fqn is None:
        return state
    stats = profile.modules[fqn].op_stats
    return state * (len(stats.rand_ops) if stats is not None else 0)


def recompute_state_bytes(profile: ModelProfile, fqn: str, backend: str = "sac") -> int:
    """Device bytes a recompute of module ``fqn`` holds while it runs besides tensors: a generator state it forks.

    ``torch.utils.checkpoint`` reruns a region under ``torch.random.fork_rng``, which copies the CPU generator's
    state for the rerun's length whether or not the region draws (5 KiB, measured above a SAC plan's prediction at
    its minimum); the graph backend forks it around each random op it reruns. Host memory for a GPU target.
    """
    stats = profile.modules[fqn].op_stats
    return _generator_state_bytes(profile) if backend == "sac" or (stats is not None and stats.rand_ops) else 0


@functools.cache
def _cpu_generator_state_nbytes() -> int:
    return torch.get_rng_state().nbytes  # the same for the whole process; made anew at every call


def _generator_state_bytes(profile: ModelProfile) -> int:
    """The CPU generator's state on the target's device: none for a GPU, whose host keeps it."""
    return 0 if profile.device.is_cuda else profile.device.round_bytes(_cpu_generator_state_nbytes())


def _first_events(profile: ModelProfile, kind: str) -> dict[str, int]:
    """Per module, the timeline index of its first event of ``kind``."""
    first: dict[str, int] = {}
    for k, e in enumerate(profile.timeline):
        if e.kind == kind:
            first.setdefault(e.name, k)
    return first


def _forward_starts(profile: ModelProfile) -> dict[str, int]:
    return _first_events(profile, "fwd_pre")


def backward_ends(profile: ModelProfile) -> dict[str, int]:
    """Per module, the timeline index of its (first) backward's end."""
    return _first_events(profile, "bwd_post")


def activation_windows(profile: ModelProfile) -> dict[str, tuple[int, int]]:
    """Per module with a backward: timeline indices of its (first) forward's end and (first) backward's start.

    A checkpointed module's activations are absent in the intervals between the two. A step can run several
    forward and backward passes (manual optimization): the windows are of each module's first forward, and a
    module whose backward begins in more than one backward pass (an earlier one kept its graph with
    ``retain_graph=True``) has none, so it is no candidate: a checkpoint of it would recompute in every pass and
    keep its inputs from one pass to the next, which this model of one backward per module does not describe.
    """
    fwd_end: dict[str, int] = {}
    windows: dict[str, tuple[int, int]] = {}
    again: set[str] = set()
    for k, e in enumerate(profile.timeline):
        if e.kind == "fwd_post":
            fwd_end.setdefault(e.name, k)
        elif e.kind == "bwd_pre" and e.name in windows:
            again.add(e.name)
        elif e.kind == "bwd_pre" and e.name in fwd_end:
            windows[e.name] = (fwd_end[e.name], k)
    return {fqn: w for fqn, w in windows.items() if fqn not in again}


@dataclass(frozen=True)
class MemoryConstraint:
    """One moment of the step: ``base - sum(freed[j] for j in absent) + transient[recompute] + kept <= budget``.

    Attributes:
        base: Bytes on one device without any checkpointing.
        absent: Candidates whose checkpointed activations are gone throughout this interval.
        recompute: The candidate whose recompute runs at this moment (its forward temporaries are back), if any.
        kept: ``(holders, bytes)``: inputs the plain step has freed by this moment that a checkpoint of any of the
            holders keeps alive, counted once when any of them is checkpointed (one storage, a mask every layer
            takes, can be an input of many).
        at: The first timeline index with these candidates absent, this recompute and these kept bytes: the
            MILP's rows follow the step's order (:func:`lightning_sac.solver.rows.memory_rows`).
    """

    base: int
    absent: frozenset[str]
    recompute: str | None = None
    kept: Kept = ()
    at: int = 0


def memory_constraints(
    profile: ModelProfile,
    windows: Mapping[str, tuple[int, int]],
    *,
    world_size: int = 1,
    sharding: str = "replicated",
    backend: str = "sac",
) -> list[MemoryConstraint]:
    """The constraints of a step, merged so that each set of absent candidates appears once with its worst base.

    Args:
        profile: The profile with its timeline.
        windows: Per candidate fqn, ``(timeline index of its forward's end, timeline index of its backward's
            start)``: its activations can be absent in the intervals between the two.
        world_size: Devices the step runs on.
        sharding: ``"replicated"`` or ``"sharded"``.
        backend: What a checkpoint keeps besides activations depends on it (:func:`checkpoint_state_bytes`).
    """
    worst: dict[tuple[frozenset[str], str | None, Kept], int] = {}
    first: dict[tuple[frozenset[str], str | None, Kept], int] = {}
    # Under FSDP with the model's units known, a rank holds what the sharded model says (lightning_sac.sharding).
    fsdp = ShardedStep(profile, profile.sharded) if sharding == "sharded" and profile.sharded is not None else None
    on_device = fsdp.bytes_at if fsdp is not None else device_model(profile, world_size, sharding)
    timeline = profile.timeline
    # Both depend on the timeline index alone and change at few of them: computed once per index by sweeps (one
    # pass per candidate and index was quadratic in the model's depth).
    absent_at = _absent_sets(windows, len(timeline))
    kept_at = _kept_bytes(profile, windows, fsdp, backend)

    def add(base: int, k: int, recompute: str | None) -> None:
        key = (absent_at[k], recompute, kept_at[k])
        worst[key] = max(worst.get(key, base), base)
        first.setdefault(key, k)

    for k, event in enumerate(timeline):
        add(on_device(k, event.peak_after or event.at), k, None)
        if fsdp is not None:  # what FSDP holds only at the event itself (an all-gather's flat buffer)
            add(on_device(k, event.at, moment=True), k, None)
    for j, (_, begin_bwd) in windows.items():
        add(on_device(begin_bwd, timeline[begin_bwd].at, moment=True), begin_bwd, j)
    return [MemoryConstraint(base, *key, at=first[key]) for key, base in worst.items()]


def _absent_sets(windows: Mapping[str, tuple[int, int]], length: int) -> list[frozenset[str]]:
    """Per timeline index ``k``, the candidates whose activations can be absent: ``end_fwd <= k < begin_bwd``.

    Consecutive indices with the same candidates share one frozenset.
    """
    starts: dict[int, list[str]] = {}
    stops: dict[int, list[str]] = {}
    for j, (end_fwd, begin_bwd) in windows.items():
        if end_fwd < begin_bwd:
            starts.setdefault(max(end_fwd, 0), []).append(j)
            stops.setdefault(begin_bwd, []).append(j)
    current: set[str] = set()
    shared: frozenset[str] = frozenset()
    out = []
    for k in range(length):
        if k in starts or k in stops:
            current.update(starts.get(k, ()))
            current.difference_update(stops.get(k, ()))
            shared = frozenset(current)
        out.append(shared)
    return out


def _kept_bytes(
    profile: ModelProfile, windows: Mapping[str, tuple[int, int]], fsdp: ShardedStep | None, backend: str
) -> list[Kept]:
    """Per timeline index, ``(holders, bytes)`` a checkpoint of any of ``holders`` keeps that the plain step does not.

    A checkpoint holds its inputs until its backward is over; those the plain step freed by then are extra. A
    storage that is an input of several candidates (the mask every attention takes; a DenseNet block's features)
    is kept once while any checkpointed holder's backward is not over (counted per holder, a LoRA Llama's graph
    plan at its minimum was predicted 11.6% over): a free is one event, which names the storage. Under FSDP, a
    checkpoint of a module that contains units keeps them gathered after its recompute. Consecutive indices where
    nothing changes share one tuple.
    """
    length = len(profile.timeline)
    ends = backward_ends(profile)
    # A checkpoint also keeps the generator states it stashed, from its forward's start on: its own storage.
    states = {j: checkpoint_state_bytes(profile, j, backend) for j in windows}
    starts = _forward_starts(profile)
    storages: dict[tuple[str, int], tuple[int, int, list[str]]] = {}  # key -> (freed at, bytes, holders)
    for j in windows:
        for d, n in _held(profile.modules[j]):
            storages.setdefault(("", d), (d, n, []))[2].append(j)
        if states[j]:
            storages[(j, -1)] = (starts[j], states[j], [j])
    # Under FSDP, what a checkpoint gathers again for its recompute, per index (few candidates contain units).
    gathers = {j: fsdp.recompute_gathers_series(j) for j in windows if fsdp is not None and fsdp.units_inside(j)}
    begins: dict[int, list[tuple[str, int]]] = {}
    over: dict[int, set[str]] = {}  # index -> holders whose backward is over there
    for key, (d, _, holders) in storages.items():
        begins.setdefault(max(d, 0), []).append(key)
        for j in (j for j in holders if j in ends):
            over.setdefault(ends[j], set()).add(j)
    changes = set(begins) | set(over) | {k for s in gathers.values() for k in range(length) if s[k] != (k and s[k - 1])}
    active: dict[tuple[str, int], tuple[str, ...]] = {}  # storage -> its holders whose backward is not over
    by_holders: dict[tuple[str, ...], int] = {}

    def move(key: tuple[str, int], holders: tuple[str, ...]) -> None:
        if key in active:
            by_holders[active.pop(key)] -= storages[key][1]
        if holders:
            active[key] = holders
            by_holders[holders] = by_holders.get(holders, 0) + storages[key][1]

    shared: Kept = ()
    out = []
    for at in range(length):
        if at in changes:
            for key in begins.get(at, ()):
                move(key, tuple(sorted({j for j in storages[key][2] if at < ends.get(j, length)})))
            for j in sorted(over.get(at, ())):
                for key in [k for k, holders in active.items() if j in holders]:
                    move(key, tuple(h for h in active[key] if h != j))
            kept = {h: n for h, n in by_holders.items() if n}
            for j in (j for j, series in gathers.items() if series[at]):
                kept[(j,)] = kept.get((j,), 0) + gathers[j][at]
            shared = tuple(sorted(kept.items()))
        out.append(shared)
    return out


def constant_floor(constraints: list[MemoryConstraint]) -> int:
    """The bytes no plan can remove: the worst moment at which no candidate's activations can be absent."""
    return max((c.base for c in constraints if not c.absent and c.recompute is None), default=0)


def peak_with_plan(constraints: list[MemoryConstraint], freed: Mapping[str, int], transient: Mapping[str, int]) -> int:
    """The step's peak on one device when the modules in ``freed`` are checkpointed, each freeing its bytes."""
    peak = 0
    for c in constraints:
        value = c.base - sum(freed[j] for j in c.absent if j in freed)
        value += sum(b for holders, b in c.kept if any(j in freed for j in holders))
        if c.recompute is not None and c.recompute in freed:
            value += transient.get(c.recompute, 0)
        peak = max(peak, value)
    return peak
