"""The devices a plan is made for: their specs, the table of known GPUs, and this process's device.

Takes a name (``"H100-SXM"``, ``"auto"``) or a :class:`DeviceSpec`; gives the spec every later stage sizes memory
and time with: capacity, throughput, bandwidth, the allocator's rounding, what the CUDA context holds.
"""

from __future__ import annotations

from lightning_sac.devices.lookup import (
    DEVICE_SPECS,
    detect_device,
    device_family,
    device_mismatch_message,
    driver_name_entry,
    get_device_spec,
    known_devices,
    match_device,
    target_device_spec,
)
from lightning_sac.devices.names import DEVICE_ALIASES, DeviceMatch
from lightning_sac.devices.spec import DeviceSpec, UnknownDeviceError

__all__ = [
    "DEVICE_ALIASES",
    "DEVICE_SPECS",
    "DeviceMatch",
    "DeviceSpec",
    "UnknownDeviceError",
    "detect_device",
    "device_family",
    "device_mismatch_message",
    "driver_name_entry",
    "get_device_spec",
    "known_devices",
    "match_device",
    "target_device_spec",
]
