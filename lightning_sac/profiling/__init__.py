"""``profile_model`` and ``profile_step``: the dry run of a training step, calibrated on this host.

Takes what :mod:`lightning_sac.dryrun` takes; gives its profile, with what applying a plan costs here measured when
the step is timed here (``estimate="benchmark"``). It runs the appliers, so it sits above them.
"""

from __future__ import annotations

from lightning_sac.profiling.profile import profile_model, profile_step

__all__ = [
    "profile_model",
    "profile_step",
]
