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
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, record_function

from lightning_sac.dryrun.measured import unique_bytes
from lightning_sac.dryrun.step import tensors_of

__all__ = ["BatchPeaks", "FitRun", "batch_peaks"]


class BatchPeaks(pl.Callback):
    """Measures the peak of every training batch of a fit (see the module docstring).

    Args:
        out_dir: When given, rank ``r`` writes ``peaks_rank{r}.json`` there (for ``ddp_spawn`` fits).
        at_train_start: Start in ``on_train_start`` instead of ``setup``: for sharded fits, whose parameters are
            replaced by their shards in ``configure_model`` after ``setup`` (the unsharded originals were
            allocated before any profiler could see them). The bytes alive then are the rank's own: its
            parameter shards (a DTensor's local tensor, FSDP1's flat shard) and buffers. Each batch then starts
            from the bytes of the tensors alive at its start (parameter shards, their gradients, the optimizer's
            state, buffers) rather than from the sum of every allocation and free recorded before it: with gloo,
            a collective's buffer can be freed on gloo's worker thread, which the profiler does not record, and
            the running sum would carry that block into every later batch.

    Under DDP, started in ``setup``, every batch starts from the bytes of what is alive for sure: the tensors alive
    at its start, the training set's other batches (a list dataset) and DDP's gradient buckets (the reducer's
    own sizes: no tensor reaches them). Never from the running sum: gloo runs collectives on its worker thread,
    and a collective's buffer is freed there whenever that thread drops the last reference, which the profiler
    does not record; the running sum then kept a parameter-sized block alive in about one fit in four (1.03x of
    the budget in the lengths test). The buckets' bytes assume ``gradient_as_bucket_view=False`` (Lightning's
    default): gradients are their own tensors.

    Attributes:
        peaks: Bytes per training batch, in order, after ``fit``.
    """

    def __init__(self, out_dir: str | os.PathLike[str] | None = None, at_train_start: bool = False) -> None:
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.at_train_start = at_train_start
        self.peaks: list[int] = []
        self.starts: list[int] = []  # bytes alive when each batch began
        self._prof: Any = None
        self._range: Any = None
        self._baseline = 0
        self._n = 0
        self._alive: list[int] = []
        self._buckets: int | None = None  # DDP's gradient buckets, bytes; None without DDP
        self._sure: list[int] = []  # under DDP: what is alive for sure at each batch's start (see the docstring)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and not self.at_train_start:
            self._start([*pl_module.parameters(), *pl_module.buffers()])

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.at_train_start:
            self._start(_live_tensors(trainer, pl_module))
        else:  # (sharded fits: DDP's buckets were made before the profiler, which sees their rebuild as new)
            self._buckets = _ddp_bucket_bytes(trainer)

    def _start(self, alive: list[Any]) -> None:
        # The CPU allocator reports to a profiler the frees of blocks an earlier profiler session saw allocated:
        # collect an earlier fit's garbage now, or its frees would count against this fit.
        gc.collect()
        self._baseline = unique_bytes(alive)
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        # The bytes of the tensors alive at the batch's start (see on_fit_end).
        live = [*_live_tensors(trainer, pl_module), *tensors_of(batch)]
        self._alive.append(unique_bytes(live))
        if self._buckets is not None:
            self._sure.append(unique_bytes([*live, *_dataset_tensors(trainer)]) + self._buckets)
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
        # What the running sum holds beyond the live tensors at a batch's start is memory no tensor reaches (DDP's
        # buckets), which stays, or a free the profiler did not record (a gloo worker thread's), which would be
        # carried into every later batch: the smallest such difference so far is kept.
        untracked: int | None = None
        for i in sorted(windows):
            lo, hi = windows[i]
            if self._buckets is not None:
                alive = self._sure[i]
            elif self.at_train_start:
                alive = self._alive[i]
            else:
                running = self._baseline + sum(d for t, d in memory if t < lo)
                untracked = running - self._alive[i] if untracked is None else min(untracked, running - self._alive[i])
                alive = self._alive[i] + untracked
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


def _live_tensors(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[torch.Tensor]:
    """The rank's own training state: parameters, their gradients, the optimizer's state and the buffers of the
    model as the strategy runs it (FSDP1's wrapper, whose parameters view its shard); ``unique_bytes`` counts a
    DTensor as its local shard.
    """
    model = trainer.strategy.model or pl_module
    params = list(model.parameters())
    state = [v for opt in trainer.optimizers for per_param in opt.state.values() for v in per_param.values()]
    return [*params, *[p.grad for p in params if p.grad is not None], *tensors_of(state), *model.buffers()]


def _ddp_bucket_bytes(trainer: pl.Trainer) -> int | None:
    """Bytes of DDP's gradient buckets as its reducer sizes them, or ``None`` when the model is not under DDP."""
    model = trainer.strategy.model
    if not isinstance(model, DistributedDataParallel):
        return None
    # Zero tensors of the buckets' sizes, made and dropped here: between batches, on this thread.
    buckets = model.reducer._get_zeros_like_grad_buckets()
    return sum(b.buffer().numel() * b.buffer().element_size() for b in buckets)


def _dataset_tensors(trainer: pl.Trainer) -> list[torch.Tensor]:
    """The tensors of a training set held in a list (the tests' per-rank datasets of ready batches)."""
    dataset = getattr(trainer.train_dataloader, "dataset", None)
    return tensors_of(dataset) if isinstance(dataset, (list, tuple)) else []


def batch_peaks(out_dir: str | os.PathLike[str], world_size: int) -> list[list[int]]:
    """Every rank's batch peaks written by :class:`BatchPeaks` ``(out_dir=...)``."""
    return [json.loads((Path(out_dir) / f"peaks_rank{r}.json").read_text()) for r in range(world_size)]


def gib(n_bytes: int) -> float:
    """Bytes in GiB."""
    return n_bytes / 2**30
