"""The fake-tensor dry run of one training step and the profile it produces."""

from lightning_sac.profiling.data import (
    CATEGORIES,
    PHASES,
    ModelProfile,
    ModuleOpStats,
    ModuleProfile,
    TimelineEvent,
)
from lightning_sac.profiling.dry_run import profile_model
from lightning_sac.profiling.render import render_profile

__all__ = [
    "CATEGORIES",
    "PHASES",
    "ModelProfile",
    "ModuleOpStats",
    "ModuleProfile",
    "TimelineEvent",
    "profile_model",
    "render_profile",
]
