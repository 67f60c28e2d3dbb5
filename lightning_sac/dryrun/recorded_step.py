"""One recorded dry run of a training step: the fake model, the real batch values, and the recorder around them.

:func:`~lightning_sac.dryrun.run.profile_step` turns a run into a profile; a second run with the model's
KV caches on gives the peak of the step as the model runs without a plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.parameter import UninitializedParameter

from lightning_sac.adapters import CacheSwitch
from lightning_sac.devices import DeviceSpec
from lightning_sac.dryrun.cpu.scratch import kernel_scratch
from lightning_sac.dryrun.cuda.conv_workspace import cuda_workspace
from lightning_sac.dryrun.cuda.optimizers import foreach_as_on_cuda
from lightning_sac.dryrun.emulation import CudaEmulation, cpu_output_bytes, cpu_workspace_bytes, fake_copy
from lightning_sac.dryrun.modules.own_checkpoints import CheckpointWatch, checkpointing_flags, flags_off
from lightning_sac.dryrun.recorder import StepRecorder
from lightning_sac.dryrun.runtime import RuntimeEstimator
from lightning_sac.dryrun.step import ComputeLoss, ManualStep, manual_training_step, tensors_of, training_step
from lightning_sac.dryrun.values.compat import plain_tensor_paths, real_step_answers, same_type_conversions
from lightning_sac.dryrun.values.host_reads import HostArrays
from lightning_sac.dryrun.values.meta_fallback import quiet_meta_failures
from lightning_sac.dryrun.values.moe_routing import EvenRouting
from lightning_sac.dryrun.values.placeholders import Placeholders
from lightning_sac.dryrun.values.real_values import RealValuesMode, dry_run_inputs

__all__ = ["RecordedStep", "StepSpec", "optimizer_state", "record_step"]


#: Builds the step's optimizer, or its optimizers (a step that optimizes itself may have several), or ``None``.
MakeOptimizers = Callable[[nn.Module], "torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None"]


@dataclass(frozen=True)
class StepSpec:
    """How to run the step: the target, the estimator, the forward and the optimizer, and Lightning's order.

    Attributes:
        compute_loss: The forward of a step whose backward and optimizer step the dry run runs; ``None`` with
            ``manual``.
        accumulate_grad_batches: Lightning's gradient accumulation (see
            :func:`~lightning_sac.dryrun.step.training_step`).
        manual: A step that runs its own backward passes and optimizer steps (Lightning's manual optimization).
        autocast_cache: Whether autocast keeps its casts of weights for the whole autocast region. Lightning's
            mixed precision turns the cache off (``cache_enabled=False``): every use of a weight casts it again, and
            a cast autograd does not save is freed at once (:mod:`lightning_sac.dryrun.cuda.autocast`).
        wrapper: An FSDP1 unit wrapping the model itself (its root unit), if any.
    """

    device: DeviceSpec
    estimator: RuntimeEstimator
    compute_loss: ComputeLoss | None
    make_optimizer: MakeOptimizers | None = None
    share: tuple[object, ...] = ()
    autocast_dtype: torch.dtype | None = None
    lightning_order: bool = False
    accumulate_grad_batches: int = 1
    manual: ManualStep | None = None
    autocast_cache: bool = False
    wrapper: nn.Module | None = None


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
        kept_values: Tensors the forward computed from the batch alone (no weights) that the model's code kept
            after the step, in a cache (an LRU-cached position index) or on a module: a later step finds them
            and does not compute them, so it runs fewer ops than this one.
        ungraded: Indices (in the model's ``parameters()``) of trainable parameters whose gradient the step left
            ``None`` (an unused cross-attention): an optimizer makes no state for them.
    """

    recorder: StepRecorder
    model: nn.Module
    watch: CheckpointWatch
    caches: CacheSwitch
    flags: list[str]
    replaced: list[str]
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    placeholders: list[dict[str, Any]] = field(default_factory=list)  # where stand-ins were used (placeholders.py)
    routing: list[dict[str, Any]] = field(default_factory=list)  # experts calls and their split (moe_routing.py)
    kept_values: int = 0
    ungraded: frozenset[int] = frozenset()


def optimizer_state(
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
    params: list[nn.Parameter],
    *,
    host_steps: AbstractSet[int] = frozenset(),
) -> list[torch.Tensor]:
    """The state tensors of ``params`` in the optimizer (or in each of the optimizers).

    Args:
        optimizers: The optimizer(s).
        params: Whose state.
        host_steps: Ids of the parameters whose scalar ``step`` is left out, as it lives on the host
            (:func:`host_step_params`).
    """
    out = []
    for o in _as_list(optimizers):
        for p in params:
            host_step = id(p) in host_steps
            for key, v in o.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and not (host_step and key == "step" and v.dim() == 0):
                    out.append(v)
    return out


def host_step_params(optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None) -> set[int]:
    """Ids of the parameters whose optimizer keeps its scalar ``step`` on the host when they are on a GPU.

    torch's optimizers do unless the group is ``capturable`` or ``fused`` (Adam, AdamW and others'
    ``_init_group``), which the dry run on CPU tensors cannot tell apart.
    """
    return {
        id(q)
        for o in _as_list(optimizers)
        for g in o.param_groups
        if not (g.get("capturable") or g.get("fused"))
        for q in g["params"]
    }


def _as_list(
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
) -> list[torch.optim.Optimizer]:
    if optimizers is None:
        return []
    return [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)


def _warm_up(
    model: nn.Module,
    inputs: Any,
    step: StepSpec,
    forward: ComputeLoss | None,
    optimizers: list[torch.optim.Optimizer],
    on_phase: Callable[[str], None],
    ungraded: AbstractSet[int] = frozenset(),
) -> None:
    """Bring the fake copy to the state a step of a running fit begins in: optimizer state, and gradients.

    Optimizers create their state from the gradients' shapes at the first step, so zero gradients do: the
    warm-up skips forward and backward, a third of the dry run's time. Lazy modules only get their parameter
    shapes from a forward, so for them the warm-up is a whole training step. A step that optimizes itself leaves
    the gradients as its own code leaves them (set to ``None`` after its optimizer steps, or alive until its next
    ``zero_grad``), so it runs once whole before the recorded one: the recorded step begins as the fit's do.
    """
    params = list(model.parameters())
    lazy = any(isinstance(p, UninitializedParameter) for p in params)
    if step.manual is not None:
        if not lazy:
            _zero_grad_steps(optimizers, params, keep_grads=False)  # state even if step 0 does not step
        manual_training_step(model, inputs, step.manual, optimizers, on_phase)
        return
    if not optimizers:
        return
    assert forward is not None
    if lazy:
        training_step(model, inputs, forward, optimizers[0], on_phase, zero_grad_before_backward=step.lightning_order)
        return
    # Lightning sets gradients to None just before backward: the previous step's are alive when a step begins.
    _zero_grad_steps(optimizers, params, keep_grads=step.lightning_order, ungraded=ungraded)


def _zero_grad_steps(
    optimizers: list[torch.optim.Optimizer],
    params: list[nn.Parameter],
    keep_grads: bool,
    ungraded: AbstractSet[int] = frozenset(),
) -> None:
    """Step each optimizer once on zero gradients (its state exists from then on), but for ``ungraded`` params."""
    for i, p in enumerate(params):
        if p.requires_grad and i not in ungraded:
            p.grad = torch.zeros_like(p)
    for optimizer in optimizers:
        optimizer.step()
        if not keep_grads:
            optimizer.zero_grad(set_to_none=True)


def record_step(
    model: nn.Module,
    example_inputs: Any,
    step: StepSpec,
    *,
    replace_existing: bool = False,
    kv_caches: bool = False,
    warm_forward: bool = False,
    ungraded: AbstractSet[int] = frozenset(),
) -> RecordedStep:
    """Run one training step of a fake copy of ``model`` on (copies of) ``example_inputs`` under the recorder.

    Args:
        model: The user's model (untouched).
        example_inputs: What the step's forward takes.
        step: How to run it.
        replace_existing: Turn the model's Hugging Face ``gradient_checkpointing`` flags off.
        kv_caches: Keep the model's KV caches on (the step as it runs without a plan); by default they are off,
            as a plan runs it (:mod:`lightning_sac.adapters.caches`).
        warm_forward: Run the forward once, unrecorded, before the recorded step, so that what the model's code
            caches (:attr:`RecordedStep.kept_values`) is there, as at every step of a fit after its first.
        ungraded: Indices (in ``model.parameters()``) of parameters the step gives no gradient
            (:attr:`RecordedStep.ungraded`): the warm-up makes no optimizer state for them, as a fit's optimizer makes
            none for a parameter whose gradient is ``None``.
    """
    spec = step.device
    run_on = "cuda" if spec.is_cuda and torch.cuda.is_available() else "cpu"
    emulation = CudaEmulation(spec) if spec.is_cuda and run_on == "cpu" else contextlib.nullcontext()
    # The optimizers' foreach implementation, which they take on a GPU and not on fake tensors (cuda/optimizers.py).
    foreach: Any = foreach_as_on_cuda(emulated=run_on == "cpu") if spec.is_cuda else contextlib.nullcontext()
    forward, manual = step.compute_loss, step.manual
    if (forward is None) == (manual is None):
        raise ValueError("A StepSpec takes compute_loss or manual, exactly one of them.")
    if step.autocast_dtype is not None:
        # Lightning's precision plugin runs the whole training_step under autocast: a manual step's backward
        # passes and optimizer steps too.
        autocast = torch.autocast(device_type=run_on, dtype=step.autocast_dtype, cache_enabled=step.autocast_cache)
        forward = None if forward is None else autocast(forward)
        manual = None if manual is None else autocast(manual)
        step = dataclasses.replace(step, compute_loss=forward, manual=manual)

    # Real tensors a loss_fn closes over (targets, masks) are converted to fake ones on first use, once each,
    # and counted as memory that existed before the step ("other"), as they would on the device.
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fmodel = fake_copy(model, mode, run_on, share=step.share, wrapper=step.wrapper, constants=True)
    finputs = dry_run_inputs(example_inputs, mode, run_on)
    params = list(fmodel.parameters())
    flags = checkpointing_flags(fmodel)
    replaced = flags if replace_existing else []
    watch, caches = CheckpointWatch(fmodel), CacheSwitch(fmodel)
    switch: Any = contextlib.nullcontext() if kv_caches else caches
    placeholders = Placeholders(fmodel)
    real_values = RealValuesMode(placeholders=placeholders)

    def real_in(phase: str) -> None:
        real_values.enabled = phase in ("forward", "backward")

    routing = EvenRouting(fmodel)  # mixture-of-experts routing on an even split of its rows (moe_routing.py)
    # The real values' mode sits above the fake mode, so that what it does not run for real reaches the fake one;
    # the routing's above it, so that the recorder counts the indices it makes real as the router's.
    with (
        flags_off(fmodel, replaced),
        real_step_answers(),
        plain_tensor_paths(),  # CTC's lengths as ATen reads them from plain tensors (compat.py)
        same_type_conversions(fmodel),  # a router's .to(its own dtype) at every forward (compat.py)
        quiet_meta_failures(),  # a failing meta kernel is answered or reported (meta_fallback.py), not logged
        watch,
        switch,
        placeholders,
        HostArrays(placeholders),  # .numpy() of a weight-derived value: named, or a stand-in (host_reads.py)
        mode,
        real_values,
        routing,
        emulation,
        foreach,
    ):
        optimizers = _as_list(step.make_optimizer(fmodel) if step.make_optimizer is not None else None)
        real_in("optimizer")
        _warm_up(fmodel, finputs, step, forward, optimizers, on_phase=real_in, ungraded=ungraded)
        if warm_forward and forward is not None and not step.manual:
            real_in("forward")
            forward(fmodel, finputs)  # its loss and graph are dropped at once
            real_in("optimizer")
        cpu = not spec.is_cuda
        recorder = StepRecorder(
            fmodel,
            spec,
            step.estimator,
            workspace=cpu_workspace_bytes if cpu else cuda_workspace(spec),
            output_bytes=cpu_output_bytes if cpu else None,
            is_real=real_values.is_real,
        )
        placeholders.allocated = recorder.allocated_outside_ops  # a metric's call, measured on a real copy
        try:
            recorder.track_existing(params, "parameter")
            recorder.track_existing(list(fmodel.buffers()), "buffer")
            recorder.track_existing([p.grad for p in params if p.grad is not None], "gradient")
            host_steps = host_step_params(optimizers) if spec.is_cuda else set()
            recorder.track_existing(optimizer_state(optimizers, params, host_steps=host_steps), "optimizer_state")
            recorder.track_existing(tensors_of(finputs), "other")
            recorder.watch_gradients(params)

            def on_phase(phase: str) -> None:
                real_in(phase)
                real_values.keep_made = phase == "forward"
                if phase == "optimizer" and not without_grad:  # after the (first) backward
                    without_grad.update(i for i, p in enumerate(params) if p.requires_grad and p.grad is None)
                recorder.set_phase(phase)

            routing.calls.clear()  # the recorded step's calls, not the warm-up's
            without_grad: set[int] = set()
            with recorder:
                if step.manual is not None:
                    manual_training_step(fmodel, finputs, step.manual, optimizers, on_phase)
                else:
                    assert forward is not None
                    training_step(
                        fmodel,
                        finputs,
                        forward,
                        optimizers[0] if optimizers else None,
                        on_phase,
                        zero_grad_before_backward=step.lightning_order,
                        accumulate_grad_batches=step.accumulate_grad_batches,
                    )
        finally:
            recorder.close()
            if cpu:
                kernel_scratch.save()  # what this dry run measured, for the next process on this host
    del finputs  # the batch's copies: what the step's code kept is what is still alive without them
    return RecordedStep(
        recorder,
        fmodel,
        watch,
        caches,
        flags,
        replaced,
        optimizers,
        placeholders.sites,
        routing=routing.calls,
        kept_values=real_values.kept(),
        ungraded=frozenset(without_grad),
    )
