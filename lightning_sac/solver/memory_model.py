"""The memory model of a training step under a checkpointing plan, shared by the MILP and by plain evaluation.

The profile's timeline holds the live bytes at every module boundary and the peak until the next one. A
checkpointed module ``j`` frees ``d_j`` bytes of activations from the end of its forward until its backward
begins, when recompute brings them back; during that recompute its forward's temporaries come back too. A
checkpoint also keeps its inputs until its backward is over: an input the plain step frees in the meantime
(nothing saved it) stays alive from the interval it would have been freed in (:attr:`ModuleProfile.freed_inputs`).
So
every timeline interval gives one constraint: its peak, minus what the checkpointed modules whose activations
are absent throughout it free, plus the inputs they keep, is within the budget. Parameters, gradients and
optimizer state are divided by the world size when sharded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lightning_sac.profiling.data import MemorySnapshot, ModelProfile, ModuleProfile

__all__ = [
    "MemoryConstraint",
    "activation_windows",
    "backward_ends",
    "constant_floor",
    "ddp_bucket_bytes",
    "device_bytes",
    "memory_constraints",
    "peak_with_plan",
]

_SHARDED = ("parameter", "gradient", "optimizer_state")


def device_bytes(snapshot: MemorySnapshot, world_size: int, sharding: str, bucket_bytes: int = 0) -> int:
    """Bytes on one device: sharded training keeps 1/world_size of parameters, gradients and optimizer state.

    Replicated training on more than one device adds ``bucket_bytes``: DDP's reducer keeps its gradient buckets
    (one flat copy of the trainable gradients) from its construction on (:func:`ddp_bucket_bytes`).
    """
    total = sum(snapshot.values())
    if sharding == "sharded" and world_size > 1:
        shardable = sum(snapshot.get(k, 0) for k in _SHARDED)
        total -= shardable - -(-shardable // world_size)  # keep the ceiling of the per-device share
    if sharding == "replicated" and world_size > 1:
        total += bucket_bytes
    return total


def ddp_bucket_bytes(profile: ModelProfile) -> int:
    """Bytes of DDP's gradient buckets for this model: every trainable parameter's gradient, once.

    Measured on 2 gloo processes: a DDP step's peak is the single-process peak plus exactly these bytes, with
    ``gradient_as_bucket_view`` on or off (Lightning sets gradients to ``None``, so the views do not persist).
    """
    root = profile.modules.get("")
    return 0 if root is None else root.gradient_bytes


def _held(module: ModuleProfile) -> list[list[int]]:
    """``[timeline index, bytes]`` a checkpoint of the module keeps alive that the plain step frees earlier.

    Its inputs, and its output when its output op must stay saved (a stateful op's), each from when the plain
    step frees it until the module's backward is over.
    """
    stats = module.op_stats
    keeps_output = stats is not None and bool(stats.output_ops) and stats.output_ops[-1] in stats.stateful_ops
    return module.freed_inputs + (module.freed_outputs if keeps_output else [])


def backward_ends(profile: ModelProfile) -> dict[str, int]:
    """Per module, the timeline index of its (first) backward's end."""
    ends: dict[str, int] = {}
    for k, e in enumerate(profile.timeline):
        if e.kind == "bwd_post":
            ends.setdefault(e.name, k)
    return ends


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
        kept: ``(candidate, bytes)``: inputs the plain step has freed by this moment that the candidate's
            checkpoint keeps alive, counted when it is checkpointed.
    """

    base: int
    absent: frozenset[str]
    recompute: str | None = None
    kept: tuple[tuple[str, int], ...] = ()


def memory_constraints(
    profile: ModelProfile,
    windows: Mapping[str, tuple[int, int]],
    *,
    world_size: int = 1,
    sharding: str = "replicated",
) -> list[MemoryConstraint]:
    """The constraints of a step, merged so that each set of absent candidates appears once with its worst base.

    Args:
        profile: The profile with its timeline.
        windows: Per candidate fqn, ``(timeline index of its forward's end, timeline index of its backward's
            start)``: its activations can be absent in the intervals between the two.
        world_size: Devices the step runs on.
        sharding: ``"replicated"`` or ``"sharded"``.
    """
    worst: dict[tuple[frozenset[str], str | None, tuple[tuple[str, int], ...]], int] = {}
    bucket = ddp_bucket_bytes(profile)

    ends = backward_ends(profile)
    holding = {j: _held(profile.modules[j]) for j in windows}

    def add(base: int, absent: frozenset[str], recompute: str | None, at: int) -> None:
        # A checkpoint holds its inputs until its backward ends; those the plain step freed by now are extra.
        kept = tuple(
            (j, b)
            for j in sorted(holding)
            if at < ends.get(j, len(profile.timeline)) and (b := sum(n for d, n in holding[j] if d <= at))
        )
        key = (absent, recompute, kept)
        worst[key] = max(worst.get(key, base), base)

    timeline = profile.timeline
    for k, event in enumerate(timeline):
        snapshot = event.peak_after or event.at
        absent = frozenset(j for j, (end_fwd, begin_bwd) in windows.items() if end_fwd <= k < begin_bwd)
        add(device_bytes(snapshot, world_size, sharding, bucket), absent, None, k)
    for j, (_, begin_bwd) in windows.items():
        at = timeline[begin_bwd].at
        absent = frozenset(i for i, (end_fwd, b) in windows.items() if end_fwd <= begin_bwd < b)
        add(device_bytes(at, world_size, sharding, bucket), absent, j, begin_bwd)
    return [MemoryConstraint(base, absent, recompute, kept) for (absent, recompute, kept), base in worst.items()]


def constant_floor(constraints: list[MemoryConstraint]) -> int:
    """The bytes no plan can remove: the worst moment at which no candidate's activations can be absent."""
    return max((c.base for c in constraints if not c.absent and c.recompute is None), default=0)


def peak_with_plan(constraints: list[MemoryConstraint], freed: Mapping[str, int], transient: Mapping[str, int]) -> int:
    """The step's peak on one device when the modules in ``freed`` are checkpointed, each freeing its bytes."""
    peak = 0
    for c in constraints:
        value = c.base - sum(freed[j] for j in c.absent if j in freed) + sum(b for j, b in c.kept if j in freed)
        if c.recompute is not None and c.recompute in freed:
            value += transient.get(c.recompute, 0)
        peak = max(peak, value)
    return peak
