"""Scratch the CPU's convolution, norm, resampling and pooling kernels allocate, measured on the kernel itself.

A fake kernel makes an op's outputs and nothing else, but many CPU kernels allocate and free buffers inside the
call: oneDNN reorders a convolution's operands into its blocked layouts (up to 5.3x the input for a contiguous
input, a buffer of the output's size for a three-channel stem, almost nothing for a channels-last input), and norm,
resampling and pooling kernels copy an operand of another layout into a contiguous one. These sizes depend
on the kernel oneDNN picks for the shapes, layout, dtype and thread count, not on one formula, so they are taken
from the kernel: the first call of each signature (op, shapes, strides, dtypes, every other argument, thread
count) runs once on zero-filled real tensors of the same layout, and the allocator's events during the call give
its peak beyond the outputs it returns. The answer is cached for the process, so a network of many identical
blocks, a later dry run and a re-plan for another batch shape measure nothing twice, and on disk in the user's
cache directory (:mod:`lightning_sac.dryrun.cpu.scratch_store`), so that a re-run of a script, each rank of a DDP
job and a resumed fit measure nothing their host measured before. A plan reused from a checkpoint or
``plan_path`` needs no dry run, hence no measurement.

The measurement runs outside the dry run's fake mode and every dispatch and function mode, without autograd or
autocast, and draws no random numbers: the dry run, the model and the random stream see nothing of it. A signature
whose operands would take more than :func:`probe_limit_bytes` (1 GiB, or a quarter of the host's free memory when
that is less), or that arrives while a profiler is already recording and is in neither cache, is not run: it is
charged :func:`scratch_bound`, an upper bound of every signature measured above 4 MiB (docs/benchmarks.md).

What a first measurement costs is the kernel's call, which is small (32 signatures of a bottleneck ResNet: 13 to
21 ms on one thread), and on several threads the wait of each parallel region for its OpenMP workers: 20 to 30 ms
a signature on two threads of a host whose other core is busy, also when the calls run back to back, while filling
the zeros takes 2% of it (docs/benchmarks.md). The thread count is part of the answer, so it cannot be lowered for
the measurement; the disk cache is what makes a fresh process as fast as before the scratch was measured.
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.autograd import profiler_legacy
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from lightning_sac.dryrun.cpu.scratch_store import ScratchStore, default_cache_dir

__all__ = [
    "MEASURED_OPS",
    "KernelScratch",
    "call_signature",
    "kernel_scratch",
    "peak_beyond",
    "probe_limit_bytes",
    "real_zeros_like",
    "scratch_bound",
]

aten = torch.ops.aten
GIB = 2**30

_CONVOLUTION = aten.convolution.default
_CONVOLUTION_BACKWARD = aten.convolution_backward.default

# The ops whose CPU kernel was measured to allocate beyond its outputs (torch 2.13, oneDNN, two threads; the
# figures are in docs/benchmarks.md). Every other op is charged only its outputs, as its fake kernel makes them.
MEASURED_OPS = frozenset(
    {
        _CONVOLUTION,  # oneDNN reorders: 0.5x to 1x input + output for contiguous inputs
        _CONVOLUTION_BACKWARD,  # 1.0x input + grad_output for contiguous inputs, up to 2.7x for a 7x7/2 stem
        aten.native_batch_norm_backward.default,  # up to 1x the input
        aten.native_layer_norm.default,  # a contiguous copy of a permuted input (ConvNeXt's channels-last norm)
        aten.native_layer_norm_backward.default,
        aten._log_softmax.default,  # a contiguous copy of channels-last logits
        aten.upsample_nearest2d.default,  # contiguous copies of input and output: 1.25x the output for 2x
        aten.upsample_bilinear2d.default,
        aten.im2col.default,
        aten.max_pool2d_with_indices_backward.default,  # channels-last input, contiguous gradient: 1.5x the input
        aten.avg_pool2d_backward.default,
        aten._adaptive_avg_pool2d_backward.default,
    }
)


_COPIES_NON_CONTIGUOUS = frozenset(
    {aten.native_layer_norm.default, aten.native_layer_norm_backward.default, aten._log_softmax.default}
)


def probe_limit_bytes() -> int:
    """The most bytes of operands a measurement may allocate: 1 GiB, or a quarter of free host memory if less."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name: the fixed limit
        return GIB
    return min(GIB, free // 4)


def _extent_bytes(t: torch.Tensor) -> int:
    """Bytes from the storage's start to the last element the tensor's strides reach (0 when empty)."""
    if t.numel() == 0:
        return 0
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return (int(t.storage_offset()) + last + 1) * t.element_size()


def _operand_bytes(*trees: Any) -> int:
    return sum(_extent_bytes(t) for t in tree_flatten(trees)[0] if isinstance(t, torch.Tensor))


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _convolution_bound(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor) -> int:
    """Twice input, output and weight, plus im2col columns where oneDNN may not take the dtype."""
    bound = 2 * (_nbytes(x) + _nbytes(y) + _nbytes(weight))
    if x.dtype != torch.float32:
        # PyTorch's own kernel (bf16 where the CPU lacks native support) unfolds the input into columns of up to
        # the kernel's size times the larger operand: 9x the input for a 3x3 convolution.
        bound += math.prod(weight.shape[2:]) * max(_nbytes(x), _nbytes(y))
    return bound


def scratch_bound(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """An upper bound of the scratch of a measured op's call, from its operands' sizes alone; allocates nothing.

    A convolution (forward, or backward with its ``grad_output`` as the output) is charged twice its input, output
    and weight, plus im2col columns of the kernel's size times the larger operand when the dtype is not float32;
    layer norm and log-softmax a contiguous copy of each operand that is not contiguous; every other op the bytes
    of its operands and outputs (a contiguous copy of each). Each bounds every signature
    measured with more than 4 MiB of operands (docs/benchmarks.md), contiguous and channels-last: a contiguous 1x1
    64->256 convolution's backward holds 1.0x input + grad_output, a 2x nearest upsample copies input and output.
    """
    if func is _CONVOLUTION:
        return _convolution_bound(args[0], out, args[1])
    if func is _CONVOLUTION_BACKWARD:
        return _convolution_bound(args[1], args[0], args[2])
    if func in _COPIES_NON_CONTIGUOUS:
        # Their scratch is a contiguous copy of an operand that is not contiguous; contiguous, they hold none (a
        # transformer's norms and log-softmax, exact before these ops were measured at all).
        flat, _ = tree_flatten((args, kwargs))
        return sum(_extent_bytes(t) for t in flat if isinstance(t, torch.Tensor) and not t.is_contiguous())
    return _operand_bytes(args, kwargs, out)


def peak_beyond(run: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``run()``: its result, and the peak of the allocations it makes beyond what it returns.

    The allocator's events come from the autograd profiler's legacy CPU mode, whose start costs half a
    millisecond; torch.profiler's first start in a process costs 1.5 s (Kineto's initialisation), more than the
    dry run of a small conv net. Both report the same allocations (every op of the tests' conv nets compared).
    """
    collector_was_enabled = gc.isenabled()
    gc.disable()  # a collection inside would report frees of older garbage (see QuietProfile)
    torch.autograd._enable_profiler_legacy(profiler_legacy.profile(profile_memory=True).config())
    try:
        out = run()
    finally:
        records = torch.autograd._disable_profiler_legacy()
        if collector_was_enabled:
            gc.enable()
    events = [e for thread in records for e in thread]
    # In time order across threads; sorted() is stable, so a thread's events keep their order within a microsecond.
    allocations = sorted(
        ((events[0].cpu_elapsed_us(e), e.cpu_memory_usage()) for e in events if e.kind() == "memory_alloc"),
        key=lambda event: event[0],
    )
    live = peak = 0
    for _, nbytes in allocations:
        live += nbytes
        peak = max(peak, live)
    kept = sum(t.untyped_storage().nbytes() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
    return out, max(0, peak - kept)


def call_signature(x: Any) -> Any:
    """What of a call's arguments decides a kernel's scratch: each tensor's shape, strides, offset and dtype."""
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), tuple(x.stride()), int(x.storage_offset()), x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple(call_signature(v) for v in x)
    return x


def real_zeros_like(x: Any) -> Any:
    """A real zero-filled tensor of the fake tensor's shape, strides, offset, dtype and device."""
    if not isinstance(x, torch.Tensor):
        return x
    base = torch.zeros(_extent_bytes(x) // x.element_size(), dtype=x.dtype, device=x.device)
    return base.as_strided(tuple(x.shape), tuple(x.stride()), int(x.storage_offset()))


_DEFAULT_DIR: Any = object()  # the cache directory of the environment at first use (default_cache_dir)


class KernelScratch:
    """The scratch of :data:`MEASURED_OPS` calls, measured once per signature and cached in the process and on disk.

    Args:
        limit_bytes: Operands above this many bytes are not allocated; ``None``: :func:`probe_limit_bytes`.
        cache_dir: The directory of the disk cache; ``None``: none. By default :func:`default_cache_dir` when the
            first signature is looked up (``$LIGHTNING_SAC_CACHE_DIR``, else the user's cache directory).

    Attributes:
        measured: How many signatures were run on the kernel.
        loaded: How many signatures were answered by the disk cache.
    """

    def __init__(self, *, limit_bytes: int | None = None, cache_dir: str | os.PathLike[str] | None = _DEFAULT_DIR):
        self.limit_bytes = limit_bytes
        self.measured = 0
        self.loaded = 0
        self._cache: dict[Any, int] = {}
        self._cache_dir = cache_dir
        self._store: ScratchStore | None = None
        self._stored: dict[str, int] | None = None  # the disk cache's entries, read on the first miss
        self._unsaved: dict[str, int] = {}

    def _from_disk(self, key: Any) -> int | None:
        if self._stored is None:
            directory = default_cache_dir() if self._cache_dir is _DEFAULT_DIR else self._cache_dir
            self._store = None if directory is None else ScratchStore(Path(directory))
            self._stored = {} if self._store is None else self._store.load()
        return self._stored.get(repr(key))

    def save(self) -> None:
        """Write the signatures measured since the last save to the disk cache (a dry run's end calls it)."""
        if self._store is not None and self._unsaved:
            self._store.save(self._unsaved)
        self._unsaved = {}

    def __call__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int | None:
        """Bytes ``func`` allocates and frees within this call on this CPU, or ``None`` if it is not measured."""
        if func not in MEASURED_OPS:
            return None
        # oneDNN's per-thread buffers and its choice of kernel follow the thread count (a channels-last 1x1 expansion's
        # backward holds nothing on one thread, 136 KiB on two, 1 MiB on sixteen), and PyTorch's choice of backend
        # whether oneDNN is enabled: both are part of the signature, measured as the process runs now; so are the
        # switches that select oneDNN's kernels (deterministic ones, a reduced fp32 precision).
        signature = (call_signature(args), call_signature(tuple(sorted(kwargs.items()))))
        settings = (
            torch.get_num_threads(),
            torch.backends.mkldnn.enabled,
            torch.backends.mkldnn.deterministic,
            torch.are_deterministic_algorithms_enabled(),
            # The reduced-precision switch of oneDNN's convolutions (torch 2.9 on; absent before).
            getattr(getattr(torch.backends.mkldnn, "conv", None), "fp32_precision", None),
        )
        key = (str(func), signature, settings)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        stored = self._from_disk(key)
        if stored is not None:
            self.loaded += 1
            self._cache[key] = stored
            return stored
        limit = probe_limit_bytes() if self.limit_bytes is None else self.limit_bytes
        # A second profiler cannot start while one records (a measured step of a fit): bound it, uncached.
        if _operand_bytes(args, kwargs, out) > limit or torch.autograd._profiler_enabled():
            return scratch_bound(func, args, kwargs, out)
        try:
            scratch = self._measure(func, args, kwargs)
        except RuntimeError:
            # Zeros are valid operands of every measured op; should a kernel still refuse them, the bound stands
            # (for the process only: another torch may take them).
            self._cache[key] = scratch_bound(func, args, kwargs, out)
            return self._cache[key]
        self.measured += 1
        self._cache[key] = self._unsaved[repr(key)] = scratch
        return scratch

    @staticmethod
    def _measure(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        # Outside every mode (the fake mode, the recorder's, the real values'), so the call is real and unseen;
        # autocast off, so the kernel sees the dtypes the dry run recorded.
        with (
            _disable_current_modes(),
            torch._C.DisableTorchFunction(),
            torch.no_grad(),
            torch.autocast("cpu", enabled=False),
        ):
            real_args, real_kwargs = tree_map(real_zeros_like, (args, kwargs))
            out, scratch = peak_beyond(lambda: func(*real_args, **real_kwargs))
            del out
        return scratch


kernel_scratch = KernelScratch()
"""The process's cache: every dry run on the CPU target measures through it, and saves to the disk cache after."""
