"""``profile_model``: a fake-tensor dry run of one training step that measures every module."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.parameter import UninitializedParameter

from lightning_sac.caches import CacheSwitch
from lightning_sac.devices import DeviceSpec, get_device_spec
from lightning_sac.profiling.calibrate import calibrate_modules
from lightning_sac.profiling.compat import real_step_answers
from lightning_sac.profiling.data import ModelProfile
from lightning_sac.profiling.emulation import (
    CudaAttentionEmulation,
    cpu_output_bytes,
    cpu_workspace_bytes,
    fake_copy,
)
from lightning_sac.profiling.overhead import measure_backend_overheads
from lightning_sac.profiling.own_checkpoints import CheckpointWatch, checkpointing_flags, flags_off
from lightning_sac.profiling.real_values import RealValuesMode, dry_run_inputs
from lightning_sac.profiling.recorder import StepRecorder
from lightning_sac.profiling.runtime import make_estimator
from lightning_sac.profiling.step import (
    ComputeLoss,
    LossFn,
    OptimizerFactory,
    input_signature,
    model_inputs,
    model_loss,
    tensors_of,
    training_step,
)

__all__ = ["profile_model", "profile_step"]


def _unique_storage_bytes(tensors: list[torch.Tensor], spec: DeviceSpec) -> int:
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
    return sum(spec.round_bytes(n) for n in storages.values())


def _optimizer_state(optimizer: torch.optim.Optimizer | None, params: list[nn.Parameter]) -> list[torch.Tensor]:
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
) -> None:
    """Step the optimizer once so that its state exists when the recorded step begins.

    Optimizers create their state from the gradients' shapes at the first step, so zero gradients do: the
    warm-up skips forward and backward, a third of the dry run's time. Lazy modules only get their parameter
    shapes from a forward, so for them the warm-up is a whole training step.
    """
    if any(isinstance(p, UninitializedParameter) for p in params):
        training_step(model, inputs, compute_loss, optimizer)
        return
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    if not keep_grads:
        optimizer.zero_grad(set_to_none=True)


def profile_model(
    model: nn.Module,
    example_inputs: tuple[Any, ...] | Mapping[str, Any],
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: LossFn | None = None,
    optimizer_factory: OptimizerFactory | None = None,
    device: str | DeviceSpec = "auto",
    estimate: str = "roofline",
    share: tuple[object, ...] = (),
    replace_existing: bool = False,
) -> ModelProfile:
    """Profile one training step of ``model`` on ``device`` without running it for real.

    The step (forward, loss, backward, optimizer step) runs on a fake copy of the model under
    ``FakeTensorMode``: no memory is spent on parameters or activations, and the user's model, its parameters
    and their ``.grad`` are not touched. With an optimizer, a first unrecorded optimizer step on zero gradients
    creates its state (every parameter that requires grad gets state, used in the step or not) and the
    training step after it is recorded, so the optimizer steps twice. The recorded step gathers, in one pass,
    memory by category for every module, runtime per module and per op, SAC op statistics for every non-leaf
    module, and the module execution orders.

    A CUDA target on a machine without a GPU is emulated on fake CPU tensors: the allocator's 512-byte
    rounding, the target's throughput and bandwidth, and attention through the flash/efficient kernels.

    The dry run takes the real step's data-dependent decisions: the example batch stays real (a copy), and every
    op that reads only real values runs for real (:mod:`lightning_sac.profiling.real_values`), so an all-ones
    attention mask, a count of labels or a boolean selection behave as in training; libraries' fake-tensor
    checks answer as in the real step (:mod:`lightning_sac.profiling.compat`). Modules called with a KV cache in
    training run without it, as a planned module will (:mod:`lightning_sac.caches`), and modules that already
    run under the model's own checkpointing are recorded (:attr:`ModelProfile.checkpointed_modules`).

    Args:
        model: The model, on CPU with real weights or built under ``torch.device("meta")``.
        example_inputs: Positional inputs as a tuple (``model(*example_inputs)``), or keyword inputs as a dict
            (``model(**example_inputs)``, e.g. a tokenized Hugging Face batch).
        example_kwargs: Keyword inputs besides positional ``example_inputs``.
        loss_fn: Maps the model's output to a scalar loss; default the output's ``loss`` when it has one (a
            Hugging Face model given ``labels``), else ``output.sum()`` of the first float output.
        optimizer_factory: Builds the optimizer the user trains with from an iterable of parameters.
        device: Target: a name from :func:`lightning_sac.devices.known_devices`, a ``DeviceSpec``, or
            ``"auto"`` (the visible CUDA device, else the CPU).
        estimate: ``"roofline"`` (any target) or ``"benchmark"`` (time ops on this machine's CPU).
        share: Objects reachable from ``model`` that must not be copied (e.g. a Lightning trainer).
        replace_existing: The model checkpoints itself with Hugging Face's ``gradient_checkpointing`` flags:
            profile it with them off, for a plan that replaces them (applying it turns them off).

    Returns:
        The profile, in bytes and milliseconds.

    Raises:
        ProfilingError: A data-dependent op on a value derived from the weights (which the dry run does not
            have); names the op, the module and the source line.
        TypeError: ``example_inputs`` is neither a tuple nor a dict.
        ValueError: The loss is not a scalar, or ``estimate`` is unknown.
        UnknownDeviceError: ``device`` names no known device.
    """
    return profile_step(
        model,
        model_inputs(example_inputs, example_kwargs),
        model_loss(loss_fn),
        make_optimizer=None if optimizer_factory is None else (lambda m: optimizer_factory(m.parameters())),
        device=device,
        estimate=estimate,
        share=share,
        replace_existing=replace_existing,
    )


def profile_step(
    model: nn.Module,
    example_inputs: Any,
    compute_loss: ComputeLoss,
    *,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer | None] | None = None,
    device: str | DeviceSpec = "auto",
    estimate: str = "roofline",
    share: tuple[object, ...] = (),
    autocast_dtype: torch.dtype | None = None,
    lightning_order: bool = False,
    replace_existing: bool = False,
) -> ModelProfile:
    """Profile a training step whose forward is ``compute_loss(model, example_inputs)``: the general form.

    :func:`profile_model` is this with ``compute_loss = loss_fn(model(*args, **kwargs))``; the Lightning callback
    passes the module's own ``training_step``. Arguments and errors are as for :func:`profile_model`, and:

    Args:
        model: The model.
        example_inputs: What ``compute_loss`` takes as inputs (copies of its tensors are passed: see
            :func:`~lightning_sac.profiling.real_values.dry_run_inputs`).
        compute_loss: Runs the forward on the (fake) model and returns the scalar loss.
        make_optimizer: Builds the optimizer from the (fake) model, or returns ``None``.
        device: Target device.
        estimate: ``"roofline"`` or ``"benchmark"``.
        share: Objects reachable from ``model`` that must not be copied.
        autocast_dtype: Run the forward under ``torch.autocast`` with this dtype (mixed precision).
        lightning_order: Lightning's automatic optimization sets gradients to ``None`` just before backward, so
            the previous step's gradients are alive through the forward: profile that order.
        replace_existing: Profile with the model's Hugging Face ``gradient_checkpointing`` flags off.
    """
    spec = get_device_spec(device)
    estimator = make_estimator(estimate, spec)
    run_on = "cuda" if spec.is_cuda and torch.cuda.is_available() else "cpu"
    emulation = CudaAttentionEmulation() if spec.is_cuda and run_on == "cpu" else contextlib.nullcontext()
    forward = compute_loss
    if autocast_dtype is not None:

        def forward(m: nn.Module, x: tuple[Any, ...]) -> torch.Tensor:
            with torch.autocast(device_type=run_on, dtype=autocast_dtype):
                return compute_loss(m, x)

    # Real tensors a loss_fn closes over (targets, masks) are converted to fake ones on first use, once each,
    # and counted as memory that existed before the step ("other"), as they would on the device.
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fmodel = fake_copy(model, mode, run_on, share=share)
    finputs = dry_run_inputs(example_inputs, mode, run_on)
    params = list(fmodel.parameters())
    flags = checkpointing_flags(fmodel)
    replaced = flags if replace_existing else []
    watch, caches = CheckpointWatch(fmodel), CacheSwitch(fmodel)
    # The real values' mode sits above the fake mode, so that what it does not run for real reaches the fake one.
    with flags_off(fmodel, replaced), real_step_answers(), watch, caches, mode, RealValuesMode(), emulation:
        optimizer = make_optimizer(fmodel) if make_optimizer is not None else None
        if optimizer is not None:
            _create_optimizer_state(fmodel, finputs, forward, optimizer, params, keep_grads=lightning_order)
        cpu = not spec.is_cuda
        recorder = StepRecorder(
            fmodel,
            spec,
            estimator,
            workspace=cpu_workspace_bytes if cpu else None,
            output_bytes=cpu_output_bytes if cpu else None,
        )
        try:
            recorder.track_existing(params, "parameter")
            recorder.track_existing(list(fmodel.buffers()), "buffer")
            recorder.track_existing([p.grad for p in params if p.grad is not None], "gradient")
            recorder.track_existing(_optimizer_state(optimizer, params), "optimizer_state")
            recorder.track_existing(tensors_of(finputs), "other")
            recorder.watch_gradients(params)
            with recorder:
                training_step(
                    fmodel, finputs, forward, optimizer, recorder.set_phase, zero_grad_before_backward=lightning_order
                )
        finally:
            recorder.close()

    modules = recorder.modules()
    named = dict(fmodel.named_modules())
    for fqn, prof in modules.items():
        mod_params = list(named[fqn].parameters())
        prof.parameter_bytes = _unique_storage_bytes(mod_params, spec)
        prof.buffer_bytes = _unique_storage_bytes(list(named[fqn].buffers()), spec)
        prof.gradient_bytes = sum(spec.round_bytes(p.numel() * p.element_size()) for p in mod_params if p.requires_grad)
        prof.optimizer_state_bytes = _unique_storage_bytes(_optimizer_state(optimizer, mod_params), spec)

    memory = recorder.memory
    profile = ModelProfile(
        device=spec,
        estimate=estimate,
        modules=modules,
        forward_pre_order=recorder.orders["fwd_pre"],
        forward_post_order=recorder.orders["fwd_post"],
        backward_pre_order=recorder.orders["bwd_pre"],
        backward_post_order=recorder.orders["bwd_post"],
        peak_bytes=memory.peak.peak_total,
        peak_breakdown=memory.peak.peak_snapshot,
        peak_location=memory.peak_location,
        forward_ms=recorder.phase_ms["forward"],
        backward_ms=recorder.phase_ms["backward"],
        optimizer_ms=recorder.phase_ms["optimizer"],
        input_signature=input_signature(example_inputs),
        timeline=recorder.timeline,
        checkpointed_modules=watch.under,
        checkpoint_callers=watch.callers,
        checkpointing_flags=[f for f in flags if f not in replaced],
        replaced_checkpointing=replaced,
        kv_cache_off=caches.switched_off,
        kv_cache_with_tokens=caches.holds_tokens,
    )
    # What wrapping costs is timed on this host, so only when the step is timed on it too; a GPU plan counts
    # recompute alone.
    if estimate == "benchmark":
        profile.backend_overhead_us = {k: [v.forward_us, v.rerun_us] for k, v in measure_backend_overheads().items()}
        calibrate_modules(
            model, profile.modules, recorder.input_specs, profile.step_ms, share=share, autocast_dtype=autocast_dtype
        )
    return profile
