"""A model of PyTorch's CUDA caching allocator: what ``max_memory_allocated``/``max_memory_reserved`` will read.

Replays allocations and frees as ``DeviceCachingAllocator::malloc`` and ``free`` in
``c10/cuda/CUDACachingAllocator.cpp`` serve them (constants and settings: :mod:`.alloc_config`):

- ``round_size``: up to a multiple of 512 bytes (or a power-of-2 division, ``roundup_power2_divisions``); 0 bytes
  allocate nothing. ``get_pool``: up to 1 MiB the small pool, above it the large pool.
- ``get_free_block``: best fit, the smallest free block of the pool that holds the request, ties by address. With
  ``max_split_size`` a smaller request never takes a block of that size or more, and a request of that size or more
  only takes a block less than ``max_non_split_rounding`` (20 MiB) larger.
- ``alloc_block`` with ``get_allocation_size``: when nothing fits, a segment is cudaMalloc'ed (reserved grows by it):
  2 MiB for the small pool, 20 MiB for large requests under 10 MiB, otherwise the request rounded up to 2 MiB.
- ``should_split``: a block is split when at least 512 bytes remain (small pool, expandable segments) or more than
  1 MiB (large pool, requests below ``max_split_size``); otherwise the whole block is handed out, and allocated counts
  it whole (``alloc_found_block``). ``free_block``: a freed block merges with its free neighbours in its segment.
- Free and retry, past a ``capacity`` (what the device, or ``set_per_process_memory_fraction``, lets it hold):
  ``release_available_cached_blocks`` (with ``max_split_size`` only: the smallest free oversize segment that covers
  the request, else oversize segments from the largest down), a retry, then ``release_cached_blocks`` (every free
  whole segment goes back to CUDA; with expandable segments, every whole free page is unmapped), a last retry, and
  only then :class:`OutOfMemory`. So reserved can shrink, and a step needs less than its unbounded reserved peak.

Expandable segments (``expandable_segments:True``): one segment per pool whose address range is backed by pages of
2 MiB (small pool, ``kSmallBuffer``) or 20 MiB (large pool, ``kLargeBuffer``). A request no free block holds takes
the lowest unmapped range (a hole a release left, else the end of the range) with the free block just before it,
and maps the pages it lacks (``try_allocate_expandable_block``, ``find_expandable_block``, ``map_block``); a release
unmaps whole free pages (``unmap_block``). Best fit ranks a block bordering unmapped space by the size it could grow
to (``get_free_block``'s ``expandable_size``).

Not modelled: ``garbage_collection_threshold``; several streams (a freed block is reusable at once); CUDA graph
pools; memory outside the allocator (CUDA context, NCCL). Fresh segments get increasing addresses.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from lightning_sac.dryrun.cuda.alloc_config import UNLIMITED, AllocatorConfig, round_size, segment_bytes

__all__ = ["AllocatorConfig", "CachingAllocatorModel", "OutOfMemory", "round_size", "segment_bytes"]


_DEFAULT = AllocatorConfig()


class OutOfMemory(Exception):  # torch's c10::OutOfMemoryError, raised where the model's capacity runs out
    """A request the model could not serve within its capacity, even after releasing cached memory."""


class _Pool:
    """Free blocks of one pool: sorted by (size, address) for best fit, and by both ends for merging."""

    def __init__(self, small: bool, page: int, base: int) -> None:
        self.small = small
        self.page = page  # expandable segments only
        self.base = base
        self.mapped_end = base  # expandable segments only: where the unmapped tail of the address range begins
        self.holes: dict[int, int] = {}  # expandable segments only: unmapped ranges inside, start -> end
        self.segments: dict[int, int] = {}  # cudaMalloc'ed segments, start -> size
        self.free: list[tuple[int, int]] = []
        self.by_start: dict[int, int] = {}  # address -> size
        self.by_end: dict[int, int] = {}  # end address -> address

    def add(self, addr: int, size: int) -> None:
        insort(self.free, (size, addr))
        self.by_start[addr] = size
        self.by_end[addr + size] = addr

    def remove(self, addr: int, size: int) -> None:
        del self.free[bisect_left(self.free, (size, addr))]
        del self.by_start[addr]
        del self.by_end[addr + size]

    def unmapped_after(self, end: int) -> float:
        """Bytes of unmapped address space starting at ``end`` (the tail is unbounded)."""
        return float("inf") if end == self.mapped_end else self.holes.get(end, end) - end

    def pages(self, nbytes: int) -> int:
        return -(-nbytes // self.page) * self.page


class CachingAllocatorModel:
    """Replays ``malloc``/``free`` calls and tracks allocated and reserved bytes and their peaks.

    Args:
        config: Allocator settings, e.g. ``AllocatorConfig.from_env(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))``.
        capacity: The most bytes the allocator may reserve; past it, cached memory is released and the request
            retried. ``None``: unbounded, nothing is ever released.

    Raises:
        ValueError: ``config.backend`` is ``cudaMallocAsync``, whose pool this model does not describe.
    """

    def __init__(self, config: AllocatorConfig = _DEFAULT, capacity: int | None = None) -> None:
        if config.backend != "native":
            raise ValueError(
                f"CachingAllocatorModel models torch's native allocator, got backend:{config.backend}; drop that "
                "setting from PYTORCH_CUDA_ALLOC_CONF to plan with this model"
            )
        self.config = config
        self.capacity = capacity
        # cudaMalloc'ed segments are laid out from 0 with a gap after each, expandable ones at far-apart bases, so
        # blocks of different segments are never adjacent and never merge.
        self._small = _Pool(True, config.small_buffer, 1 << 80)
        self._large = _Pool(False, config.large_buffer, 1 << 81)
        self._next_segment = 0
        self._live: dict[int, tuple[_Pool, int, int] | None] = {}
        self._allocated = self._reserved = self._peak_allocated = self._peak_reserved = 0
        self.releases = 0  # how often release_cached_blocks ran

    @property
    def allocated(self) -> int:
        """Bytes in blocks handed out now (``torch.cuda.memory_allocated``)."""
        return self._allocated

    @property
    def reserved(self) -> int:
        """Bytes obtained from CUDA now (``torch.cuda.memory_reserved``)."""
        return self._reserved

    @property
    def peak_allocated(self) -> int:
        """The highest ``allocated`` so far (``torch.cuda.max_memory_allocated``)."""
        return self._peak_allocated

    @property
    def peak_reserved(self) -> int:
        """The highest ``reserved`` so far (``torch.cuda.max_memory_reserved``)."""
        return self._peak_reserved

    @property
    def segments(self) -> int:
        """Segments held now; with expandable segments, the pools that have mapped memory."""
        if self.config.expandable_segments:
            return sum(p.mapped_end > p.base for p in (self._small, self._large))
        return len(self._small.segments) + len(self._large.segments)

    def malloc(self, key: int, nbytes: int) -> None:
        """Allocate ``nbytes`` under ``key`` (a storage's id), which must not be live.

        Raises:
            OutOfMemory: Past the capacity even after releasing cached memory.
        """
        if key in self._live:
            raise ValueError(f"malloc: key {key} is still allocated; free it first or allocate under a new key")
        size = round_size(nbytes, self.config)
        if size == 0:
            self._live[key] = None
            return
        cfg = self.config
        pool = self._small if size <= cfg.small_size else self._large
        found = self._best_fit(pool, size) or self._alloc_block(pool, size)
        if found is None and self._release_available(pool, size):
            found = self._alloc_block(pool, size)
        if found is None:
            self.release_cached()
            found = self._alloc_block(pool, size)
        if found is None:
            raise OutOfMemory(f"{size} bytes do not fit in {self.capacity} with {self._reserved} reserved")
        addr, block = found
        rest = block - size
        if pool.small or cfg.expandable_segments:
            split = rest >= cfg.min_block_size
        else:
            split = size < cfg.max_split_size and rest > cfg.small_size
        if split:
            pool.add(addr + size, rest)
            block = size
        self._live[key] = (pool, addr, block)
        self._allocated += block
        self._peak_allocated = max(self._peak_allocated, self._allocated)

    def free(self, key: int) -> None:
        """Free the block allocated under ``key`` and merge it with its free neighbours."""
        if key not in self._live:
            raise KeyError(f"free: key {key} is not allocated (freed twice, or its malloc was not replayed)")
        if (entry := self._live.pop(key)) is None:
            return
        pool, addr, size = entry
        self._allocated -= size
        self._insert_free(pool, addr, size)

    def release_cached(self) -> None:
        """``release_cached_blocks`` (and ``torch.cuda.empty_cache``): give every unused segment or page back."""
        self.releases += 1
        for pool in (self._small, self._large):
            for size, addr in list(pool.free):
                if self.config.expandable_segments:
                    self._unmap(pool, addr, size)
                elif pool.segments.get(addr) == size:
                    self._release_segment(pool, addr, size)

    def _insert_free(self, pool: _Pool, addr: int, size: int) -> tuple[int, int]:
        after = pool.by_start.get(addr + size)
        if after is not None:
            pool.remove(addr + size, after)
            size += after
        before = pool.by_end.get(addr)
        if before is not None:
            pool.remove(before, addr - before)
            addr, size = before, size + addr - before
        pool.add(addr, size)
        return addr, size

    def _best_fit(self, pool: _Pool, size: int) -> tuple[int, int] | None:
        cfg = self.config
        i = bisect_left(pool.free, (size, -1))
        if i == len(pool.free):
            return None
        if cfg.expandable_segments:
            # torch ranks a block bordering unmapped space by what it could grow to: smaller such sizes first.
            def growable(j: int) -> float:
                block, addr = pool.free[j]
                return block + pool.unmapped_after(addr + block)

            while i + 1 < len(pool.free) and growable(i + 1) < growable(i):
                i += 1
        block, addr = pool.free[i]
        if size < cfg.max_split_size <= block:
            return None
        if size >= cfg.max_split_size and block >= size + cfg.max_non_split_rounding:
            return None
        pool.remove(addr, block)
        return addr, block

    def _fits(self, nbytes: int) -> bool:
        return self.capacity is None or self._reserved + nbytes <= self.capacity

    def _grow(self, nbytes: int) -> None:
        self._reserved += nbytes
        self._peak_reserved = max(self._peak_reserved, self._reserved)

    def _alloc_block(self, pool: _Pool, size: int) -> tuple[int, int] | None:
        """Reserve memory for a request no free block holds: the block (address, size) that serves it, or None."""
        if self.config.expandable_segments:
            return self._map(pool, size)
        block = segment_bytes(size, self.config)  # size is rounded already: rounding again keeps it
        if not self._fits(block):
            return None
        addr = self._next_segment
        self._next_segment += block + self.config.min_block_size
        pool.segments[addr] = block
        self._grow(block)
        return addr, block

    def _map(self, pool: _Pool, size: int) -> tuple[int, int] | None:
        """``try_allocate_expandable_block``: the lowest unmapped range, with the free block before it, mapped."""
        for start in [*sorted(pool.holes), pool.mapped_end]:
            begin = pool.by_end.get(start, start)
            walk, cur, total = [], begin, 0
            while total < size:  # has_available_address_space: free blocks and unmapped ranges, in a row
                if cur in pool.by_start:
                    n, mapped = pool.by_start[cur], False
                elif cur in pool.holes or cur == pool.mapped_end:
                    end = pool.holes.get(cur, cur + pool.pages(size - total))
                    n, mapped = min(pool.pages(size - total), end - cur), True
                else:
                    break  # an allocated block: no room here
                walk.append((cur, n, mapped))
                cur, total = cur + n, total + n
            if total < size:
                continue
            new = sum(n for _, n, mapped in walk if mapped)
            if not self._fits(new):
                return None
            for addr, n, mapped in walk:
                if not mapped:
                    pool.remove(addr, n)
                elif addr == pool.mapped_end:
                    pool.mapped_end += n
                else:
                    end = pool.holes.pop(addr)
                    if addr + n < end:
                        pool.holes[addr + n] = end
            self._grow(new)
            addr, block = self._insert_free(pool, begin, cur - begin)
            pool.remove(addr, block)
            return addr, block
        raise AssertionError("the unmapped tail always has room")  # pragma: no cover

    def _unmap(self, pool: _Pool, addr: int, size: int) -> None:
        """``unmap_block``: the whole pages inside the free block ``[addr, addr + size)`` go back to CUDA."""
        first = pool.base + pool.pages(addr - pool.base)
        last = pool.base + (addr + size - pool.base) // pool.page * pool.page
        if first >= last:
            return
        pool.remove(addr, size)
        if first > addr:
            pool.add(addr, first - addr)
        if addr + size > last:
            pool.add(last, addr + size - last)
        self._reserved -= last - first
        start = next((s for s, e in pool.holes.items() if e == first), first)
        end = pool.holes.pop(last, last)
        pool.holes.pop(start, None)
        if end == pool.mapped_end:
            pool.mapped_end = start
        else:
            pool.holes[start] = end

    def _release_segment(self, pool: _Pool, addr: int, size: int) -> None:
        pool.remove(addr, size)
        del pool.segments[addr]
        self._reserved -= size

    def _release_available(self, pool: _Pool, size: int) -> bool:
        """``release_available_cached_blocks``: free oversize segments (only with ``max_split_size``) for a request."""
        cfg = self.config
        if cfg.max_split_size == UNLIMITED or cfg.expandable_segments:
            return False
        key = max(size, cfg.max_split_size)
        i = bisect_left(pool.free, (key, -1))
        if i < len(pool.free):  # one oversize block covers it: oversize blocks are never split, so a whole segment
            self._release_segment(pool, pool.free[i][1], pool.free[i][0])
            return True
        whole = [(s, a) for s, a in pool.free if s >= cfg.max_split_size and pool.segments.get(a) == s]
        released = 0
        for s, a in reversed(whole):  # several oversize segments, the largest first, until they cover the request
            if released >= key:
                break
            self._release_segment(pool, a, s)
            released += s
        return released >= key
