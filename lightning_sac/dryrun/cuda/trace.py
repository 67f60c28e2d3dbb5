"""The dry run's allocations and frees, in order, kept for the caching allocator model to replay.

The profile of a CUDA target keeps them (:attr:`~lightning_sac.dryrun.data.ModelProfile.allocations`), so that the
allocator model can replay not only the step that was recorded but the step a plan makes of it (a checkpointed
module frees activations after its forward and makes them again in its backward: ``lightning_sac.plan``), and under
a capacity, where torch releases cached memory and retries before it runs out (:func:`needed_reserved`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_sac.dryrun.cuda.alloc_config import AllocatorConfig
from lightning_sac.dryrun.cuda.allocator import CachingAllocatorModel, OutOfMemory

__all__ = ["AllocationTrace", "AllocatorPeak", "Replayed", "TraceRecorder", "needed_reserved", "replay", "simulate"]

# What FSDP divides among ranks: a storage of these categories, or one the optimizer step makes (it steps the shards).
_SHARDED_CATEGORIES = frozenset({"parameter", "gradient", "optimizer_state"})
_DEFAULT = AllocatorConfig()
_MIB = 1 << 20


@dataclass(kw_only=True)
class AllocationTrace:
    """Every allocation and free of a recorded step on a CUDA target, in order.

    Attributes:
        events: Per event, ``s`` (``>= 0``) for the allocation of storage ``s``, ``-s - 1`` for its free. A kernel's
            workspace is a storage allocated and freed at once.
        sizes: Per storage, its bytes on the target (rounded as the target's allocator rounds them).
        ops: Per storage, the forward op that made it (an index into the dry run's op records: a module's op ``i``
            is ``module_ops[fqn] + i``), or -1 (made before the step, in backward or by the optimizer).
        sharded: Per storage, whether FSDP divides it among ranks: a parameter, a gradient, optimizer state, or a
            storage the optimizer step makes.
        marks: Per event of the profile's timeline, how many trace events came before it.
        module_ops: Per module, the index of the first op of its (first) forward.
        alloc_conf: The ``PYTORCH_ALLOC_CONF`` (or ``PYTORCH_CUDA_ALLOC_CONF``) the dry run ran under.
    """

    events: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    ops: list[int] = field(default_factory=list)
    sharded: list[bool] = field(default_factory=list)
    marks: list[int] = field(default_factory=list)
    module_ops: dict[str, int] = field(default_factory=dict)
    alloc_conf: str | None = None

    @property
    def config(self) -> AllocatorConfig:
        """The allocator settings the step ran under."""
        return AllocatorConfig.from_env(self.alloc_conf)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AllocationTrace:
        """Rebuild from :func:`dataclasses.asdict` output."""
        return cls(**d)


class TraceRecorder:
    """Builds an :class:`AllocationTrace` while the dry run tracks storages by key (their ``id``).

    Args:
        alloc_conf: The allocator settings of this process.
    """

    def __init__(self, alloc_conf: str | None) -> None:
        self.trace = AllocationTrace(alloc_conf=alloc_conf)
        self.op = -1  # the forward op running now, set by the recorder
        self.sharding_new = False  # storages made now are divided by FSDP (the optimizer step's)
        self._live: dict[int, int] = {}  # key -> storage index

    def malloc(self, key: int, nbytes: int, category: str) -> None:
        """A storage of ``nbytes`` (rounded) is allocated under ``key``."""
        t = self.trace
        s = len(t.sizes)
        t.sizes.append(nbytes)
        t.ops.append(self.op)
        t.sharded.append(self.sharding_new or category in _SHARDED_CATEGORIES)
        t.events.append(s)
        self._live[key] = s

    def free(self, key: int) -> None:
        """The storage under ``key`` is freed."""
        s = self._live.pop(key, None)
        if s is not None:
            self.trace.events.append(-s - 1)

    def recategorize(self, key: int, category: str) -> None:
        """The storage under ``key`` became ``category`` (a gradient, once autograd puts it in ``.grad``)."""
        s = self._live.get(key)
        if s is not None and category in _SHARDED_CATEGORIES:
            self.trace.sharded[s] = True

    def mark(self) -> None:
        """A timeline event happens now."""
        self.trace.marks.append(len(self.trace.events))


@dataclass(frozen=True)
class AllocatorPeak:
    """The peaks of a replayed run, as ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` report them."""

    allocated: int
    reserved: int


@dataclass(frozen=True)
class Replayed:
    """What a replay of a trace gives.

    Attributes:
        tensors: The highest sum of live storages' bytes (the profile's peak, when nothing else is counted).
        allocated: The highest ``max_memory_allocated`` (whole blocks).
        reserved: The highest ``max_memory_reserved``.
    """

    tensors: int
    allocated: int
    reserved: int

    @property
    def fragmentation(self) -> int:
        """What the allocator reserves beyond the tensors' peak."""
        return max(0, self.reserved - self.tensors)


def replay(
    events: Iterable[int], sizes: Sequence[int], config: AllocatorConfig = _DEFAULT, capacity: int | None = None
) -> Replayed:
    """Replay trace ``events`` over storages of ``sizes`` (see :class:`AllocationTrace`).

    Raises:
        OutOfMemory: With a ``capacity``, a request that does not fit even after releasing cached memory.
    """
    model = CachingAllocatorModel(config, capacity)
    live = peak = 0
    for e in events:
        if e >= 0:
            model.malloc(e, sizes[e])
            live += sizes[e]
            peak = max(peak, live)
        else:
            model.free(-e - 1)
            live -= sizes[-e - 1]
    return Replayed(peak, model.peak_allocated, model.peak_reserved)


def needed_reserved(
    events: Sequence[int], sizes: Sequence[int], config: AllocatorConfig = _DEFAULT, unbounded: Replayed | None = None
) -> Replayed:
    """The least reserved peak the step runs in, when the allocator frees cached memory and retries before an OOM.

    Bisects the capacity between the tensors' peak (too little: blocks are never smaller) and the reserved peak of
    the replay without one (enough: nothing is ever released), to within 2 MiB (a small segment) or 1/32 of that
    range, whichever is more; what comes back is a replay under a capacity that ran.

    Args:
        events: The trace's events.
        sizes: Per storage, its bytes.
        config: Allocator settings.
        unbounded: The replay without a capacity, if already made.
    """
    best = unbounded or replay(events, sizes, config)
    low, high = best.tensors - 1, best.reserved
    step = max(2 * _MIB, (high - low) // 32)
    while high - low > step:
        capacity = (low + high) // 2
        try:
            run = replay(events, sizes, config, capacity)
        except OutOfMemory:
            low = capacity
            continue
        best, high = run, min(capacity, run.reserved)
    return best


def simulate(
    events: Iterable[tuple[str, int, int]], config: AllocatorConfig = _DEFAULT, capacity: int | None = None
) -> AllocatorPeak:
    """Replay ``("malloc", key, nbytes)`` and ``("free", key, 0)`` events and return the peaks.

    Raises:
        OutOfMemory: With a ``capacity``, a request that does not fit even after releasing cached memory.
    """
    model = CachingAllocatorModel(config, capacity)
    for op, key, nbytes in events:
        if op == "malloc":
            model.malloc(key, nbytes)
        elif op == "free":
            model.free(key)
        else:
            raise ValueError(f"simulate: expected an event 'malloc' or 'free', got {op!r}")
    return AllocatorPeak(model.peak_allocated, model.peak_reserved)
