"""A plan as text: one table, one legend, one summary, in one unit of memory.

Rules the rendering keeps, because a reader compares the numbers by eye:

- One way to state a peak: the device total the budget bounds, the step's tensors plus the reserve the budget keeps
  for the device (CUDA context, NCCL, cuBLAS workspaces, fragmentation), with the reserve named inside it:
  ``peak 11.960 GiB of 12.000 GiB budget (0.566 GiB CUDA reserve included); 17.350 GiB without a plan``.
- One unit per screen, chosen from the budget: GiB with 3 decimals from a budget of 1 GiB, else MiB
  (:func:`choose_unit`); the CLI's profile header uses the plan's unit too.
- A peak within the budget never prints above it: every figure is rounded to the same number of decimals, and
  rounding to nearest is monotone, so ``peak <= budget`` prints as ``peak <= budget``. A figure above the budget
  that would print equal to it gets more decimals (:func:`separating_unit`), on the whole screen.
- The summary says which figures include recompute and which sharding and world size they are for, since the
  profile's peak (one device, whole model) and the plan's (per device, sharded or not) differ.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from lightning_sac.plan.reserve import DeviceReserve

__all__ = [
    "LEGEND",
    "ByteUnit",
    "choose_unit",
    "device_peak",
    "plan_unit",
    "render_plan_table",
    "reserve_bytes",
    "reserve_note",
    "separating_unit",
]


class Plan(Protocol):
    """What the table reads of a :class:`~lightning_sac.plan.Plan` (which renders itself through this module)."""

    backend: str
    budget_bytes: int
    decisions: Any
    device: str
    kv_cache_off: bool
    predicted_overhead_ms: float
    predicted_peak_bytes: int
    predicted_recompute_ms: float
    predicted_step_ms: float
    replaces_checkpointing: list[str]
    reserve: dict[str, int]
    routing_bound_bytes: int
    routing_layers: int
    sharding: str
    solver_gap: float
    solver_seconds: float
    solver_status: str
    unconstrained_peak_bytes: int
    world_size: int

    @property
    def tensor_budget_bytes(self) -> int: ...  # noqa: D102


_GIB = 2**30
_MIB = 2**20
# Enough for any two byte counts of a GiB-scale figure to print apart (1e-10 GiB is a tenth of a byte).
_MAX_DECIMALS = 10

LEGEND = (
    "discard %: share of the module's saved activations dropped after its forward and recomputed in backward; "
    "freed: activation memory that frees per device; recompute ms: time each step spends recomputing it"
)
"""The one-line legend printed under the table."""


@dataclass(frozen=True)
class ByteUnit:
    """A unit of memory and the decimals every figure in it is printed with.

    Attributes:
        name: ``"GiB"`` or ``"MiB"``.
        size: Bytes per unit.
        decimals: Digits after the point.
    """

    name: str
    size: int
    decimals: int

    def value(self, nbytes: float) -> str:
        """``nbytes`` in this unit, without the unit's name: ``"0.331"``."""
        return f"{nbytes / self.size:.{self.decimals}f}"

    def __call__(self, nbytes: float) -> str:
        """``nbytes`` in this unit, with the unit's name: ``"0.331 GiB"``."""
        return f"{self.value(nbytes)} {self.name}"


def choose_unit(values: Iterable[float]) -> ByteUnit:
    """GiB with 3 decimals when any of ``values`` (bytes) reaches 1 GiB, else MiB with 1 to 3 decimals.

    MiB gets 1 decimal from 10 MiB, 2 from 1 MiB and 3 below, so that the largest figure keeps 3 digits.
    """
    largest = max(values, default=0)
    if largest >= _GIB:
        return ByteUnit("GiB", _GIB, 3)
    return ByteUnit("MiB", _MIB, 1 if largest >= 10 * _MIB else 2 if largest >= _MIB else 3)


def separating_unit(unit: ByteUnit, budget: float, values: Iterable[float]) -> ByteUnit:
    """``unit`` with enough decimals that each of ``values`` above ``budget`` prints above it too.

    Values at or below the budget need nothing: they are rounded like the budget, and rounding is monotone.
    """
    values = list(values)
    while unit.decimals < _MAX_DECIMALS and any(unit.value(v) == unit.value(budget) for v in values if v > budget):
        unit = replace(unit, decimals=unit.decimals + 1)
    return unit


def reserve_bytes(plan: Plan) -> int:
    """What the budget keeps for the device besides the step's tensors (:mod:`lightning_sac.plan.reserve`)."""
    return sum(plan.reserve.values())


def plan_unit(plan: Plan, extra: Iterable[float] = ()) -> ByteUnit:
    """The unit of a plan's rendering: chosen from its budget, with the decimals that keep its peaks apart from it.

    Every peak is printed as the device total the budget bounds (the tensors' peak plus the reserve), so the
    decimals separate those totals from the budget.

    Args:
        plan: The plan.
        extra: More tensor peaks (bytes, the reserve not included) printed in the same unit, e.g. a measured one.
    """
    reserve = reserve_bytes(plan)
    peaks = [plan.predicted_peak_bytes, plan.unconstrained_peak_bytes, *extra]
    return separating_unit(choose_unit([plan.budget_bytes]), plan.budget_bytes, [p + reserve for p in peaks])


