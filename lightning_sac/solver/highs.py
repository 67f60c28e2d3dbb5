"""A HiGHS instance configured the one way every solve here uses it: silent, seeded, bounded in time."""

from __future__ import annotations

import highspy

__all__ = ["new_highs"]


def new_highs(*, time_limit_s: float, mip_gap: float) -> highspy.Highs:
    """Return a silent HiGHS with a time limit, a relative MIP gap and a fixed seed (same input, same answer)."""
    h = highspy.Highs()
    h.silent()
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", float(mip_gap))
    h.setOptionValue("random_seed", 0)
    # One thread: the answer must not depend on how the machine schedules work.
    h.setOptionValue("threads", 1)
    return h
