"""The checkpointing plan: which modules to checkpoint, which of their ops to save, and what it predicts."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from lightning_sac.plan.table import ByteUnit, render_plan_table

__all__ = [
    "BACKENDS",
    "check_backend",
    "ModuleDecision",
    "Plan",
]

#: How a plan can be applied (:func:`~lightning_sac.apply_plan`): torch's selective checkpointing, or the graph
#: backend. The plan records the one its predicted recompute is for.
BACKENDS: tuple[str, ...] = ("sac", "graph")


def check_backend(backend: str) -> None:
    """Raise a ``ValueError`` naming the choices when ``backend`` is not one of :data:`BACKENDS`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")


_GIB = 2**30


@dataclass(kw_only=True)
class ModuleDecision:
    """How one module is checkpointed.

    Attributes:
        discard_ratio: Fraction of the module's op memory the solver chose to discard, in ``[0, 1]``.
        op_policy: One decision per op of the module's ``ModuleOpStats``: 1 = save, 0 = recompute.
        recompute_ms: Runtime of the ops one backward reruns under the policy on the plan's backend, ms
            (:func:`lightning_sac.solver.recompute.recompute_ms`).
        freed_bytes: Activation bytes the policy frees between the module's forward and its backward.
        overhead_ms: What wrapping the module adds to the step besides ``recompute_ms``, ms (0 unless the
            profile measured it: :attr:`ModuleProfile.measured_overhead`, else the per-op figures of
            :attr:`ModelProfile.backend_overhead_us`; see :func:`lightning_sac.solver.recompute.overhead_ms`).
        op_names: The op each entry of ``op_policy`` is for (``"aten.mm.default"``...), in order, so that a
            policy applied at run time can tell when the module runs other ops than the profiled ones.
        skipped_ops: Indices of recomputed ops the SAC backend's recompute skips because nothing needs their
            values (:func:`lightning_sac.solver.recompute.skipped_ops`); not counted in ``recompute_ms``.
        masked_ops: Indices of random ops (dropout's ``bernoulli_``) whose result the SAC backend keeps as a
            ``bool`` mask and copies back in recompute instead of drawing again (:mod:`lightning_sac.solver.masks`);
            ``op_policy`` recomputes them. Empty in an older plan: nothing is masked.
    """

    discard_ratio: float
    op_policy: list[int]
    recompute_ms: float
    freed_bytes: int
    op_names: list[str] = field(default_factory=list)
    overhead_ms: float = 0.0
    skipped_ops: list[int] = field(default_factory=list)
    masked_ops: list[int] = field(default_factory=list)


@dataclass(kw_only=True)
class Plan:
    """A checkpointing plan for one model, batch shape, target and budget.

    Attributes:
        decisions: Per checkpointed module fqn, its decision; empty when nothing needs checkpointing.
        budget_bytes: The memory budget per device, bytes.
        world_size: Number of devices the training step runs on.
        sharding: ``"replicated"`` (DDP: whole parameters, gradients and optimizer state on each device) or
            ``"sharded"`` (FSDP: those divided by ``world_size``).
        device: Name of the target device.
        backend: The backend the plan's recompute is predicted for, and :func:`~lightning_sac.apply_plan`'s
            default: ``"sac"`` or ``"graph"``.
        predicted_peak_bytes: Peak of the step on one device with the plan, bytes.
        unconstrained_peak_bytes: Peak without any checkpointing, bytes.
        predicted_recompute_ms: Total recompute the plan adds to each step, ms.
        predicted_overhead_ms: Total the backend adds to each step besides recompute, ms.
        predicted_step_ms: Estimated step time with the plan, ms: the profile's, recompute and overhead.
        solver_status: HiGHS's model status (``"Optimal"``, or ``"Not needed"`` when the budget is slack).
        solver_gap: Relative MIP gap of the solution.
        solver_seconds: Wall time of the solve, including trade-off fits and op policies.
        fingerprint: Hash of the model structure and input shapes the plan was made for, and of the training
            loop where it is not a plain step (gradient accumulation, manual optimization).
        replaces_checkpointing: Modules whose Hugging Face ``gradient_checkpointing`` flag the plan turns off
            when applied: it replaces the model's own checkpointing (profiled with ``replace_existing=True``).
        kv_cache_off: The profile ran the model's modules without KV caches in training (see
            :mod:`lightning_sac.adapters.caches`), so the applied plan does too, model-wide, to run what was profiled.
        reserve: What the budget keeps for memory that is not the step's tensors on a CUDA target (CUDA context,
            NCCL buffers, cuBLAS workspaces, allocator fragmentation), bytes by
            :class:`~lightning_sac.plan.reserve.DeviceReserve` field; empty for the CPU. The predicted peak is
            the tensors' and stays within ``budget_bytes`` minus all of it.
        routing_layers: Mixture-of-experts experts calls the profile routed on an even split of their ``top_k x
            tokens`` rows (:mod:`lightning_sac.dryrun.values.moe_routing`); 0 for a model without them.
        routing_bound_bytes: The most an uneven routing in training can add to ``predicted_peak_bytes`` (every
            token sent to the experts whose ops the plan keeps); 0 when the plan's memory does not depend on it.
    """

    decisions: dict[str, ModuleDecision] = field(default_factory=dict)
    budget_bytes: int
    world_size: int = 1
    sharding: str = "replicated"
    device: str = ""
    backend: str = "sac"
    predicted_peak_bytes: int = 0
    unconstrained_peak_bytes: int = 0
    predicted_recompute_ms: float = 0.0
    predicted_overhead_ms: float = 0.0
    predicted_step_ms: float = 0.0
    solver_status: str = ""
    solver_gap: float = 0.0
    solver_seconds: float = 0.0
    fingerprint: str = ""
    replaces_checkpointing: list[str] = field(default_factory=list)
    kv_cache_off: bool = False
    reserve: dict[str, int] = field(default_factory=dict)
    routing_layers: int = 0
    routing_bound_bytes: int = 0

    @property
    def budget_gb(self) -> float:
        """The budget in GiB."""
        return self.budget_bytes / _GIB

    @property
    def tensor_budget_bytes(self) -> int:
        """What the step's tensors may take: the budget less the whole reserve."""
        return self.budget_bytes - sum(self.reserve.values())

    @property
    def allocated_budget_bytes(self) -> int:
        """What ``torch.cuda.max_memory_allocated()`` may reach: the budget less the reserve outside it."""
        return self.tensor_budget_bytes + self.reserve.get("blas_workspace_bytes", 0)

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-safe dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """Rebuild from :meth:`to_dict` output."""
        d = dict(d)
        d["decisions"] = {k: ModuleDecision(**v) for k, v in d["decisions"].items()}
        return cls(**d)

    def to_json(self, indent: int | None = None) -> str:
        """Serialize to JSON; :meth:`from_json` gives back an equal plan."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Parse :meth:`to_json` output."""
        return cls.from_dict(json.loads(text))

    def table(self, unit: ByteUnit | None = None) -> str:
        """A readable table (fqn, discard %, freed memory, recompute ms per module), its legend and a summary.

        Args:
            unit: The unit of memory figures; default GiB or MiB by their size (see :mod:`lightning_sac.plan.table`).
        """
        return render_plan_table(self, unit)