def device_peak(plan: Plan, tensor_bytes: float, unit: ByteUnit) -> str:
    """A tensor peak as the device total the budget bounds: ``"11.960 GiB of 12.000 GiB budget"``.

    The reserve the total includes is named by :func:`reserve_note`.
    """
    return f"{unit(tensor_bytes + reserve_bytes(plan))} of {unit(plan.budget_bytes)} budget"


def reserve_note(plan: Plan, unit: ByteUnit) -> str:
    """``"0.566 GiB CUDA reserve included"``, or ``""`` for a plan without a reserve (a CPU target)."""
    reserve = reserve_bytes(plan)
    return f"{unit(reserve)} CUDA reserve included" if reserve else ""


def _placement(plan: Plan) -> str:
    if plan.sharding == "sharded":
        return (
            f"world size {plan.world_size}, sharded: parameters, gradients and optimizer state divided over "
            f"{plan.world_size} devices"
        )
    if plan.world_size > 1:
        return f"world size {plan.world_size}, replicated: each device holds all parameters, gradients, optimizer state"
    return "world size 1 (one device holding the whole model)"


def _summary(plan: Plan, unit: ByteUnit) -> list[str]:
    per_device = f"per device ({plan.sharding}, world size {plan.world_size})"
    reserve = reserve_bytes(plan)
    note = reserve_note(plan, unit)
    if plan.decisions:
        included = f"recompute included; {note}" if note else "recompute included"
        peak = (
            f"peak {per_device}: {device_peak(plan, plan.predicted_peak_bytes, unit)} with the plan ({included}); "
            f"{unit(plan.unconstrained_peak_bytes + reserve)} without a plan"
        )
    else:
        peak = f"peak {per_device}: {device_peak(plan, plan.predicted_peak_bytes, unit)}"
        peak += f" ({note})" if note else ""
        if plan.unconstrained_peak_bytes != plan.predicted_peak_bytes:
            peak += f"; {unit(plan.unconstrained_peak_bytes + reserve)} with the model's KV caches on"
    base_ms = plan.predicted_step_ms - plan.predicted_recompute_ms - plan.predicted_overhead_ms
    extra = f"{plan.predicted_recompute_ms:.3f} ms of recompute"
    if plan.predicted_overhead_ms:
        extra += f" and {plan.predicted_overhead_ms:.3f} ms of {plan.backend} backend overhead"
    step = f"step {plan.predicted_step_ms:.3f} ms"
    if plan.decisions:
        step += f" with the plan ({extra}), {base_ms:.3f} ms without"
    if plan.world_size > 1:
        step += " (compute of one device; communication is not modeled)"
    lines = [f"{plan.device}, {_placement(plan)}; plan for the {plan.backend} backend", peak, step]
    if plan.reserve:
        kept = DeviceReserve(**plan.reserve)
        lines.insert(
            2,
            f"the reserve: {unit(kept.total)} the device holds besides the step's tensors ({kept.describe()}); "
            f"the tensors get {unit(plan.tensor_budget_bytes)} of the budget",
        )
    if plan.kv_cache_off:
        lines.append("the plan runs the model without KV caches in training, as it was profiled")
    if plan.routing_layers:
        lines.append(
            f"{plan.routing_layers} mixture-of-experts layer call(s) planned on an even split of their top_k x tokens "
            "rows; an uneven routing in training adds "
            + (f"at most {unit(plan.routing_bound_bytes)}" if plan.routing_bound_bytes else "nothing")
            + " to the peak"
        )
    if plan.replaces_checkpointing:
        n = len(plan.replaces_checkpointing)
        lines.append(f"the plan replaces the model's own gradient checkpointing ({n} modules)")
    if plan.decisions:
        lines.append(
            f"solved in {plan.solver_seconds:.2f} s: {plan.solver_status}, gap {plan.solver_gap:.2%} "
            "(the least possible recompute is at most that much below this plan's)"
        )
    return lines


def render_plan_table(plan: Plan, unit: ByteUnit | None = None) -> str:
    """The plan as text: per-module table and its one-line legend (when a module is checkpointed), then the summary.

    Args:
        plan: The plan.
        unit: The unit of every memory figure; default :func:`plan_unit` of the plan.
    """
    unit = unit or plan_unit(plan)
    if not plan.decisions:
        return "\n".join(["no module needs checkpointing", *_summary(plan, unit)])
    names = {fqn: fqn or "<root>" for fqn in plan.decisions}
    freed = f"freed {unit.name}"
    width = max(len("module"), *map(len, names.values()))
    header = f"{'module':<{width}}  {'discard %':>9}  {freed:>10}  {'recompute ms':>12}"
    rule = "-" * len(header)
    lines = [header, rule]
    for fqn, d in plan.decisions.items():
        lines.append(
            f"{names[fqn]:<{width}}  {100 * d.discard_ratio:>9.1f}  {unit.value(d.freed_bytes):>10}  "
            f"{d.recompute_ms:>12.3f}"
        )
    lines += [rule, LEGEND, *_summary(plan, unit)]
    return "\n".join(lines)
