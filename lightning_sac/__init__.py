"""lightning-sac: fit training into a GPU memory budget with the least recomputation."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_sac.apply import PlanHandle, apply_plan
    from lightning_sac.devices import DeviceSpec, UnknownDeviceError, get_device_spec, known_devices
    from lightning_sac.dryrun import ModelProfile, ModuleOpStats, ModuleProfile, host_read_stand_ins
    from lightning_sac.errors import BudgetError, LightningSACError, ProfilingError
    from lightning_sac.lightning import AutoSAC
    from lightning_sac.plan import ModuleDecision, Plan
    from lightning_sac.profiling import profile_model, profile_step
    from lightning_sac.report import render_profile
    from lightning_sac.solver import greedy_op_policy, optimal_op_policy, solve_plan

__all__ = [
    "AutoSAC",
    "BudgetError",
    "DeviceSpec",
    "LightningSACError",
    "ModelProfile",
    "ModuleDecision",
    "ModuleOpStats",
    "ModuleProfile",
    "Plan",
    "PlanHandle",
    "ProfilingError",
    "UnknownDeviceError",
    "apply_plan",
    "get_device_spec",
    "greedy_op_policy",
    "host_read_stand_ins",
    "known_devices",
    "optimal_op_policy",
    "profile_model",
    "profile_step",
    "render_profile",
    "solve_plan",
]

__version__ = "0.1.0.dev0"

# Each public name is imported on first use (PEP 562): `import lightning_sac` and the `lightning-sac` command
# then load only what they use. Lightning (and with it torchmetrics, transformers and scipy, seconds of imports)
# is loaded only by the callback.
_SOURCES = {
    "AutoSAC": "lightning_sac.lightning",
    "BudgetError": "lightning_sac.errors",
    "DeviceSpec": "lightning_sac.devices",
    "LightningSACError": "lightning_sac.errors",
    "ModelProfile": "lightning_sac.dryrun",
    "ModuleDecision": "lightning_sac.plan",
    "ModuleOpStats": "lightning_sac.dryrun",
    "ModuleProfile": "lightning_sac.dryrun",
    "Plan": "lightning_sac.plan",
    "PlanHandle": "lightning_sac.apply",
    "ProfilingError": "lightning_sac.errors",
    "UnknownDeviceError": "lightning_sac.devices",
    "apply_plan": "lightning_sac.apply",
    "get_device_spec": "lightning_sac.devices",
    "greedy_op_policy": "lightning_sac.solver",
    "host_read_stand_ins": "lightning_sac.dryrun",
    "known_devices": "lightning_sac.devices",
    "optimal_op_policy": "lightning_sac.solver",
    "profile_model": "lightning_sac.profiling",
    "profile_step": "lightning_sac.profiling",
    "render_profile": "lightning_sac.report",
    "solve_plan": "lightning_sac.solver",
}


def __getattr__(name: str) -> Any:
    if name not in _SOURCES:
        raise AttributeError(f"module 'lightning_sac' has no attribute {name!r}")
    value = getattr(importlib.import_module(_SOURCES[name]), name)
    globals()[name] = value  # later look-ups do not come here again
    return value


def __dir__() -> list[str]:
    return sorted(__all__)  # the public API; stages are reached as lightning_sac.<stage>
