"""Ground truth: the memory of a real training step on this machine, from torch.profiler's allocator events.

This is independent of the dry run's tracker: it reads what the allocator reported, event by event, while
the same :func:`~lightning_sac.dryrun.step.training_step` ran on real tensors.

Kineto (torch 2.13's CPU wheel) writes ``USDT: ... profiler_start`` / ``profiler_stop`` and ``STAGE: ...`` lines
straight to file descriptor 2 from C++ each time a profiler starts or stops, whatever ``KINETO_LOG_LEVEL`` says.
``sys.stderr`` cannot catch them, so :func:`filtered_native_stderr` points descriptor 2 at a temporary file
around the profiler's own start and stop only (never around the user's code) and writes back every line that is
not that chatter: a real warning printed there still reaches the user (:class:`QuietProfile`).

c10's CPU allocator logs ``Memory block of unknown size was allocated before the profiling started`` at the first
free, under a memory profiler, of a block allocated before it started, then at every 1000th (a counter kept for
the process). Such frees are the rule in a measured training step (the previous step's activations, gradients
and batch), and their absence from the record is what the measurement expects (it starts from the live tensors'
bytes). :class:`QuietProfile` spends the first of those notices inside its filtered start, on a block of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from lightning_sac.dryrun.step import (
    LossFn,
    OptimizerFactory,
    model_inputs,
    model_loss,
    tensors_of,
    training_step,
)

__all__ = [
    "TIMELINE_CATEGORIES",
    "MeasuredStep",
    "QuietProfile",
    "filtered_native_output",
    "filtered_native_stderr",
    "is_profiler_chatter",
    "MemoryTimeline",
    "event_name",
    "measure_training_step",
    "memory_events",
    "memory_timeline",
    "peak_from_events",
    "unique_bytes",
    "window_memory_events",
]


# "USDT:2026-11-23 12:20:27 17888:17888 SyncActivityProfilerHandler.cpp:52] profiler_start"
_CHATTER = re.compile(r"^(USDT|STAGE):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+\.cpp:\d+\] ")


# "[W1126 15:34:33.873150545 CPUAllocator.cpp:245] Memory block of unknown size was allocated before the ..."
_UNKNOWN_BLOCK = re.compile(r"^\[W\d{4} [\d:.]+ CPUAllocator\.cpp:\d+\] Memory block of unknown size")


def is_profiler_chatter(line: str) -> bool:
    """Whether ``line`` is one of Kineto's status lines (``USDT: ...`` / ``STAGE: ...``)."""
    return _CHATTER.match(line) is not None


def _is_start_noise(line: str) -> bool:
    return is_profiler_chatter(line) or _UNKNOWN_BLOCK.match(line) is not None


def _flush_c_stdio() -> None:
    # No C library to load (a platform without dlopen(NULL)): nothing is buffered there either.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)


@contextlib.contextmanager
def filtered_native_output(fd: int, noise: Callable[[str], bool], *, flush_c_stdio: bool = False) -> Iterator[None]:
    """Drop the lines ``noise`` picks that native code writes to descriptor ``fd`` (1 or 2) inside the block.

    Every other line is written back to ``sys.stdout`` (``fd`` 1) or ``sys.stderr`` (2) after the block. Where the
    descriptor cannot be redirected (no such descriptor), the block runs unchanged. ``flush_c_stdio`` flushes the C
    library's buffers before the descriptor is restored: needed for code that prints with ``printf`` (buffered when
    descriptor 1 is a pipe), not for ``stderr`` (unbuffered), so the profiler's own path leaves C stdio alone.
    """
    stream = sys.stdout if fd == 1 else sys.stderr
    stream.flush()
    try:
        saved = os.dup(fd)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), fd)
        try:
            yield
        finally:
            stream.flush()
            if flush_c_stdio:
                _flush_c_stdio()  # native code's printf buffers a pipe's lines: out into the sink before it closes
            os.dup2(saved, fd)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode(errors="replace")
    kept = [line for line in text.splitlines(keepends=True) if not noise(line)]
    if kept:
        stream.write("".join(kept))
        stream.flush()


def filtered_native_stderr() -> contextlib.AbstractContextManager[None]:
    """Drop Kineto's status lines written to descriptor 2 inside the block; pass every other line through."""
    return filtered_native_output(2, is_profiler_chatter)


