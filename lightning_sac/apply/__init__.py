"""``apply_plan``: make a model checkpoint the way a :class:`~lightning_sac.plan.Plan` says, reversibly.

Takes a model and a plan; gives a :class:`PlanHandle` whose wrappers run each planned module under the SAC backend
(``torch.utils.checkpoint`` with a selective policy) or the graph backend (:mod:`lightning_sac.apply.graph`), and
whose ``remove()`` gives the model back exactly as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_sac.adapters import CacheCall, CacheSwitch, traced_module
from lightning_sac.apply.compiled_trace import CompiledStepMemory, compiled_step_memory
from lightning_sac.apply.fsdp_hooks import bracket_fsdp_units
from lightning_sac.apply.planned import Notices
from lightning_sac.apply.sac import SelectiveCheckpointForward, runs_whole, whole_checkpoints
from lightning_sac.plan import check_backend
from lightning_sac.sharding import clean_fqn, is_sharded, tensor_parallel_modules

if TYPE_CHECKING:
    from lightning_sac.plan import Plan


__all__ = [
    "CompiledStepMemory",
    "PlanHandle",
    "apply_plan",
    "compiled_step_memory",
    "runs_whole",
    "whole_checkpoints",
]


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
    _flags_off: list[nn.Module] = field(default_factory=list, repr=False)
    _caches: CacheSwitch | None = field(default=None, repr=False)
    _hooks: list[RemovableHandle] = field(default_factory=list, repr=False)

    def remove(self) -> None:
        """Restore every wrapped module's own forward, the checkpointing flags the plan turned off, and caches."""
        for fqn, module in self._modules.items():
            if module.__dict__.get("forward") is self.wrappers[fqn]:
                del module.forward
        self._modules.clear()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for module in self._flags_off:
            module.__dict__["gradient_checkpointing"] = True
        self._flags_off.clear()
        if self._caches is not None:
            self._caches.__exit__(None, None, None)
            self._caches = None

    def __enter__(self) -> PlanHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _said_caches_off(notices: Notices, fqn: str, call: CacheCall) -> None:
    notices.warn(
        "kv-cache",
        f"lightning-sac: while the plan is applied the model trains with use_cache=False and without KV caches "
        f"(module {fqn or '<root>'!r} was called with {' and '.join(call.switched_off)} on), as Hugging Face's "
        "gradient checkpointing does: recomputing a layer would update its cache a second time, and the plan was "
        "profiled so. The loss is the same; the model returns no cache in training. Set "
        f"{'.'.join(['model', *fqn.split('.')]) if fqn else 'model'}.config.use_cache = False to silence this "
        "(a submodule's config can be a copy of the model's). (Warned once.)",
    )


def apply_plan(model: nn.Module, plan: Plan, *, backend: str | None = None) -> PlanHandle:
    """Checkpoint ``model``'s planned modules with the plan's per-op decisions; ``handle.remove()`` restores it.

    Each planned module's ``forward`` is wrapped in place, so parameters, module names and ``state_dict`` keys
    do not change. A plan that replaces the model's own Hugging Face checkpointing
    (:attr:`Plan.replaces_checkpointing`) turns those ``gradient_checkpointing`` flags off; ``remove()`` turns
    them back on. A plan profiled without KV caches (:attr:`Plan.kv_cache_off`) runs the model without them in
    training, as profiled and as Hugging Face's own checkpointing does (:mod:`lightning_sac.adapters.caches`), and says
    so
    once; ``remove()`` ends that too.

    A compiled model (``torch.compile(model)``, ``model.compile()``, or a compiled LightningModule) can have the
    plan applied before or after compiling: each wrapper then runs inside the compiled graph, as a checkpoint
    whose per-op decisions AOT autograd applies to the graph (:mod:`lightning_sac.apply.traced`); a planned
    module that is an ``OptimizedModule`` has the plan applied to its ``_orig_mod``. Both backends compile the
    same way: the partitioner recomputes only what backward needs, as the graph backend does in eager mode.

    Apply the plan to the bare model *before* wrapping it with ``DistributedDataParallel`` or
    sharding it with FSDP2's ``fully_shard`` (the order torchtitan uses): the wrappers then run inside DDP's
    and FSDP's hooks, and FSDP re-gathers parameters for the recompute in backward as it does for backward.

    Args:
        model: The model the plan was made for.
        plan: The plan.
        backend: ``"sac"`` (``torch.utils.checkpoint`` with selective policies) or ``"graph"``
            (:mod:`lightning_sac.apply.graph`, graph-based recomputation); default the plan's ``backend``, the one
            its predicted recompute is for. Another one frees the same memory at another recompute cost.

    Raises:
        ValueError: Unknown backend, or a planned module the model does not have.
        RuntimeError: A planned module's forward is already wrapped (the plan is applied already).
    """
    backend = plan.backend if backend is None else backend
    check_backend(backend)
    # Plans name modules as in the unsharded model: FSDP1's wrapper segments are not in their fqns, and a planned
    # FSDP1 unit is checkpointed inside its wrapper (the module it wraps), as FSDP gathers before it runs.
    modules = {clean_fqn(name): m for name, m in model.named_modules()}
    missing = [fqn for fqn in [*plan.decisions, *plan.replaces_checkpointing] if fqn not in modules]
    if missing:
        raise ValueError(
            f"The plan checkpoints modules this model does not have: {missing}. Was it made for another model "
            f"(plan fingerprint {plan.fingerprint})? Re-plan for this model."
        )
    # A compiled module's plan goes on the module compile traces, so that its checkpoint is in the graph.
    planned = {fqn: traced_module(modules[fqn]) for fqn in plan.decisions}
    for fqn in plan.decisions:
        if "forward" in planned[fqn].__dict__:
            raise RuntimeError(
                f"Module {fqn!r} already has its forward replaced (is a plan applied already?). "
                "Call handle.remove() on the previous plan first."
            )
    handle = PlanHandle(plan=plan, backend=backend)
    try:
        for fqn in plan.replaces_checkpointing:
            if getattr(modules[fqn], "gradient_checkpointing", None) is True:
                modules[fqn].__dict__["gradient_checkpointing"] = False
                handle._flags_off.append(modules[fqn])
        notices = Notices()
        if plan.kv_cache_off:
            handle._caches = CacheSwitch(model, lambda fqn, call: _said_caches_off(notices, fqn, call)).__enter__()
        for fqn, decision in plan.decisions.items():
            module = planned[fqn]
            if backend != "sac" and any(is_sharded(child) for child in module.children()):
                raise ValueError(
                    f"Module {fqn!r} contains FSDP units; the {backend!r} backend cannot checkpoint across FSDP's "
                    "gathers. Use backend='sac' (the default)."
                )
            if backend != "sac" and tensor_parallel_modules(module):
                raise ValueError(
                    f"Module {fqn!r} contains tensor-parallel modules; the {backend!r} backend does not keep their "
                    "collectives out of its recompute. Use backend='sac' (the default)."
                )
            handle._hooks += bracket_fsdp_units(module)
            if backend == "sac":
                wrapper: Any = SelectiveCheckpointForward(module, fqn, decision, notices)
            else:
                from lightning_sac.apply.graph.backend import GraphCheckpointForward

                wrapper = GraphCheckpointForward(module, fqn, decision, notices)
            module.__dict__["forward"] = wrapper
            handle.wrappers[fqn] = wrapper
            handle._modules[fqn] = module
    except BaseException:
        handle.remove()  # a refused plan leaves the model as it was: no module half wrapped
        raise
    return handle
