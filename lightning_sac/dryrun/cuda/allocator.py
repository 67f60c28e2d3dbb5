"""A model of PyTorch's CUDA caching allocator: what ``max_memory_allocated``/``max_memory_reserved`` will read.

Replays allocations and frees as ``DeviceCachingAllocator`` in ``c10/cuda/CUDACachingAllocator.cpp`` serves them:

- ``round_size``: up to a multiple of 512 bytes (or a power-of-2 division, ``roundup_power2_divisions``); 0 bytes
  allocate nothing. ``get_pool``: up to 1 MiB the small pool, above it the large pool.
- ``get_free_block``: best fit, the smallest free block of the pool that holds the request, ties by address. With
  ``max_split_size`` a smaller request never takes a block of that size or more, and a request of that size or more
  only takes a block less than ``max_non_split_rounding`` (20 MiB) larger.
- ``get_allocation_size``: when nothing fits, a segment is cudaMalloc'ed (reserved grows by it): 2 MiB for the small
  pool, 20 MiB for large requests under 10 MiB, otherwise the request rounded up to 2 MiB.
- ``should_split``: a block is split when at least 512 bytes remain (small pool, expandable segments) or more than
  1 MiB (large pool, requests below ``max_split_size``); otherwise the whole block is handed out, and allocated counts
  the whole block (``alloc_found_block`` adds ``block->size``). ``free_block``: a freed block merges with its free
  neighbours in its segment.

Expandable segments (``expandable_segments:True``): one segment per pool whose address range grows by mapping pages
of 2 MiB (small pool, ``kSmallBuffer``) or 20 MiB (large pool, ``kLargeBuffer``; ``find_expandable_block``). A request
no free block holds takes the free block ending the mapped range, if any, plus the pages it lacks
(``try_allocate_expandable_block``): reserved is the high-water mark of used address space rounded up to pages. Holes
inside the range stay holes. Best fit takes the block bordering unmapped space last (``expandable_size``).

Not modelled, so this predicts the peak of a run that fits its device: the OOM path (releasing cached segments,
unmapping pages, ``empty_cache``), the only way reserved shrinks; ``garbage_collection_threshold`` (needs a memory
fraction); several streams (a freed block is reusable at once); CUDA graph pools; memory outside the allocator (CUDA
context, NCCL). Fresh segments are assumed at increasing addresses, which only breaks ties between equal free blocks.
"""

from __future__ import annotations

import re
from bisect import bisect_left, insort
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["AllocatorConfig", "AllocatorPeak", "CachingAllocatorModel", "round_size", "segment_bytes", "simulate"]

