"""The dry run: one training step recorded on fake tensors, and the profile it gives.

Takes a model, its batch, its loss and optimizer and a target device; gives a :class:`ModelProfile`: memory by
category for every module and op, runtimes, SAC statistics, orders. Emulates a CUDA target on a machine without one.
"""

from __future__ import annotations

from lightning_sac.dryrun.cuda.trace import AllocationTrace, Replayed, needed_reserved, replay
from lightning_sac.dryrun.data import (
    CATEGORIES,
    PHASES,
    MemorySnapshot,
    ModelProfile,
    ModuleOpStats,
    ModuleProfile,
    TimelineEvent,
    peak_location,
)
from lightning_sac.dryrun.emulation import fake_copy
from lightning_sac.dryrun.measured import (
    TIMELINE_CATEGORIES,
    MemoryTimeline,
    QuietProfile,
    event_name,
    filtered_native_output,
    memory_events,
    memory_timeline,
    peak_from_events,
    unique_bytes,
)
from lightning_sac.dryrun.modules.inputs import TensorSpec, materialize
from lightning_sac.dryrun.recorded_step import MakeOptimizers, StepSpec
from lightning_sac.dryrun.run import DryRun, dry_run
from lightning_sac.dryrun.runtime import make_estimator, real_tensor
from lightning_sac.dryrun.step import (
    ComputeLoss,
    LossFn,
    ManualStep,
    OptimizerFactory,
    fingerprint_of,
    input_signature,
    loop_signature,
    model_inputs,
    model_loss,
    profile_fingerprint,
    tensors_of,
)
from lightning_sac.dryrun.values.host_reads import host_read_stand_ins
from lightning_sac.dryrun.values.moe_routing import routing_bound_bytes
from lightning_sac.dryrun.values.placeholders import placeholder_message

__all__ = [
    "fake_copy",
    "AllocationTrace",
    "Replayed",
    "needed_reserved",
    "peak_location",
    "replay",
    "fingerprint_of",
    "profile_fingerprint",
    "CATEGORIES",
    "ComputeLoss",
    "DryRun",
    "LossFn",
    "MakeOptimizers",
    "ManualStep",
    "MemorySnapshot",
    "MemoryTimeline",
    "ModelProfile",
    "ModuleOpStats",
    "ModuleProfile",
    "OptimizerFactory",
    "PHASES",
    "QuietProfile",
    "filtered_native_output",
    "StepSpec",
    "TIMELINE_CATEGORIES",
    "TensorSpec",
    "TimelineEvent",
    "dry_run",
    "event_name",
    "host_read_stand_ins",
    "input_signature",
    "loop_signature",
    "make_estimator",
    "materialize",
    "memory_events",
    "memory_timeline",
    "peak_from_events",
    "model_inputs",
    "model_loss",
    "placeholder_message",
    "real_tensor",
    "routing_bound_bytes",
    "tensors_of",
    "unique_bytes",
]
