"""``profile_model`` and ``profile_step``: the dry run of one training step, calibrated on this host.

The dry run (:mod:`lightning_sac.dryrun`) records the step on fake tensors; with ``estimate="benchmark"`` the
cost of applying a plan is then measured here (:mod:`~lightning_sac.profiling.calibrate`,
:mod:`~lightning_sac.profiling.overhead`), which takes the appliers: this stage sits above them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_sac.adapters import host_generators, profiles_uncompiled
from lightning_sac.devices import DeviceSpec, get_device_spec
from lightning_sac.dryrun import (
    ComputeLoss,
    DryRun,
    LossFn,
    MakeOptimizers,
    ManualStep,
    ModelProfile,
    OptimizerFactory,
    StepSpec,
    dry_run,
    make_estimator,
    model_inputs,
    model_loss,
)
from lightning_sac.profiling.calibrate import calibrate_modules
from lightning_sac.profiling.overhead import measure_backend_overheads
from lightning_sac.profiling.replicate import replicated_dry_run
from lightning_sac.sharding import is_sharded, tensor_parallel_modules

__all__ = ["profile_model", "profile_step"]


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
    replicate: bool = True,
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
    op that reads only real values runs for real (:mod:`lightning_sac.dryrun.values.real_values`), so an all-ones
    attention mask, a count of labels or a boolean selection behave as in training; libraries' fake-tensor
    checks answer as in the real step (:mod:`lightning_sac.dryrun.values.compat`). Modules called with a KV cache in
    training run without it, as a planned module will (:mod:`lightning_sac.adapters.caches`), and modules that already
    run under the model's own checkpointing are recorded (:attr:`ModelProfile.checkpointed_modules`).

    Args:
        model: The model, on CPU with real weights or built under ``torch.device("meta")``.
        example_inputs: Positional inputs as a tuple (``model(*example_inputs)``), or keyword inputs as a dict
            (``model(**example_inputs)``, e.g. a tokenized Hugging Face batch).
        example_kwargs: Keyword inputs besides positional ``example_inputs``.
        loss_fn: Maps the model's output to a scalar loss; default the output's ``loss`` when it has one (a
            Hugging Face model given ``labels``), else ``output.sum()`` of the first float output.
        optimizer_factory: Builds the optimizer the user trains with from an iterable of parameters.
        device: Target: a name from :func:`lightning_sac.devices.spec.known_devices`, a ``DeviceSpec``, or
            ``"auto"`` (the visible CUDA device, else the CPU).
        estimate: ``"roofline"`` (any target) or ``"benchmark"`` (time ops on this machine's CPU).
        share: Objects reachable from ``model`` that must not be copied (e.g. a Lightning trainer).
        replace_existing: The model checkpoints itself with Hugging Face's ``gradient_checkpointing`` flags:
            profile it with them off, for a plan that replaces them (applying it turns them off).
        replicate: A model with a long list of identical layers (32 or more) is dry-run with 4, 5 and 6 of them
            and its profile extended from those, when that is exact (:mod:`~lightning_sac.profiling.replicate`);
            ``False`` dry-runs every layer.

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
        replicate=replicate,
    )


@profiles_uncompiled  # a compiled model is profiled as written (lightning_sac.adapters.compiled)
def profile_step(
    model: nn.Module,
    example_inputs: Any,
    compute_loss: ComputeLoss | None,
    *,
    make_optimizer: MakeOptimizers | None = None,
    device: str | DeviceSpec = "auto",
    estimate: str = "roofline",
    share: tuple[object, ...] = (),
    autocast_dtype: torch.dtype | None = None,
    lightning_order: bool = False,
    replace_existing: bool = False,
    accumulate_grad_batches: int = 1,
    manual_step: ManualStep | None = None,
    wrapper: nn.Module | None = None,
    replicate: bool = True,
    autocast_cache: bool = False,
) -> ModelProfile:
    """Profile a training step whose forward is ``compute_loss(model, example_inputs)``: the general form.

    :func:`profile_model` is this with ``compute_loss = loss_fn(model(*args, **kwargs))``; the Lightning callback
    passes the module's own ``training_step``. Arguments and errors are as for :func:`profile_model`, and:

    Args:
        model: The model.
        example_inputs: What ``compute_loss`` takes as inputs (copies of its tensors are passed: see
            :func:`~lightning_sac.dryrun.values.real_values.dry_run_inputs`).
        compute_loss: Runs the forward on the (fake) model and returns the scalar loss; ``None`` with
            ``manual_step``.
        make_optimizer: Builds the optimizer (or, for ``manual_step``, the optimizers) from the (fake) model, or
            returns ``None``.
        device: Target device.
        estimate: ``"roofline"`` or ``"benchmark"``.
        share: Objects reachable from ``model`` that must not be copied.
        autocast_dtype: Run the forward under ``torch.autocast`` with this dtype (mixed precision).
        lightning_order: Lightning's automatic optimization sets gradients to ``None`` just before backward, so
            the previous step's gradients are alive through the forward: profile that order.
        replace_existing: Profile with the model's Hugging Face ``gradient_checkpointing`` flags off.
        accumulate_grad_batches: Lightning's gradient accumulation (with ``lightning_order``): the profile is of
            the last micro-batch of a cycle, which holds the most at every moment (see
            :func:`~lightning_sac.dryrun.step.training_step`).
        manual_step: A step that runs its own backward passes and optimizer steps (Lightning's manual
            optimization), instead of ``compute_loss``. It is run once whole before the recorded run, so that the
            recorded one begins with the gradients and optimizer state the fit's steps begin with.
        wrapper: An FSDP1 unit wrapping ``model`` itself (Lightning's ``trainer.strategy.model``), if any. A
            sharded model is profiled unsharded, and its units are read into :attr:`ModelProfile.sharded`.
        replicate: As for :func:`profile_model`. A sharded model, and a step timed on this host
            (``estimate="benchmark"``), are dry-run whole.
        autocast_cache: With ``autocast_dtype``, whether the loop's autocast caches its casts of weights (the
            default of ``torch.autocast``, accelerate's and Fabric's; Lightning's Trainer turns the cache off): a
            cached cast lives until the region ends, so a plan keeps it saved.

    The profile's :attr:`~ModelProfile.input_signature` ends with the loop's settings where they differ from a
    plain step (:func:`~lightning_sac.dryrun.step.loop_signature`): a plan made for it is not reused for another.
    """
    spec = get_device_spec(device)
    estimator = make_estimator(estimate, spec)
    step = StepSpec(
        spec,
        estimator,
        compute_loss,
        make_optimizer,
        share,
        autocast_dtype,
        lightning_order,
        accumulate_grad_batches=accumulate_grad_batches,
        manual=manual_step,
        autocast_cache=autocast_cache,
        wrapper=wrapper,
    )

    def whole() -> DryRun:
        return dry_run(model, example_inputs, step, estimate=estimate, replace_existing=replace_existing)

    # A timed step calibrates each module on this host from its recorded inputs: only a whole dry run has them.
    replicable = replicate and estimate != "benchmark" and wrapper is None
    replicable = replicable and not is_sharded(model) and not tensor_parallel_modules(model)
    # A forward may draw from Python's or NumPy's global generator: the dry runs leave the user's streams as they were.
    with host_generators():
        run = (replicable and replicated_dry_run(model, whole)) or whole()
        profile = run.profile
        # What wrapping costs is timed on this host, so only when the step is timed on it too; a GPU plan counts
        # recompute alone.
        if estimate == "benchmark":
            overheads = measure_backend_overheads().items()
            profile.backend_overhead_us = {k: [v.forward_us, v.rerun_us] for k, v in overheads}
            calibrate_modules(model, profile.modules, run.input_specs, share=share, autocast_dtype=autocast_dtype)
    return profile
