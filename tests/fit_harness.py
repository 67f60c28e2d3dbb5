"""Fits measured from the outside: every training batch's peak from torch.profiler's allocator events.

The ground truth of issue "AutoSAC in real training loops": one profiler runs over the whole ``fit`` (from the
callback's ``setup``), so every block allocated in the fit has both its allocation and its free in the record
(torch.profiler reports no free for a block allocated before it started). A batch's peak is the bytes alive
when ``setup`` ran (parameters and buffers) plus the highest net allocation inside the batch's window, between
``on_train_batch_start`` and ``on_train_batch_end``. This shares nothing with AutoSAC's own measurement, so
AutoSAC must run with ``measure=False`` beside it (two profilers cannot run at once).
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch.profiler import ProfilerActivity, profile, record_function

from lightning_sac.measure import unique_bytes

__all__ = ["BatchPeaks", "FitRun", "batch_peaks"]


class BatchPeaks(pl.Callback):
    """Measures the peak of every training batch of a fit (see the module docstring).

    Args:
        out_dir: When given, rank ``r`` writes ``peaks_rank{r}.json`` there (for ``ddp_spawn`` fits).

    Attributes:
        peaks: Bytes per training batch, in order, after ``fit``.
    """

    def __init__(self, out_dir: str | os.PathLike[str] | None = None) -> None:
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.peaks: list[int] = []
        self.starts: list[int] = []  # bytes alive when each batch began
        self._prof: Any = None
        self._range: Any = None
        self._baseline = 0
        self._n = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # The CPU allocator reports to a profiler the frees of blocks an earlier profiler session saw allocated:
        # collect an earlier fit's garbage now, or its frees would count against this fit.
        gc.collect()
        self._baseline = unique_bytes([*pl_module.parameters(), *pl_module.buffers()])
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._range = record_function(f"fit_harness_batch_{self._n}")
        self._range.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._range.__exit__(None, None, None)
        self._n += 1

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._prof.__exit__(None, None, None)
        events = list(self._prof.profiler.kineto_results.events())
        memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        windows = {}
        for e in events:
            if e.name().startswith("fit_harness_batch_"):
                windows[int(e.name().rsplit("_", 1)[1])] = (e.start_ns(), e.start_ns() + e.duration_ns())
        self.peaks, self.starts = [], []
        for i in sorted(windows):
            lo, hi = windows[i]
            alive = self._baseline + sum(d for t, d in memory if t < lo)
            self.starts.append(alive)
            peak = alive
            for t, d in memory:
                if lo <= t <= hi:
                    alive += d
                    peak = max(peak, alive)
            self.peaks.append(peak)
        if self.out_dir is not None:
            (self.out_dir / f"peaks_rank{trainer.global_rank}.json").write_text(json.dumps(self.peaks))


@dataclass
class FitRun:
    """One measured fit.

    Attributes:
        peaks: Bytes per training batch (rank 0's, or every rank's in ``rank_peaks``).
        losses: The module's recorded losses.
        rank_peaks: Per rank, for multi-process fits.
    """

    peaks: list[int]
    losses: list[float]
    rank_peaks: list[list[int]] = field(default_factory=list)


def batch_peaks(out_dir: str | os.PathLike[str], world_size: int) -> list[list[int]]:
    """Every rank's batch peaks written by :class:`BatchPeaks` ``(out_dir=...)``."""
    return [json.loads((Path(out_dir) / f"peaks_rank{r}.json").read_text()) for r in range(world_size)]


def gib(n_bytes: int) -> float:
    """Bytes in GiB."""
    return n_bytes / 2**30


