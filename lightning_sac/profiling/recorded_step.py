"""One recorded dry run of a training step: the fake model, the real batch values, and the recorder around them.

:func:`~lightning_sac.profiling.dry_run.profile_step` turns a run into a profile; a second run with the model's
KV caches on gives the peak of the step as the model runs without a plan.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.parameter import UninitializedParameter

from lightning_sac.caches import CacheSwitch
from lightning_sac.devices import DeviceSpec
from lightning_sac.profiling.compat import real_step_answers
from lightning_sac.profiling.emulation import CudaAttentionEmulation, cpu_output_bytes, cpu_workspace_bytes, fake_copy
from lightning_sac.profiling.own_checkpoints import CheckpointWatch, checkpointing_flags, flags_off
from lightning_sac.profiling.real_values import RealValuesMode, dry_run_inputs
from lightning_sac.profiling.recorder import StepRecorder
from lightning_sac.profiling.runtime import RuntimeEstimator
from lightning_sac.profiling.step import ComputeLoss, tensors_of, training_step

__all__ = ["RecordedStep", "StepSpec", "optimizer_state", "record_step"]


@dataclass(frozen=True)
class StepSpec:
    """How to run the step: the target, the estimator, the forward and the optimizer, and Lightning's order."""

    device: DeviceSpec
    estimator: RuntimeEstimator
    compute_loss: ComputeLoss
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer | None] | None = None
    share: tuple[object, ...] = ()
    autocast_dtype: torch.dtype | None = None
    lightning_order: bool = False


@dataclass
class RecordedStep:
    """A finished recorded run: the recorder and what it ran on, and what the dry run found about the model.

    Attributes:
        recorder: The recorder, closed.
        model: The fake copy of the model.
        optimizer: Its optimizer, if any.
        watch: The model's own checkpoint regions.
        caches: The KV caches switched off (empty when the run kept them).
        flags: Modules with Hugging Face's ``gradient_checkpointing`` flag on.
        replaced: Those of ``flags`` the run turned off.
    """

    recorder: StepRecorder
    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    watch: CheckpointWatch
    caches: CacheSwitch
    flags: list[str]
    replaced: list[str]


def optimizer_state(optimizer: torch.optim.Optimizer | None, params: list[nn.Parameter]) -> list[torch.Tensor]:
    """The optimizer's state tensors of ``params``."""
    if optimizer is None:
        return []
    return [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]


def _create_optimizer_state(
    model: nn.Module,
    inputs: Any,
    compute_loss: ComputeLoss,
    optimizer: torch.optim.Optimizer,
    params: list[nn.Parameter],
    keep_grads: bool = False,
    on_phase: Callable[[str], None] = lambda phase: None,
) -> None:
    """Step the optimizer once so that its state exists when the recorded step begins.

    Optimizers create their state from the gradients' shapes at the first step, so zero gradients do: the
    warm-up skips forward and backward, a third of the dry run's time. Lazy modules only get their parameter
    shapes from a forward, so for them the warm-up is a whole training step.
    """
    if any(isinstance(p, UninitializedParameter) for p in params):
        training_step(model, inputs, compute_loss, optimizer, on_phase)
        return
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    if not keep_grads:
        optimizer.zero_grad(set_to_none=True)


def record_step(
    model: nn.Module, example_inputs: Any, step: StepSpec, *, replace_existing: bool = False, kv_caches: bool = False
) -> RecordedStep:
    """Run one training step of a fake copy of ``model`` on (copies of) ``example_inputs`` under the recorder.

    Args:
        model: The user's model (untouched).
        example_inputs: What the step's forward takes.
        step: How to run it.
        replace_existing: Turn the model's Hugging Face ``gradient_checkpointing`` flags off.
        kv_caches: Keep the model's KV caches on (the step as it runs without a plan); by default they are off,
            as a plan runs it (:mod:`lightning_sac.caches`).
    """
    spec = step.device
    run_on = "cuda" if spec.is_cuda and torch.cuda.is_available() else "cpu"
    emulation = CudaAttentionEmulation() if spec.is_cuda and run_on == "cpu" else contextlib.nullcontext()
    forward = step.compute_loss
    if step.autocast_dtype is not None:
        dtype = step.autocast_dtype

        def forward(m: nn.Module, x: Any) -> torch.Tensor:
            with torch.autocast(device_type=run_on, dtype=dtype):
                return step.compute_loss(m, x)

    # Real tensors a loss_fn closes over (targets, masks) are converted to fake ones on first use, once each,
    # and counted as memory that existed before the step ("other"), as they would on the device.
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fmodel = fake_copy(model, mode, run_on, share=step.share)
    finputs = dry_run_inputs(example_inputs, mode, run_on)
    params = list(fmodel.parameters())
    flags = checkpointing_flags(fmodel)
    replaced = flags if replace_existing else []
    watch, caches = CheckpointWatch(fmodel), CacheSwitch(fmodel)
    switch: Any = contextlib.nullcontext() if kv_caches else caches
    real_values = RealValuesMode()

    def real_in(phase: str) -> None:
        real_values.enabled = phase in ("forward", "backward")

    # The real values' mode sits above the fake mode, so that what it does not run for real reaches the fake one.
    with flags_off(fmodel, replaced), real_step_answers(), watch, switch, mode, real_values, emulation:
        optimizer = step.make_optimizer(fmodel) if step.make_optimizer is not None else None
        if optimizer is not None:
            real_in("optimizer")
            keep = step.lightning_order
            _create_optimizer_state(fmodel, finputs, forward, optimizer, params, keep_grads=keep, on_phase=real_in)
        cpu = not spec.is_cuda
        recorder = StepRecorder(
            fmodel,
            spec,
            step.estimator,
            workspace=cpu_workspace_bytes if cpu else None,
            output_bytes=cpu_output_bytes if cpu else None,
        )
        try:
            recorder.track_existing(params, "parameter")
            recorder.track_existing(list(fmodel.buffers()), "buffer")
            recorder.track_existing([p.grad for p in params if p.grad is not None], "gradient")
            recorder.track_existing(optimizer_state(optimizer, params), "optimizer_state")
            recorder.track_existing(tensors_of(finputs), "other")
            recorder.watch_gradients(params)

            def on_phase(phase: str) -> None:
                real_in(phase)
                recorder.set_phase(phase)

            with recorder:
                training_step(
                    fmodel, finputs, forward, optimizer, on_phase, zero_grad_before_backward=step.lightning_order
                )
        finally:
            recorder.close()
    return RecordedStep(recorder, fmodel, optimizer, watch, caches, flags, replaced)
