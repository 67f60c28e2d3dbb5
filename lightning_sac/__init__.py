"""lightning-sac: fit training into a GPU memory budget with the least recomputation."""

from lightning_sac.devices import DeviceSpec, UnknownDeviceError, get_device_spec, known_devices
from lightning_sac.errors import LightningSACError, ProfilingError
from lightning_sac.profiling import ModelProfile, ModuleOpStats, ModuleProfile, profile_model, render_profile

__all__ = [
    "DeviceSpec",
    "LightningSACError",
    "ModelProfile",
    "ModuleOpStats",
    "ModuleProfile",
    "ProfilingError",
    "UnknownDeviceError",
    "get_device_spec",
    "known_devices",
    "profile_model",
    "render_profile",
]

__version__ = "0.1.0.dev0"
