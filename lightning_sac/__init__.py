"""lightning-sac: fit training into a GPU memory budget with the least recomputation."""

from lightning_sac.apply import PlanHandle, apply_plan
from lightning_sac.callback import AutoSAC
from lightning_sac.devices import DeviceSpec, UnknownDeviceError, get_device_spec, known_devices
from lightning_sac.errors import BudgetError, LightningSACError, ProfilingError
from lightning_sac.plan import ModuleDecision, Plan
from lightning_sac.profiling import ModelProfile, ModuleOpStats, ModuleProfile, profile_model, render_profile
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
    "known_devices",
    "optimal_op_policy",
    "profile_model",
    "render_profile",
    "solve_plan",
]

__version__ = "0.1.0.dev0"
