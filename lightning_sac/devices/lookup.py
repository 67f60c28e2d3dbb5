"""The device table and lookups: :data:`DEVICE_SPECS`, :func:`get_device_spec` and :func:`detect_device`.

The table is built from the datasheets of :mod:`lightning_sac.devices.datasheets` (every GPU gets the CUDA/HIP
allocator's rounding, the measured CUDA context and cuBLAS's workspace), plus this host's CPU. Names are matched
by :mod:`lightning_sac.devices.names`, the matcher the command line uses too.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType

import torch

from lightning_sac.devices.datasheets import GPU_DATASHEETS
from lightning_sac.devices.names import DeviceMatch, match_device_name, mismatch_message, normalize
from lightning_sac.devices.spec import DeviceSpec, UnknownDeviceError
from lightning_sac.devices.table import (
    CPU_DRAM_GBPS,
    CPU_TFLOPS,
    CUDA_ALLOCATOR_ROUNDING,
    CUDA_CONTEXT_BYTES,
    DRIVER_NAME_PATTERNS,
    FALLBACK_CUDA_ENTRY,
    blas_workspace_bytes,
)

__all__ = [
    "DEVICE_SPECS",
    "detect_device",
    "device_family",
    "device_mismatch_message",
    "driver_name_entry",
    "get_device_spec",
    "known_devices",
    "match_device",
]


def _host_memory_gib() -> float:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        # os.sysconf is POSIX-only; a nominal 16 GiB keeps the table importable elsewhere.
        return 16.0
    return total / 2**30


def _build_table() -> dict[str, DeviceSpec]:
    # The figures and their sources are in datasheets.py; every GPU gets the CUDA/HIP allocator's rounding.
    table = {
        sheet.name: DeviceSpec(
            name=sheet.name,
            memory_gib=sheet.memory_gib,
            tflops=dict(sheet.tflops),
            dram_gbps=sheet.dram_gbps,
            allocator_rounding=CUDA_ALLOCATOR_ROUNDING,
            is_cuda=True,
            compute_capability=sheet.compute_capability,
            context_bytes=CUDA_CONTEXT_BYTES,
            blas_workspace_bytes=blas_workspace_bytes(sheet.compute_capability, amd_cdna3=sheet.amd_cdna3),
            nccl_bytes=sheet.nccl_bytes,
        )
        for sheet in GPU_DATASHEETS
    }
    # The profiler reports requested bytes on the CPU: no rounding.
    table["cpu"] = DeviceSpec(
        name="cpu",
        memory_gib=_host_memory_gib(),
        tflops=dict(CPU_TFLOPS),
        dram_gbps=CPU_DRAM_GBPS,
        allocator_rounding=1,
        is_cuda=False,
    )
    return table


DEVICE_SPECS: Mapping[str, DeviceSpec] = MappingProxyType(_build_table())
"""Canonical device name to its :class:`DeviceSpec`; read-only."""


_DRIVER_NAME_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), entry) for pattern, entry in DRIVER_NAME_PATTERNS
)


def match_device(name: str) -> DeviceMatch:
    """What ``name`` matches in :data:`DEVICE_SPECS` (:func:`lightning_sac.devices.names.match_device_name`)."""
    return match_device_name(name, DEVICE_SPECS)


def device_mismatch_message(match: DeviceMatch, *, cli: bool = False) -> str:
    """The one line for a name that resolved to no entry: the model's entries, a misspelling, or the table."""
    return mismatch_message(match, {n: s.memory_gib for n, s in DEVICE_SPECS.items()}, cli=cli)


def device_family(name: str) -> list[str]:
    """The table's devices whose names begin with ``name`` (ignoring case, ``-``, ``_`` and spaces), sorted.

    ``"H100"`` gives ``["H100-PCIe", "H100-SXM"]``. A prefix that stops inside a model number is another model's
    (``"A10"`` is no family of ``"A100-40GB"``), and a family is never resolved to one of its members, even a
    family of one (``"MI300"`` lists ``"MI300X"``): the user picks.
    """
    match = match_device(name)
    return list(match.candidates) if match.kind == "family" else []


