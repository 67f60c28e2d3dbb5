"""``apply_plan``: make a model checkpoint the way a :class:`~lightning_sac.plan.Plan` says, reversibly."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_sac.apply.sac import SelectiveCheckpointForward
from lightning_sac.plan import Plan
from lightning_sac.recompute import check_backend

__all__ = ["PlanHandle", "apply_plan"]


@dataclass
class PlanHandle:
    """What :func:`apply_plan` did; :meth:`remove` undoes it.

    Attributes:
        plan: The applied plan.
        backend: ``"sac"`` or ``"graph"``.
        wrappers: Per module fqn, the forward wrapper installed on it (its ``calls`` and ``mismatched_calls``
            say how often the plan ran and how often it could not be applied, ``last_mismatch`` what differed).
    """

    plan: Plan
    backend: str
    wrappers: dict[str, Any] = field(default_factory=dict)
    _modules: dict[str, nn.Module] = field(default_factory=dict, repr=False)

    def remove(self) -> None:
        """Restore every wrapped module's own forward. Safe to call twice."""
        for fqn, module in self._modules.items():
            if module.__dict__.get("forward") is self.wrappers[fqn]:
                del module.forward
        self._modules.clear()

    def __enter__(self) -> PlanHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def apply_plan(model: nn.Module, plan: Plan, *, backend: str | None = None) -> PlanHandle:
    """Checkpoint ``model``'s planned modules with the plan's per-op decisions; ``handle.remove()`` restores it.

    Each planned module's ``forward`` is wrapped in place, so parameters, module names and ``state_dict`` keys
    do not change. Apply the plan to the bare model *before* wrapping it with ``DistributedDataParallel`` or
    sharding it with FSDP2's ``fully_shard`` (the order torchtitan uses): the wrappers then run inside DDP's
    and FSDP's hooks, and FSDP re-gathers parameters for the recompute in backward as it does for backward.

    Args:
        model: The model the plan was made for.
        plan: The plan.
        backend: ``"sac"`` (``torch.utils.checkpoint`` with selective policies) or ``"graph"``
            (:mod:`lightning_sac.graph_ac`, graph-based recomputation); default the plan's ``backend``, the one
            its predicted recompute is for. Another one frees the same memory at another recompute cost.

    Raises:
        ValueError: Unknown backend, or a planned module the model does not have.
        RuntimeError: A planned module's forward is already wrapped (the plan is applied already).
    """
    backend = plan.backend if backend is None else backend
    check_backend(backend)
    modules = dict(model.named_modules())
    missing = [fqn for fqn in plan.decisions if fqn not in modules]
    if missing:
        raise ValueError(
            f"The plan checkpoints modules this model does not have: {missing}. Was it made for another model "
            f"(plan fingerprint {plan.fingerprint})? Re-plan for this model."
        )
    for fqn in plan.decisions:
        if "forward" in modules[fqn].__dict__:
            raise RuntimeError(
                f"Module {fqn!r} already has its forward replaced (is a plan applied already?). "
                "Call handle.remove() on the previous plan first."
            )
    handle = PlanHandle(plan=plan, backend=backend)
    for fqn, decision in plan.decisions.items():
        module = modules[fqn]
        if backend == "sac":
            wrapper: Any = SelectiveCheckpointForward(module, fqn, decision)
        else:
            from lightning_sac.graph_ac import GraphCheckpointForward

            wrapper = GraphCheckpointForward(module, fqn, decision)
        module.__dict__["forward"] = wrapper
        handle.wrappers[fqn] = wrapper
        handle._modules[fqn] = module
    return handle
