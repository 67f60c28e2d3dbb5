"""Checkpoint policies of graph-based AC regions: what a policy is asked, and how nested policies' answers combine.

Policies compose: the regions' policy functions are asked outermost to innermost, starting from
``PREFER_SAVE``; a ``MUST_*`` answer overrides ``PREFER_*`` ones, two different ``MUST_*`` answers are an
error, and a policy may answer with a bool (``True`` = ``MUST_SAVE``, ``False`` = ``PREFER_RECOMPUTE``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.utils.checkpoint import CheckpointPolicy

__all__ = ["POLICY_SHORTCUTS", "SAVE_DECISIONS", "PolicyContext", "PolicyFn", "compose_policies"]


@dataclass(frozen=True)
class PolicyContext:
    """What a policy knows besides the op: its index among the region's ops (ops SAC ignores not counted)."""

    op_index: int
    is_recompute: bool = False


PolicyFn = Callable[..., "CheckpointPolicy | bool"]

_MUST = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_RECOMPUTE)
#: The decisions that keep an op's outputs.
SAVE_DECISIONS = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


def compose_policies(answers: list[CheckpointPolicy | bool]) -> CheckpointPolicy:
    """Combine the answers of nested policies, outermost first, as the module docstring says."""
    result = CheckpointPolicy.PREFER_SAVE
    for answer in answers:
        if isinstance(answer, bool):
            answer = CheckpointPolicy.MUST_SAVE if answer else CheckpointPolicy.PREFER_RECOMPUTE
        if answer in _MUST:
            if result in _MUST and result != answer:
                raise RuntimeError(f"Nested graph_ac policies disagree: {result.name} and {answer.name} for one op.")
            result = answer
        elif result not in _MUST:
            result = answer
    return result


def _recompute_all(ctx: PolicyContext, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _must_save_all(ctx: PolicyContext, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE


#: Policies named by a string in :func:`~lightning_sac.apply.graph.backend.save_recompute_policy`.
POLICY_SHORTCUTS: dict[str, PolicyFn] = {"recompute_all": _recompute_all, "must_save_all": _must_save_all}
