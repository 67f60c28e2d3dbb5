"""AutoSAC's measurement of a planned step inside ``fit``: torch.profiler's allocator events, beside the plan.

The measured step is the fit's second optimizer step, a whole accumulation cycle (``accumulate_grad_batches``
micro-batches), measured exactly as training runs it: nothing of the training state is changed to make it
measurable. torch.profiler reports no free of a block allocated before it started, so the profiler starts one
cycle earlier, at the first micro-batch: the blocks the measured cycle frees (the previous cycle's gradients,
the batch prefetched during it) were then allocated under the profiler, and their frees are in the record.
The measured peak is the bytes alive when the measured cycle begins (parameters, buffers, gradients, optimizer
state and the batch, each storage once) plus the highest net allocation inside the cycle's window.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.profiler import ProfilerActivity, record_function

from lightning_sac.dryrun import (
    TIMELINE_CATEGORIES,
    MemoryTimeline,
    QuietProfile,
    event_name,
    memory_events,
    memory_timeline,
    peak_from_events,
    tensors_of,
    unique_bytes,
)
from lightning_sac.plan import Plan, device_peak, plan_unit, reserve_bytes, reserve_note

__all__ = [
    "StepMeasurement",
    "compare_measured",
    "cuda_max_allocated",
    "logger_writer",
    "measured_timeline",
    "measured_verdict",
    "own_writer",
    "started_step_profiler",
    "step_state_tensors",
    "window_peak",
    "window_timeline",
]

_GIB = 2**30
_WINDOW = "lightning_sac_measured_cycle"


def window_peak(events: list[tuple[int, int]], window: tuple[int, int], alive_at_start: int) -> int:
    """``alive_at_start`` plus the highest net allocation of the allocator ``events`` inside ``window`` (ns)."""
    lo, hi = window
    alive = peak = alive_at_start
    for ns, delta in sorted(events):
        if lo <= ns <= hi:
            alive += delta
            peak = max(peak, alive)
    return peak


def step_state_tensors(model: nn.Module, optimizers: Sequence[Any]) -> list[torch.Tensor]:
    """Parameters, buffers, gradients and optimizer state: what a step begins with besides its batch, on this rank.

    Under FSDP the rank holds shards: a ``DTensor``'s local tensor (FSDP2, which ``unique_bytes`` counts), FSDP1's
    flat shard (whose views the wrapper's parameters are).
    """
    state = [v for o in optimizers for s in o.state.values() for v in s.values()]
    params = list(model.parameters())
    tensors = [*params, *model.buffers(), *tensors_of(state), *[p.grad for p in params if p.grad is not None]]
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def _alive_bytes(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> int:
    """Bytes a step begins with on this rank: the strategy's model's :func:`step_state_tensors` and the batch."""
    model = trainer.strategy.model or pl_module
    return unique_bytes([*step_state_tensors(model, trainer.optimizers), *tensors_of(batch)])


def started_step_profiler() -> QuietProfile:
    """A running profiler for a measured step: allocator events, and what torch's memory profiler categorizes by."""
    profiler = QuietProfile(  # no Kineto status lines on the console
        activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])],
        profile_memory=True,
        record_shapes=True,
        with_stack=True,
    )
    profiler.__enter__()
    return profiler


class StepMeasurement:
    """Profiles the fit's second accumulation cycle with torch.profiler (see the module docstring).

    Call :meth:`batch_start` and :meth:`batch_end` for every training batch from the first one on; the second
    returns the measured cycle's timeline once it ends, ``None`` before.

    Attributes:
        failed: Reading the profile failed; the measurement is not tried again.
    """

    def __init__(self) -> None:
        self._profiler: Any = None
        self._window: Any = None
        self._baseline = 0
        self._seen = 0
        self.failed = False

    @property
    def running(self) -> bool:
        """Whether the profiler runs."""
        return self._profiler is not None

    def batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        """Start the profiler before the first micro-batch, and the measured window before the cycle after it."""
        k = trainer.accumulate_grad_batches
        if self._seen == 0:
            self._profiler = started_step_profiler()
        elif self._seen == k and self._profiler is not None:
            self._baseline = _alive_bytes(trainer, pl_module, batch)
            self._window = record_function(_WINDOW)
            self._window.__enter__()
        self._seen += 1

    def batch_end(self, trainer: pl.Trainer) -> MemoryTimeline | None:
        """The measured cycle's memory once its last micro-batch ended, else ``None``.

        Raises:
            Exception: Whatever reading the profile raised; the profiler is stopped first.
        """
        if self._window is None or self._seen < 2 * trainer.accumulate_grad_batches:
            return None
        self._window.__exit__(None, None, None)
        self._window = None
        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        return window_timeline(prof, str(trainer.strategy.root_device), self._baseline, _WINDOW)

    def abandon(self, failed: bool = False) -> None:
        """Stop profiling without a result (``fit`` ended, or the measurement failed: then it is not retried)."""
        self.failed = self.failed or failed
        if self._window is not None:
            self._window.__exit__(None, None, None)
            self._window = None
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self._profiler = None


