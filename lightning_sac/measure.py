"""Ground truth: the memory of a real training step on this machine, from torch.profiler's allocator events.

This is independent of the dry run's tracker: it reads what the allocator reported, event by event, while
the same :func:`~lightning_sac.profiling.step.training_step` ran on real tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from lightning_sac.profiling.step import (
    LossFn,
    OptimizerFactory,
    check_example_inputs,
    model_loss,
    tensors_of,
    training_step,
)

__all__ = ["MeasuredStep", "measure_training_step", "peak_from_events"]


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


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    return sum({id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}.values())


def measure_training_step(
    model: nn.Module,
    example_inputs: tuple[Any, ...],
    *,
    loss_fn: LossFn | None = None,
    optimizer_factory: OptimizerFactory | None = None,
) -> MeasuredStep:
    """Train ``model`` for real on this machine's CPU and measure the memory of one step.

    With an optimizer, a first step creates its state and the second is measured, as
    :func:`~lightning_sac.profile_model` does. The model's parameters are updated: pass a copy to keep yours.

    Args:
        model: A model with real weights on the CPU.
        example_inputs: Positional inputs of ``model``.
        loss_fn: As for :func:`~lightning_sac.profile_model`.
        optimizer_factory: As for :func:`~lightning_sac.profile_model`.
    """
    example_inputs = check_example_inputs(example_inputs)
    compute_loss = model_loss(loss_fn)
    params = list(model.parameters())
    optimizer = optimizer_factory(params) if optimizer_factory is not None else None
    if optimizer is not None:
        training_step(model, example_inputs, compute_loss, optimizer)
    state = (
        []
        if optimizer is None
        else [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    )
    grads = [p.grad for p in params if p.grad is not None]
    baseline = _unique_bytes(params + list(model.buffers()) + grads + state + tensors_of(example_inputs))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        training_step(model, example_inputs, compute_loss, optimizer)
    events = [
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    return peak_from_events(events, baseline)
