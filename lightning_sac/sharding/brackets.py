"""Ops that parallelism runs inside a module's forward but that are not the module's compute.

FSDP's hooks (gathers, copy-out, casts) and a tensor-parallel style's hooks (views to and from ``DTensor``, a
row-parallel output's all-reduce) run inside a planned module's checkpoint. A plan decides op by op, by the op's
index in the module's call as profiled, so such ops must count neither in the profile nor at apply time. Both
sides run them between :func:`enter_parallel_hook` and :func:`exit_parallel_hook`: the apply stage around the
real hooks (:mod:`lightning_sac.apply.fsdp_hooks`), the dry run around its stand-ins for TP's collectives
(:mod:`lightning_sac.sharding.tensor_parallel`), whose memory it records but whose ops it does not number.
"""

from __future__ import annotations

from typing import Any

__all__ = ["enter_parallel_hook", "exit_parallel_hook", "in_parallel_hook"]

_DEPTH = [0]


def in_parallel_hook() -> bool:
    """Whether the ops running now are FSDP's or tensor parallelism's own, not the running module's compute."""
    return _DEPTH[0] > 0


def enter_parallel_hook(*_: Any) -> None:
    """Mark the start of parallelism's own ops (takes and ignores a hook's arguments)."""
    _DEPTH[0] += 1


def exit_parallel_hook(*_: Any) -> None:
    """Mark their end (takes and ignores a hook's arguments)."""
    _DEPTH[0] = max(_DEPTH[0] - 1, 0)