def known_devices() -> list[str]:
    """Canonical names of all entries in :data:`DEVICE_SPECS`, sorted."""
    return sorted(DEVICE_SPECS)


def get_device_spec(device: str | DeviceSpec = "auto") -> DeviceSpec:
    """Resolve a device name (or spec) to a :class:`DeviceSpec`.

    Args:
        device: A :class:`DeviceSpec`, returned unchanged; ``"auto"`` for :func:`detect_device`; or a name
            from :func:`known_devices` or an alias of one (``"4090"``, ``"H100 SXM5"``), matched ignoring case,
            ``-``, ``_``, spaces and a leading vendor word (``"h100_sxm"`` and ``"NVIDIA H100 SXM"`` both give
            ``"H100-SXM"``).

    Returns:
        The matching spec.

    Raises:
        UnknownDeviceError: If the name resolves to no entry. A family (``"H100"``) or a model's other name
            (``"H100-80GB"``) lists that model's entries with their memory; a misspelling of one of them
            (``"H100-SMX"``) names it; no other GPU is ever suggested. The error's ``match`` says which.
        TypeError: If ``device`` is neither a string nor a :class:`DeviceSpec`.

    """
    if isinstance(device, DeviceSpec):
        return device
    if not isinstance(device, str):
        raise TypeError(f"device must be a str or DeviceSpec, got {type(device).__name__}.")
    if normalize(device) == "auto":
        return detect_device()
    match = match_device(device)
    if match.name is None:
        raise UnknownDeviceError(device_mismatch_message(match), match)
    return DEVICE_SPECS[match.name]


def target_device_spec(named: str | DeviceSpec | None, running_on: torch.device) -> DeviceSpec:
    """The device a plan is for: the one named, else the one training runs on (its real properties on CUDA)."""
    if named is not None:
        return get_device_spec(named)
    return get_device_spec("auto" if running_on.type == "cuda" else "cpu")


def driver_name_entry(name: str) -> str | None:
    """The table entry a driver-reported GPU name is matched to by ``DRIVER_NAME_PATTERNS``, or ``None``."""
    for pattern, entry in _DRIVER_NAME_PATTERNS:
        if pattern.search(name):
            return entry
    return None


def detect_device() -> DeviceSpec:
    """Describe the device this process would compute on.

    With CUDA (or ROCm/HIP) available, the result describes the current device: its driver-reported name
    and total memory, with throughput and bandwidth taken from the :data:`DEVICE_SPECS` entry the name
    matches (``"NVIDIA H100 80GB HBM3"`` gives H100-SXM figures, ``"NVIDIA A100-SXM4-40GB"`` A100-40GB ones).
    A GPU matching no entry gets the A100-40GB figures, whose compute-to-bandwidth ratio sits mid-table,
    and a warning suggesting an explicit :class:`DeviceSpec`. Without CUDA the ``"cpu"`` entry is returned.

    Returns:
        The spec of the current device.

    """
    if not torch.cuda.is_available():
        return DEVICE_SPECS["cpu"]
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    name = str(props.name)
    entry = driver_name_entry(name)
    if entry is None:
        entry = FALLBACK_CUDA_ENTRY
        warnings.warn(
            f"No device table entry matches CUDA device {name!r}; using {entry} throughput and bandwidth. "
            "Pass a DeviceSpec with this device's figures for accurate plans.",
            UserWarning,
            stacklevel=2,
        )
    # The driver's total memory beats the datasheet's: it is what allocations can actually use.
    capability = (int(props.major), int(props.minor)) if torch.version.hip is None else None
    cdna3 = capability is None and str(getattr(props, "gcnArchName", "")).startswith(("gfx94", "gfx95"))
    spec = DEVICE_SPECS[entry]
    return replace(
        spec,
        name=name,
        memory_gib=int(props.total_memory) / 2**30,
        compute_capability=capability,
        blas_workspace_bytes=blas_workspace_bytes(capability, amd_cdna3=cdna3),
    )
