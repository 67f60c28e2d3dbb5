"""The dry run: one training step recorded on a fake copy of the model, measured module by module."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_sac.devices import DeviceSpec
from lightning_sac.dryrun.cuda.trace import replay
from lightning_sac.dryrun.data import ModelProfile
from lightning_sac.dryrun.recorded_step import (
    RecordedStep,
    StepSpec,
    host_step_params,
    optimizer_state,
    record_step,
)
from lightning_sac.dryrun.step import input_signature, loop_signature
from lightning_sac.dryrun.values.stand_in_check import record_checked
from lightning_sac.sharding import sharded_layout

__all__ = ["DryRun", "dry_run"]


@dataclass
class DryRun:
    """A recorded step: its profile, and what calibrating it on this host takes.

    Attributes:
        profile: The profile, in bytes and milliseconds.
        input_specs: Per module fqn, the shapes and dtypes of the arguments of its recorded call.
        with_caches: When the dry run switched KV caches off, what builds the profile of the step with them on
            (whose peak is :attr:`ModelProfile.kv_cache_peak`), made only when asked for; ``None`` otherwise.
    """

    profile: ModelProfile
    input_specs: dict[str, Any]
    with_caches: Callable[[], ModelProfile] | None = None


def _unique_storage_bytes(tensors: list[torch.Tensor], spec: DeviceSpec) -> int:
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
    return sum(spec.round_bytes(n) for n in storages.values())


def dry_run(
    model: nn.Module, example_inputs: Any, step: StepSpec, *, estimate: str, replace_existing: bool = False
) -> DryRun:
    """Record ``step`` of ``model`` on ``example_inputs`` under fake tensors (see :func:`lightning_sac.profile_step`).

    ``estimate`` names ``step.estimator``'s kind, as the profile records it.

    Raises:
        ProfilingError: A data-dependent op on a value derived from the weights; names the op, module and line.
    """
    # No garbage collection inside: garbage in a cycle would be freed wherever one ran, and the profile (its frees
    # are events) would differ from one dry run to the next (a deep model's short runs then do not extend).
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _dry_run(model, example_inputs, step, estimate, replace_existing)
    finally:
        if collecting:
            gc.enable()


def _dry_run(model: nn.Module, example_inputs: Any, step: StepSpec, estimate: str, replace_existing: bool) -> DryRun:
    # Run again when scalar reads got stand-ins, to check they decided nothing (dryrun/values/placeholders.py).
    run = record_checked(lambda: record_step(model, example_inputs, step, replace_existing=replace_existing))
    warm = run.kept_values > 0
    # Trainable parameters the step gives no gradient (a decoder's unused cross-attention, a vision tower's unused
    # last layer): the warm-up's zero gradients made optimizer state for them, which a fit's optimizer never makes
    # (AdamW: twice their bytes). Known after a backward only; with accumulation the earlier gradients hide them.
    plain_loop = run.optimizers and step.manual is None and step.accumulate_grad_batches == 1
    ungraded = run.ungraded if plain_loop else frozenset()
    if warm or ungraded:
        # The model's code kept values it computed (an LRU-cached index, a module's lazily built table): every step
        # of a fit after its first finds them, and runs fewer ops than the recorded one did. Planned modules would
        # meet other ops than profiled (their policy falls back, off the plan's memory), so the step is recorded
        # again after an unrecorded forward, as the fit's later steps run. Costs a dry run, only for such models.
        run = record_checked(
            lambda: record_step(
                model, example_inputs, step, replace_existing=replace_existing, warm_forward=warm, ungraded=ungraded
            )
        )
    profile = _profile(model, example_inputs, step, run, estimate)
    with_caches = None
    if run.caches.switched_off:
        # The step as the model runs without a plan, with its caches: what a plan must beat (it can hold more or
        # less than without them: fused projections' views keep their buffers, caches' copies free them).
        # Its stand-ins are checked as the first run's were (a distribution's argument check needs the other answer).
        cached = record_checked(
            lambda: record_step(
                model,
                example_inputs,
                step,
                replace_existing=replace_existing,
                kv_caches=True,
                warm_forward=warm,
                ungraded=ungraded,
            )
        )
        with_caches = functools.partial(_profile, model, example_inputs, step, cached, estimate)
        profile.kv_cache_peak = cached.recorder.memory.peak.peak_snapshot
    return DryRun(profile, run.recorder.input_specs, with_caches)


def _profile(model: nn.Module, example_inputs: Any, step: StepSpec, run: RecordedStep, estimate: str) -> ModelProfile:
    """The profile of a recorded run."""
    spec, manual_step = step.device, step.manual
    accumulate_grad_batches, wrapper = step.accumulate_grad_batches, step.wrapper
    recorder, fmodel, optimizers = run.recorder, run.model, run.optimizers
    manual = manual_step is not None
    modules = recorder.modules()
    named = dict(fmodel.named_modules())
    host_steps = host_step_params(optimizers) if spec.is_cuda else set()
    for fqn, prof in modules.items():
        mod_params = list(named[fqn].parameters())
        prof.parameter_bytes = _unique_storage_bytes(mod_params, spec)
        prof.buffer_bytes = _unique_storage_bytes(list(named[fqn].buffers()), spec)
        prof.gradient_bytes = sum(spec.round_bytes(p.numel() * p.element_size()) for p in mod_params if p.requires_grad)
        prof.optimizer_state_bytes = _unique_storage_bytes(
            optimizer_state(optimizers, mod_params, host_steps=host_steps), spec
        )

    memory = recorder.memory
    trace = None if memory.trace is None else memory.trace.trace
    profile = ModelProfile(
        device=spec,
        estimate=estimate,
        modules=modules,
        forward_pre_order=recorder.orders["fwd_pre"],
        forward_post_order=recorder.orders["fwd_post"],
        backward_pre_order=recorder.orders["bwd_pre"],
        backward_post_order=recorder.orders["bwd_post"],
        peak_bytes=memory.peak.peak_total,
        reserved_peak_bytes=0 if trace is None else replay(trace.events, trace.sizes, trace.config).reserved,
        peak_breakdown=memory.peak.peak_snapshot,
        peak_location=memory.peak_location,
        forward_ms=recorder.phase_ms["forward"],
        backward_ms=recorder.phase_ms["backward"],
        optimizer_ms=recorder.phase_ms["optimizer"],
        input_signature=input_signature(example_inputs) + loop_signature(accumulate_grad_batches, manual),
        timeline=recorder.timeline,
        checkpointed_modules=run.watch.under,
        checkpoint_callers=run.watch.callers,
        checkpointing_flags=[f for f in run.flags if f not in run.replaced],
        replaced_checkpointing=run.replaced,
        kv_cache_off=run.caches.switched_off,
        kv_cache_with_tokens=run.caches.holds_tokens,
        module_state=recorder.module_state,
        writes_input=recorder.writes_input,
        placeholders=run.placeholders,
        routing=run.routing,
        sharded=sharded_layout(model, wrapper),
        allocations=trace,
    )
    return profile
