"""The CUDA caching allocator's constants and the settings a user passes it, as torch reads them.

``c10/cuda/CUDACachingAllocator.cpp`` fixes the constants (``kMinBlockSize`` 512 bytes, ``kSmallSize`` 1 MiB,
``kSmallBuffer`` 2 MiB, ``kMinLargeAlloc`` 10 MiB, ``kLargeBuffer`` 20 MiB, ``kRoundLarge`` 2 MiB) and
``c10/cuda/CUDAAllocatorConfig.cpp`` parses ``PYTORCH_ALLOC_CONF`` (or its older name ``PYTORCH_CUDA_ALLOC_CONF``):
``expandable_segments``, ``max_split_size_mb``, ``max_non_split_rounding_mb``, ``roundup_power2_divisions`` and
``backend`` change what the allocator reserves; the other keys do not, and unknown keys are skipped as torch skips
them. ``round_size`` and ``get_allocation_size`` of the allocator are :func:`round_size` and :func:`segment_bytes`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = ["MiB", "UNLIMITED", "AllocatorConfig", "alloc_conf", "round_size", "segment_bytes"]

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


def alloc_conf() -> str | None:
    """This process's allocator settings: ``PYTORCH_ALLOC_CONF``, else ``PYTORCH_CUDA_ALLOC_CONF``, else ``None``."""
    # torch reads PYTORCH_ALLOC_CONF first; PYTORCH_CUDA_ALLOC_CONF is its older, deprecated name.
    return os.environ.get("PYTORCH_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))


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
