"""The plan: which modules to checkpoint and what each keeps, with the budget it was made for and its table.

Takes the solver's decisions; gives the :class:`Plan` the appliers apply, the callback logs and the CLI saves
(JSON), and the reserve a device holds besides the tensors (:func:`device_reserve`), its fragmentation replayed.
"""

from __future__ import annotations

from lightning_sac.plan.decisions import BACKENDS, ModuleDecision, Plan, check_backend
from lightning_sac.plan.fragmentation import StepFragmentation, planned_trace
from lightning_sac.plan.reserve import DeviceReserve, device_reserve
from lightning_sac.plan.table import (
    ByteUnit,
    choose_unit,
    device_peak,
    plan_unit,
    render_plan_table,
    reserve_bytes,
    reserve_note,
    separating_unit,
)

__all__ = [
    "BACKENDS",
    "check_backend",
    "ByteUnit",
    "DeviceReserve",
    "ModuleDecision",
    "Plan",
    "StepFragmentation",
    "choose_unit",
    "device_peak",
    "device_reserve",
    "plan_unit",
    "planned_trace",
    "render_plan_table",
    "reserve_bytes",
    "reserve_note",
    "separating_unit",
]
