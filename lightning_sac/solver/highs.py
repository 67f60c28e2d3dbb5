"""A HiGHS instance configured the one way every solve here uses it: silent, seeded, bounded in time."""

from __future__ import annotations

import re

import highspy
import numpy as np

from lightning_sac.dryrun import filtered_native_output

__all__ = ["IntegerStart", "integer_start", "new_highs"]

# HiGHS prints its banner from C++ to descriptor 1 when the process makes its first instance, before any option
# can silence it: "Running HiGHS 1.16.0 (git hash: ...): Copyright (c) ..." and "Includes third-party software ...".
_BANNER = re.compile(r"^(Running HiGHS \d|Includes third-party software components)")


def new_highs(*, time_limit_s: float, mip_gap: float) -> highspy.Highs:
    """Return a silent HiGHS with a time limit, a relative MIP gap and a fixed seed (same input, same answer)."""
    with filtered_native_output(1, lambda line: _BANNER.match(line) is not None, flush_c_stdio=True):
        h = highspy.Highs()
    h.silent()
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", float(mip_gap))
    h.setOptionValue("random_seed", 0)
    # One thread: the answer must not depend on how the machine schedules work.
    h.setOptionValue("threads", 1)
    return h


#: The integer columns of a solution, ``(indices, values)``: a start for a MILP with the same integer columns.
IntegerStart = tuple[np.ndarray, np.ndarray]


def integer_start(h: highspy.Highs) -> IntegerStart:
    """The integer columns of ``h``'s solution, to start another solve of a MILP that shares them.

    Given them (``h.setSolution(len(indices), indices, values)``), HiGHS completes the continuous columns with those
    integers fixed, and starts from that plan when it is feasible: when a MILP is solved again with a lower memory
    limit or another fragmentation estimate, it needs a fraction of the nodes and cuts it would need from nothing.
    """
    kinds = np.asarray([int(k) for k in h.getLp().integrality_], dtype=np.int32)
    indices = np.flatnonzero(kinds).astype(np.int32)
    values = np.round(np.asarray(h.getSolution().col_value, dtype=np.float64)[indices])
    return indices, values