class QuietProfile(profile):
    """``torch.profiler.profile`` whose start and stop print no Kineto status lines (see the module docstring).

    Takes the same arguments; only :meth:`start` and :meth:`stop` differ, so the profiled code's own output is
    untouched. While it profiles memory, Python's cyclic collector is paused: the CPU allocator remembers the size
    of every block allocated under any earlier profiler and reports its free to the current one, so garbage of
    earlier code reclaimed mid-window would lower the measured peak by its size (1024 bytes in one test suite run).
    """

    _collector_was_enabled: bool = False

    def start(self) -> None:
        """Start profiling, filtering Kineto's status lines and spending c10's unknown-block notice."""
        if self.profile_memory:
            self._collector_was_enabled = gc.isenabled()
            gc.disable()
        primer = torch.empty(1) if self.profile_memory else None  # a CPU block from before the start
        with filtered_native_output(2, _is_start_noise):
            super().start()
            del primer  # its free is the process's first unknown-size one while profiling: the notice, filtered

    def stop(self) -> None:
        """Stop profiling, filtering Kineto's status lines, and resume the cyclic collector if it ran before."""
        try:
            with filtered_native_stderr():
                super().stop()
        finally:
            if self._collector_was_enabled:
                gc.enable()
                self._collector_was_enabled = False


@dataclass(kw_only=True)
class MeasuredStep:
    """Memory of one real training step.

    Attributes:
        peak_bytes: ``baseline_bytes`` plus the highest net allocation during the step.
        baseline_bytes: Bytes alive when the step began: parameters, buffers, gradients, optimizer state and
            inputs, each storage once.
        timeline: ``(ns since the first event, bytes alive)`` after each allocator event.
    """

    peak_bytes: int
    baseline_bytes: int
    timeline: list[tuple[int, int]] = field(default_factory=list)


def peak_from_events(events: list[tuple[int, int]], baseline_bytes: int) -> MeasuredStep:
    """Fold allocator events ``(start ns, +/- bytes)`` into a timeline and its peak."""
    events = sorted(events)
    alive, peak = baseline_bytes, baseline_bytes
    timeline = []
    t0 = events[0][0] if events else 0
    for ns, delta in events:
        alive += delta
        peak = max(peak, alive)
        timeline.append((ns - t0, alive))
    return MeasuredStep(peak_bytes=peak, baseline_bytes=baseline_bytes, timeline=timeline)