def window_timeline(prof: Any, device: str, baseline: int, window_name: str) -> MemoryTimeline:
    """The memory of a finished profile, its peak that of the ``record_function(window_name)`` range in it.

    Raises:
        RuntimeError: The profile holds no such range.
    """
    timeline = measured_timeline(prof, device, baseline)
    kineto = prof.profiler.kineto_results.events()
    # Python events' names can be undecodable after a compile in the window (measure.event_name).
    marks = [e for e in kineto if not e.is_python_function() and event_name(e) == window_name]
    if not marks:
        raise RuntimeError(f"the profile holds no {window_name!r} range")
    window = (marks[0].start_ns(), marks[0].start_ns() + marks[0].duration_ns())
    timeline.peak_bytes = window_peak(timeline.events, window, baseline)
    return timeline


def measured_timeline(prof: Any, device: str, baseline: int) -> MemoryTimeline:
    """The window's memory by category; uncategorized where torch's memory profiler cannot categorize it.

    ``torch.profiler._memory_profiler`` asserts on some steps' autograd graphs ("duplicate outputs" of an attention
    backward node, seen under FSDP1 on CPU); its categories are lost then, not the allocator's events, which give the
    peak: the timeline puts every byte under ``unknown`` and says so once.
    """
    try:
        return memory_timeline(prof, device, baseline)
    except AssertionError as err:
        events = memory_events(prof, device)
        rank_zero_warn(
            f"torch's memory profiler could not categorize the measured step's memory (AssertionError: "
            f"{str(err).splitlines()[0][:120]}); the peak is measured from the allocator's events, and the memory "
            "timeline shows it uncategorized."
        )
    folded = peak_from_events(events, baseline)
    running = [alive for _, alive in folded.timeline]
    by_category = {c: running if c == "unknown" else [0] * len(running) for c in TIMELINE_CATEGORIES}
    return MemoryTimeline(
        times_us=[ns / 1000 for ns, _ in folded.timeline],
        by_category=by_category,
        peak_bytes=folded.peak_bytes,
        baseline_bytes=baseline,
        events=events,
    )


def measured_verdict(plan: Plan, measured_bytes: int, device_type: str, target_is_cuda: bool) -> tuple[bool, str]:
    """Whether a measured peak on the planned device went over the budget, and the line that says so."""
    if ("cuda" if target_is_cuda else "cpu") != device_type:
        return False, (
            f"AutoSAC planned for {plan.device} but trains on {device_type}: the measured peak "
            f"({measured_bytes / _GIB:.3f} GiB) is logged, not compared with the budget."
        )
    # On a GPU the budget also holds the CUDA context, NCCL and the allocator's slack (Plan.reserve), which no
    # allocation event shows: the device total is the measured tensors plus that reserve, as the plan states its peak.
    unit = plan_unit(plan, [measured_bytes])
    note = reserve_note(plan, unit)
    total = measured_bytes + reserve_bytes(plan)
    figures = f"peak {device_peak(plan, measured_bytes, unit)}" + (f" ({note})" if note else "")
    figures += f", predicted {unit(plan.predicted_peak_bytes + reserve_bytes(plan))}"
    if total > plan.budget_bytes:
        return True, (
            f"AutoSAC measured the first planned step: {figures}: OVER BUDGET by {unit(total - plan.budget_bytes)}. "
            "The plan did not take effect as planned or the estimate was wrong; lower the budget or check the "
            "warnings above."
        )
    return False, (
        f"AutoSAC measured the first planned step: {figures}: within budget, {unit(plan.budget_bytes - total)} to "
        "spare."
    )


def compare_measured(plan: Plan, measured_bytes: int, device_type: str, target_is_cuda: bool) -> None:
    """Say on rank 0 whether the measured peak on the planned device stayed within the budget, in one line.

    A warning when it did not: the plan did not hold.
    """
    over, message = measured_verdict(plan, measured_bytes, device_type, target_is_cuda)
    (rank_zero_warn if over else rank_zero_info)(message)


def cuda_max_allocated(trainer: pl.Trainer) -> int | None:
    """``torch.cuda.max_memory_allocated()`` of the trainer's device, ``None`` off CUDA."""
    device = trainer.strategy.root_device
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def logger_writer(trainer: pl.Trainer) -> Any:
    """The ``SummaryWriter`` of the trainer's first TensorBoardLogger, ``None`` without one."""
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None


def own_writer(trainer: pl.Trainer) -> Any:
    """AutoSAC's own ``SummaryWriter``: ``lightning_sac_logs`` under the logger's folder or the root folder."""
    from torch.utils.tensorboard import SummaryWriter

    # Not trainer.log_dir: it broadcasts, and only global rank 0 gets here.
    logger_dir = next((lg.log_dir for lg in trainer.loggers if getattr(lg, "log_dir", None)), None)
    return SummaryWriter(os.path.join(logger_dir or trainer.default_root_dir, "lightning_sac_logs"))
