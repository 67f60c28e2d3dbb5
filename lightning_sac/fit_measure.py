"""AutoSAC's measurement of a planned step inside ``fit``: torch.profiler's allocator events, beside the plan."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.profiler import ProfilerActivity, profile

from lightning_sac.measure import MemoryTimeline, memory_timeline, unique_bytes
from lightning_sac.plan import Plan
from lightning_sac.profiling.step import tensors_of

__all__ = ["StepMeasurement", "compare_measured"]

_GIB = 2**30


class StepMeasurement:
    """Profiles one training step of ``fit`` with torch.profiler: :meth:`start` before it, :meth:`stop` after."""

    def __init__(self) -> None:
        self._profiler: Any = None
        self._baseline = 0

    @property
    def running(self) -> bool:
        """Whether a step is being measured."""
        return self._profiler is not None

    def start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        """Start profiling; what is alive now is the step's baseline."""
        if trainer.accumulate_grad_batches == 1:
            # torch.profiler reports no free for a block allocated before it started, so the previous step's
            # gradients, which Lightning sets to None just before backward, would count twice. Setting them
            # to None now changes nothing in training: backward writes fresh ones either way.
            for optimizer in trainer.optimizers:
                optimizer.zero_grad(set_to_none=True)
        # Alive when the step begins: parameters, buffers, gradients, optimizer state and the batch.
        state = [v for o in trainer.optimizers for s in o.state.values() for v in s.values()]
        tensors = [*pl_module.parameters(), *pl_module.buffers(), *tensors_of((batch, state))]
        tensors += [p.grad for p in pl_module.parameters() if p.grad is not None]
        self._baseline = unique_bytes([t for t in tensors if isinstance(t, torch.Tensor)])
        self._profiler = profile(
            activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])],
            profile_memory=True,
            record_shapes=True,
            with_stack=True,
        )
        self._profiler.__enter__()

    def stop(self, device: torch.device) -> MemoryTimeline:
        """Stop profiling and return the measured step's memory timeline."""
        self._profiler.__exit__(None, None, None)
        prof, self._profiler = self._profiler, None
        return memory_timeline(prof, str(device), self._baseline)

    def abandon(self) -> None:
        """Stop profiling without a result (``fit`` ended inside the measured step)."""
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self._profiler = None


def compare_measured(plan: Plan, measured_bytes: int, device_type: str, target_is_cuda: bool) -> None:
    """Warn when a measured peak on the planned device exceeds the budget: the plan did not hold."""
    if ("cuda" if target_is_cuda else "cpu") != device_type:
        rank_zero_info(
            f"AutoSAC planned for {plan.device} but trains on {device_type}: the measured peak "
            f"({measured_bytes / _GIB:.3f} GiB) is logged, not compared with the budget."
        )
        return
    if measured_bytes > plan.budget_bytes:
        rank_zero_warn(
            f"AutoSAC: the measured peak of a planned step, {measured_bytes / _GIB:.3f} GiB, EXCEEDS "
            f"the budget of {plan.budget_gb:.3f} GiB (predicted {plan.predicted_peak_bytes / _GIB:.3f} "
            "GiB). The plan did not take effect as planned or the estimate was wrong; lower the budget or "
            "check the warnings above."
        )