def unique_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors``; a ``DTensor``'s are its local tensor's (what the rank holds)."""
    from torch.distributed.tensor import DTensor

    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum({id(t.untyped_storage()): t.untyped_storage().nbytes() for t in local}.values())


def measure_training_step(
    model: nn.Module,
    example_inputs: tuple[Any, ...] | Mapping[str, Any],
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: LossFn | None = None,
    optimizer_factory: OptimizerFactory | None = None,
) -> MeasuredStep:
    """Train ``model`` for real on this machine's CPU and measure the memory of one step.

    With an optimizer, a first step creates its state and the second is measured, as
    :func:`~lightning_sac.profile_model` does. The model's parameters are updated: pass a copy to keep yours.

    Args:
        model: A model with real weights on the CPU.
        example_inputs: Positional inputs of ``model`` (a tuple), or its keyword inputs (a dict).
        example_kwargs: Keyword inputs besides positional ``example_inputs``.
        loss_fn: As for :func:`~lightning_sac.profile_model`.
        optimizer_factory: As for :func:`~lightning_sac.profile_model`.
    """
    inputs = model_inputs(example_inputs, example_kwargs)
    compute_loss = model_loss(loss_fn)
    params = list(model.parameters())
    optimizer = optimizer_factory(params) if optimizer_factory is not None else None
    if optimizer is not None:
        training_step(model, inputs, compute_loss, optimizer)
    states = [] if optimizer is None else list(optimizer.state.values())
    state = [v for s in states for v in s.values() if isinstance(v, torch.Tensor)]
    grads = [p.grad for p in params if p.grad is not None]
    # Plain tensor attributes of modules (VideoMAE's sinusoid tables) live through the step as buffers do.
    attributes = [v for m in model.modules() for v in vars(m).values() if type(v) is torch.Tensor]
    baseline = unique_bytes(params + list(model.buffers()) + grads + state + tensors_of(inputs) + attributes)
    # Garbage of earlier code that the cyclic collector reclaimed mid-step would lower the measured peak by its
    # size (see QuietProfile): collect it first.
    gc.collect()
    with QuietProfile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        training_step(model, inputs, compute_loss, optimizer)
    return peak_from_events(window_memory_events(prof, "cpu"), baseline)


def event_name(event: Any) -> str | None:
    """The name of a profiler event, or ``None`` when torch cannot decode it.

    With ``with_stack=True``, the Python-function events of code that ``torch.compile`` compiled while the
    profiler ran can carry names that are not UTF-8 (``UnicodeDecodeError`` from ``KinetoEvent.name``): dynamo
    frees the code objects those names were read from. Such an event is a Python call, never an allocation.
    """
    try:
        name: str = event.name()
    except UnicodeDecodeError:
        return None
    return name


def window_memory_events(prof: profile, device: str = "cpu") -> list[tuple[int, int]]:
    """:func:`memory_events` less the frees of blocks allocated before the profile began.

    The allocator reports such a free whenever it knows the block's size, which it does for any block allocated
    while an earlier profiler ran: a measurement that counted them would be lower by whatever older memory the
    process happened to release in its window. Blocks are matched by address, each allocation in the window
    claiming its address until its free.
    """
    from torch._C._profiler import _EventType

    assert prof.profiler is not None and prof.profiler.kineto_results is not None, "the profile is not finished"
    kind = device.split(":")[0]
    allocations = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.typed[0] == _EventType.Allocation and str(event.typed[1].device).split(":")[0] == kind:
            allocations.append((event.start_time_ns, event.typed[1].ptr, event.typed[1].alloc_size))
    born: set[int] = set()
    kept = []
    for ns, ptr, nbytes in sorted(allocations, key=lambda a: a[0]):  # stable: same-time events keep their order
        if nbytes > 0:
            born.add(ptr)
        elif ptr in born:
            born.discard(ptr)
        else:
            continue
        kept.append((ns, nbytes))
    return kept


def memory_events(prof: profile, device: str = "cpu") -> list[tuple[int, int]]:
    """The allocator events ``(start ns, +/- bytes)`` of ``device`` in a finished profile.

    Python-function events are skipped before their names are read (see :func:`event_name`).
    """
    assert prof.profiler is not None and prof.profiler.kineto_results is not None, "the profile is not finished"
    kind = device.split(":")[0]
    return [
        (e.start_ns(), e.nbytes())  # type: ignore[attr-defined]
        for e in prof.profiler.kineto_results.events()
        if not e.is_python_function()
        and event_name(e) == "[memory]"
        and str(e.device_type()).split(".")[-1].lower() == kind
    ]


#: Categories of PyTorch's memory profiler, in its stacking order, with ``unknown`` for uncategorized bytes.
TIMELINE_CATEGORIES = (
    "parameter",
    "optimizer_state",
    "input",
    "temporary",
    "activation",
    "gradient",
    "autograd_detail",
    "unknown",
)


@dataclass(kw_only=True)
class MemoryTimeline:
    """Live bytes of one device over a profiled window, by PyTorch's memory profiler categories.

    Attributes:
        times_us: Time of each sample, microseconds from the first.
        by_category: Bytes per category (:data:`TIMELINE_CATEGORIES`) at each sample.
        peak_bytes: ``baseline_bytes`` plus the highest net allocation of the raw allocator events (as
            :func:`peak_from_events` folds them).
        baseline_bytes: Bytes alive when profiling began, as the caller counted them.
        events: The raw allocator events ``(start ns, +/- bytes)`` of the device.
    """

    times_us: list[float]
    by_category: dict[str, list[int]]
    peak_bytes: int
    baseline_bytes: int = 0
    events: list[tuple[int, int]] = field(default_factory=list)


def memory_timeline(prof: profile, device: str = "cpu", baseline_bytes: int = 0) -> MemoryTimeline:
    """Categorize the memory of a finished ``torch.profiler.profile`` run.

    The profile must have been taken with ``profile_memory=True, record_shapes=True, with_stack=True``.
    Categories come from PyTorch's memory profiler (``torch.profiler._memory_profiler``: the only public
    implementation of its categorization, used by ``export_memory_timeline`` too).
    """
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    times, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(device)
    t0 = times[0] if times else 0
    by_category = {c: [int(row[i + 1]) for row in sizes] for i, c in enumerate(TIMELINE_CATEGORIES)}
    events = memory_events(prof, device)
    return MemoryTimeline(
        times_us=[float(t - t0) for t in times],
        by_category=by_category,
        peak_bytes=peak_from_events(events, baseline_bytes).peak_bytes,
        baseline_bytes=baseline_bytes,
        events=events,
    )