MiB = 1 << 20
UNLIMITED = (1 << 64) - 1  # torch's default max_split_size: SIZE_MAX, every block may be split
_INTERVALS = 16  # roundup_power2_divisions has one entry per power of 2 from 1 MiB to 64 GiB
_CHOICES: dict[str, dict[str, object]] = {
    "expandable_segments": {"True": True, "False": False},
    "backend": {"native": "native", "cudaMallocAsync": "cudaMallocAsync"},
}
_OPTION = re.compile(r"([^,:\[\]]+):(\[[^\]]*\]|[^,:\[\]]+)(?:,|$)")


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator's constants and the settings of ``PYTORCH_CUDA_ALLOC_CONF`` that change what it reserves.

    Attributes:
        min_block_size: kMinBlockSize, requests are rounded up to a multiple of it.
        small_size: kSmallSize, the largest request of the small pool, whose segments (and pages) are small_buffer.
        small_buffer: kSmallBuffer.
        min_large_alloc: kMinLargeAlloc; a large request below it gets a large_buffer segment.
        large_buffer: kLargeBuffer, also the large pool's expandable page size.
        round_large: kRoundLarge; requests of min_large_alloc or more get their size rounded up to it.
        expandable_segments: ``expandable_segments:True``: one growing segment per pool.
        max_split_size: ``max_split_size_mb`` in bytes; blocks this large are not split.
        max_non_split_rounding: ``max_non_split_rounding_mb`` in bytes; how much larger an unsplit block may be.
        roundup_power2_divisions: ``roundup_power2_divisions``, divisions per power-of-2 interval from 1 MiB.
        backend: ``native`` (modelled here) or ``cudaMallocAsync`` (CUDA's own pool, not modelled).
    """

    min_block_size: int = 512
    small_size: int = MiB
    small_buffer: int = 2 * MiB
    min_large_alloc: int = 10 * MiB
    large_buffer: int = 20 * MiB
    round_large: int = 2 * MiB
    expandable_segments: bool = False
    max_split_size: int = UNLIMITED
    max_non_split_rounding: int = 20 * MiB
    roundup_power2_divisions: tuple[int, ...] = (0,) * _INTERVALS
    backend: str = "native"

    @classmethod
    def from_env(cls, value: str | None) -> AllocatorConfig:
        """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) string such as ``expandable_segments:True``.

        Keys that do not change device memory here (``pinned_*``, ``garbage_collection_threshold``) and unknown keys
        are ignored, as torch skips unknown keys.

        Raises:
            ValueError: The string is not ``key:value`` pairs separated by commas, or a value is not what torch accepts.
        """
        if not value:
            return cls()
        settings: dict[str, object] = {}
        for key, text in _options(value):
            if key in _CHOICES:
                if text not in _CHOICES[key]:
                    raise _bad(key, " or ".join(_CHOICES[key]), text)
                settings[key] = _CHOICES[key][text]
            elif key in ("max_split_size_mb", "max_non_split_rounding_mb"):
                minimum = cls.large_buffer // MiB  # torch refuses less than kLargeBuffer
                mb = _whole(key, text, f"a whole number of MB >= {minimum}", minimum)
                settings[key.removesuffix("_mb")] = mb * MiB
            elif key == "roundup_power2_divisions":
                settings[key] = _divisions(text)
        return cls(**settings)  # type: ignore[arg-type]


@dataclass(frozen=True)
class AllocatorPeak:
    """The peaks of a replayed run, as ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` report them."""

    allocated: int
    reserved: int


def round_size(nbytes: int, config: AllocatorConfig = AllocatorConfig()) -> int:
    """The block size the allocator hands out for a request of ``nbytes`` (0 for a zero-byte request)."""
    if nbytes < 0:
        raise ValueError(f"round_size: expected a number of bytes >= 0, got {nbytes}")
    step = config.min_block_size if nbytes else 1
    index = min(max(nbytes.bit_length() - 21, 0), _INTERVALS - 1)  # interval [2**(20+i), 2**(21+i)) bytes
    divisions = config.roundup_power2_divisions[index]
    if divisions > 1 and nbytes > step * divisions:
        # torch's roundup_power2_next_division: the next of `divisions` equal steps between two powers of 2
        step = (1 << (nbytes.bit_length() - 1)) >> (divisions.bit_length() - 1)
    return -(-nbytes // step) * step


def segment_bytes(nbytes: int, config: AllocatorConfig = AllocatorConfig()) -> int:
    """What a request of ``nbytes`` reserves when no cached block holds it and its pool has no memory yet.

    Without expandable segments, the segment cudaMalloc'ed (torch's ``get_allocation_size``); with them, the pages.
    """
    size = round_size(nbytes, config)
    if config.expandable_segments:
        page = config.small_buffer if size <= config.small_size else config.large_buffer
        return -(-size // page) * page
    if size <= config.small_size:
        return config.small_buffer if size else 0
    if size < config.min_large_alloc:
        return config.large_buffer
    return -(-size // config.round_large) * config.round_large


class _Pool:
    """Free blocks of one pool: sorted by (size, address) for best fit, and by both ends for merging."""

    def __init__(self, small: bool, page: int, base: int) -> None:
        self.small = small
        self.page = page  # expandable segments only
        self.base = base
        self.mapped_end = base  # expandable segments only: end of the mapped address range
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


class CachingAllocatorModel:
    """Replays ``malloc``/``free`` calls and tracks allocated and reserved bytes and their peaks.

    Args:
        config: Allocator settings, e.g. ``AllocatorConfig.from_env(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))``.

    Raises:
        ValueError: ``config.backend`` is ``cudaMallocAsync``, whose pool this model does not describe.
    """

    def __init__(self, config: AllocatorConfig = AllocatorConfig()) -> None:
        if config.backend != "native":
            raise ValueError(
                f"CachingAllocatorModel models torch's native allocator, got backend:{config.backend}; drop that "
                "setting from PYTORCH_CUDA_ALLOC_CONF to plan with this model"
            )
        self.config = config
        # cudaMalloc'ed segments are laid out from 0 with a gap after each, expandable ones at far-apart bases, so
        # blocks of different segments are never adjacent and never merge.
        self._small = _Pool(True, config.small_buffer, 1 << 80)
        self._large = _Pool(False, config.large_buffer, 1 << 81)
        self._next_segment = 0
        self._live: dict[int, tuple[_Pool, int, int] | None] = {}
        self._allocated = self._reserved = self._peak_allocated = self._peak_reserved = self._segments = 0

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
        """Segments cudaMalloc'ed; with expandable segments, the pools that have mapped memory."""
        return self._segments

    def malloc(self, key: int, nbytes: int) -> None:
        """Allocate ``nbytes`` under ``key`` (a storage's id), which must not be live."""
        if key in self._live:
            raise ValueError(f"malloc: key {key} is still allocated; free it first or allocate under a new key")
        size = round_size(nbytes, self.config)
        if size == 0:
            self._live[key] = None
            return
        cfg = self.config
        pool = self._small if size <= cfg.small_size else self._large
        addr, block = self._best_fit(pool, size) or self._new_memory(pool, size)
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
        after = pool.by_start.get(addr + size)
        if after is not None:
            pool.remove(addr + size, after)
            size += after
        before = pool.by_end.get(addr)
        if before is not None:
            pool.remove(before, addr - before)
            addr, size = before, size + addr - before
        pool.add(addr, size)

    def _best_fit(self, pool: _Pool, size: int) -> tuple[int, int] | None:
        cfg = self.config
        i = bisect_left(pool.free, (size, -1))
        if i == len(pool.free):
            return None
        block, addr = pool.free[i]
        if cfg.expandable_segments and addr + block == pool.mapped_end and i + 1 < len(pool.free):
            # torch ranks the block bordering unmapped space by what it could grow to: any other fitting block first.
            block, addr = pool.free[i + 1]
        if size < cfg.max_split_size <= block:
            return None
        if size >= cfg.max_split_size and block >= size + cfg.max_non_split_rounding:
            return None
        pool.remove(addr, block)
        return addr, block

    def _new_memory(self, pool: _Pool, size: int) -> tuple[int, int]:
        """Reserve memory for a request no free block holds; returns the block (address, size) that serves it."""
        cfg = self.config
        if cfg.expandable_segments:
            end = pool.mapped_end
            self._segments += int(end == pool.base)
            addr = pool.by_end.get(end, end)  # a free block ending the mapped range grows by the new pages
            if addr != end:
                pool.remove(addr, end - addr)
            grown = -(-max(size - (end - addr), 0) // pool.page) * pool.page
            pool.mapped_end = end + grown
            block = pool.mapped_end - addr
        else:
            addr = self._next_segment
            grown = block = segment_bytes(size, cfg)  # size is rounded already: rounding again keeps it
            self._next_segment += block + cfg.min_block_size
            self._segments += 1
        self._reserved += grown
        self._peak_reserved = max(self._peak_reserved, self._reserved)
        return addr, block


def simulate(events: Iterable[tuple[str, int, int]], config: AllocatorConfig = AllocatorConfig()) -> AllocatorPeak:
    """Replay ``("malloc", key, nbytes)`` and ``("free", key, 0)`` events and return the peaks."""
    model = CachingAllocatorModel(config)
    for op, key, nbytes in events:
        if op == "malloc":
            model.malloc(key, nbytes)
        elif op == "free":
            model.free(key)
        else:
            raise ValueError(f"simulate: expected an event 'malloc' or 'free', got {op!r}")
    return AllocatorPeak(model.peak_allocated, model.peak_reserved)


def _options(text: str) -> list[tuple[str, str]]:
    """Split ``key:value,key:[a:b,>:c]`` into (key, value) pairs; whitespace is dropped, as torch's tokenizer does."""
    text = "".join(text.split())
    options, pos = [], 0
    while pos < len(text):
        match = _OPTION.match(text, pos)
        if match is None:
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: expected 'key:value' options separated by commas, got {text!r}")
        options.append((match[1], match[2]))
        pos = match.end()
    return options


def _bad(key: str, expected: str, got: str) -> ValueError:
    return ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} expects {expected}, got {got!r}")


def _whole(key: str, text: str, expected: str, minimum: int = 0, power_of_2: bool = False) -> int:
    n = int(text) if text.isdigit() else -1
    if n < minimum or (power_of_2 and n & (n - 1)):
        raise _bad(key, expected, text)
    return n


def _divisions(text: str) -> tuple[int, ...]:
    """``N`` (a power of 2, for every interval) or ``[1:4,64:8,>:2]`` (MB boundary: divisions, 0 disables)."""
    key = "roundup_power2_divisions"
    if not text.startswith("["):
        return (_whole(key, text, "a power of 2 or [MB:divisions,...,>:divisions]", 1, True),) * _INTERVALS
    table, last, first = [0] * _INTERVALS, 0, True
    for entry in filter(None, text[1:-1].split(",")):
        bound, _, count = entry.partition(":")
        n = _whole(key, count, "divisions that are 0 or a power of 2", 0, True)
        if bound == ">":  # every interval after the last one named
            table[last + 1 :] = [n] * (_INTERVALS - last - 1)
            continue
        mb = _whole(key, bound, "interval boundaries in MB that are powers of 2", 1, True)
        last = min(mb.bit_length() - 1, _INTERVALS - 1)
        if first:  # the first boundary named also covers the intervals below it
            table[:last] = [n] * last
            first = False
        table[last] = n
    return tuple(table)
