"""Live device memory during the dry run: every storage by category, the running peak, and open intervals.

Storages are tracked, not tensors: views and in-place results share their base's storage and allocate
nothing, which is what an allocator sees. A storage is counted from the op that creates it until its last
tensor dies (a weak reference tells us), rounded as the target's allocator rounds it. Where eager computes in place
what the dry run computes out of place (autograd's gradient sums), the new storage takes the old one's count over.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lightning_sac.dryrun.cuda.trace import TraceRecorder
from lightning_sac.dryrun.data import MemorySnapshot, empty_snapshot

__all__ = ["LiveMemory", "PeakWatch"]

# The trace's key for a workspace: the storages' keys count up from 0.
_TRANSIENT = -1


@dataclass(eq=False)
class PeakWatch:
    """The highest total seen while the watch is open, and the snapshot at that moment."""

    peak_total: int = -1
    peak_snapshot: MemorySnapshot = field(default_factory=empty_snapshot)


class LiveMemory:
    """Bytes of live storages by category, with the step's peak.

    Args:
        round_bytes: Maps a storage's size to what the target allocator reserves for it.
        location: Called at each new peak to say where the step is (e.g. ``"backward:blocks.0"``).
        on_free: Called with a storage's key (its ``id``) and counted bytes when it is freed.
        trace: Records every allocation and free in order (:class:`~lightning_sac.dryrun.cuda.trace.TraceRecorder`),
            for the target's caching allocator model to replay.
    """

    def __init__(
        self,
        round_bytes: Callable[[int], int],
        location: Callable[[], str],
        on_free: Callable[[int, int], None] | None = None,
        trace: TraceRecorder | None = None,
    ) -> None:
        self.trace = trace
        self._round = round_bytes
        self._location = location
        self._on_free = on_free
        # Per live storage (by id): its category, its counted bytes and its key in the trace. The trace's key is a
        # serial, not the id: a result eager computes in place takes over its operand's block (hand_over).
        self._live: dict[int, tuple[str, int, int]] = {}
        self._blocks = 0
        # The weak references must outlive the storages for their callbacks to fire.
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.current: MemorySnapshot = empty_snapshot()
        self.total = 0
        self.peak = PeakWatch()
        self.peak_location = ""
        self._watches: list[PeakWatch] = []
        self._closed = False

    def is_live(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` is already counted."""
        return id(storage) in self._live

    def track(self, storage: torch.UntypedStorage, category: str, nbytes: int | None = None) -> int:
        """Count ``storage`` under ``category`` if it is new; return the bytes added (0 if already live).

        ``nbytes`` is the storage's real size where it differs from the (fake) storage's own.
        """
        key = id(storage)
        if key in self._live:
            return 0
        nbytes = self._round(storage.nbytes() if nbytes is None else nbytes)
        self._live[key] = (category, nbytes, self._blocks)
        self._watch_death(storage)
        if self.trace is not None:
            self.trace.malloc(self._blocks, nbytes, category)
        self._blocks += 1
        self.current[category] += nbytes
        self.total += nbytes
        self._update_peaks()
        return nbytes

    def transient(self, nbytes: int, category: str = "temporary") -> None:
        """Account for ``nbytes`` a kernel allocates and frees within one op (a workspace) at the peaks."""
        if nbytes <= 0:
            return
        if self.trace is not None:
            self.trace.malloc(_TRANSIENT, nbytes, category)
            self.trace.free(_TRANSIENT)
        self.current[category] += nbytes
        self.total += nbytes
        self._update_peaks()
        self.current[category] -= nbytes
        self.total -= nbytes

    def hold(self, nbytes: int, category: str = "other") -> None:
        """Count ``nbytes`` that no storage of the step stands for, from now until the step ends.

        What code outside the dispatcher keeps (a torchmetrics state grown by ``update``, measured on a real copy
        of the metric): there is no tensor whose death would free it, and the step does not free it either.
        """
        if nbytes <= 0:
            return
        nbytes = self._round(nbytes)
        if self.trace is not None:
            self.trace.malloc(self._blocks, nbytes, category)  # a block of its own, never freed in the step
        self._blocks += 1
        self.current[category] += nbytes
        self.total += nbytes
        self._update_peaks()

    def recategorize(self, storage: torch.UntypedStorage, category: str) -> None:
        """Move a live storage to another category (a gradient once it lands in ``.grad``)."""
        key = id(storage)
        if key not in self._live:
            self.track(storage, category)
            return
        old, nbytes, block = self._live[key]
        if self.trace is not None:
            self.trace.recategorize(block, category)
        self.current[old] -= nbytes
        self.current[category] += nbytes
        self._live[key] = (category, nbytes, block)

    def hand_over(self, old: torch.UntypedStorage, new: torch.UntypedStorage) -> None:
        """Count ``new`` as ``old`` from now on: a result eager computes in place, in ``old``'s memory.

        The dry run gave the result a storage of its own (``new``, not yet counted) where eager allocates nothing;
        ``old`` dies with nothing freed, and ``new`` frees ``old``'s bytes (and block) when it dies.
        """
        if not self.is_live(old) or self.is_live(new):
            return
        self._live[id(new)] = self._live.pop(id(old))
        del self._refs[id(old)]  # the dropped weak reference never calls back: old's death frees nothing
        self._watch_death(new)

    def _watch_death(self, storage: torch.UntypedStorage) -> None:
        # id() is only unique while the object lives; the callback drops the key before it can be reused.
        key = id(storage)
        self._refs[key] = weakref.ref(storage, functools.partial(self._on_collected, key))

    def _on_collected(self, key: int, _ref: object) -> None:
        self._free(key)

    def _free(self, key: int) -> None:
        if self._closed or key not in self._live:
            return
        category, nbytes, block = self._live.pop(key)
        del self._refs[key]
        if self.trace is not None:
            self.trace.free(block)
        self.current[category] -= nbytes
        self.total -= nbytes
        if self._on_free is not None:
            self._on_free(key, nbytes)

    def _update_peaks(self) -> None:
        if self.total > self.peak.peak_total:
            self.peak.peak_total = self.total
            self.peak.peak_snapshot = dict(self.current)
            self.peak_location = self._location()
        for watch in self._watches:
            if self.total > watch.peak_total:
                watch.peak_total = self.total
                watch.peak_snapshot = dict(self.current)

    def snapshot(self) -> MemorySnapshot:
        """Return a copy of the live bytes by category."""
        return dict(self.current)

    def open_watch(self) -> PeakWatch:
        """Start watching for the highest total from now on; the current total counts."""
        watch = PeakWatch(self.total, dict(self.current))
        self._watches.append(watch)
        return watch

    def close_watch(self, watch: PeakWatch) -> None:
        """Stop updating ``watch``."""
        if watch in self._watches:
            self._watches.remove(watch)

    def close(self) -> None:
        """Stop counting: storages dying after the step no longer change the numbers."""
        self._closed = True
        self._watches.clear()
