"""Hardware descriptions the planner reasons about: memory capacity, peak throughput and bandwidth.

A :class:`DeviceSpec` says how much memory a device has, how fast it multiplies in each dtype, how fast it
moves bytes, and how its allocator rounds requests. :data:`DEVICE_SPECS` holds datasheet figures for common
training and inference parts; :func:`get_device_spec` looks one up by a forgiving name, and
:func:`detect_device` describes the device this process would run on.

All throughput figures are *dense* peaks. NVIDIA datasheets headline the 2:4 structured-sparsity numbers,
which are twice the dense ones and which ordinary training never reaches, so those are halved here.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any

import torch

__all__ = [
    "DEVICE_SPECS",
    "DeviceSpec",
    "UnknownDeviceError",
    "detect_device",
    "get_device_spec",
    "known_devices",
]

# Throughput keys a DeviceSpec may carry, one per arithmetic the hardware rates separately.
_TFLOPS_KEYS = frozenset({"fp64", "fp32", "tf32", "bf16", "fp16", "fp8"})

# NVIDIA parts whose datasheets omit FP64 (GA10x, AD10x) run it at 1/64 of the FP32 rate.
_FP64_FALLBACK_RATIO = 64.0

# The CUDA and HIP caching allocators round every block up to a multiple of 512 bytes.
_CUDA_ALLOCATOR_ROUNDING = 512

# Used for a CUDA device whose name matches no table entry; see detect_device().
_FALLBACK_CUDA_ENTRY = "A100-40GB"

# Collected by name so that float8/float4 variants added by newer torch releases are covered without a
# version check, and ones missing from older releases (torch>=2.6 is supported) are simply absent.
_FP8_DTYPES = frozenset(
    value
    for attr, value in vars(torch).items()
    if attr.startswith(("float8_", "float4_")) and isinstance(value, torch.dtype)
)


class UnknownDeviceError(ValueError):
    """Raised when a device name matches no entry of :data:`DEVICE_SPECS`."""


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """Capacity and speed of one accelerator (or the host CPU).

    Attributes:
        name: Human-readable name, e.g. ``"H100-SXM"`` or the name the driver reports.
        memory_gib: Device memory in GiB (``2**30`` bytes).
        tflops: Dense peak TFLOP/s per arithmetic, keyed by ``"fp64"``, ``"fp32"``, ``"tf32"``, ``"bf16"``,
            ``"fp16"`` and ``"fp8"``; only the ones the device supports. ``"fp32"`` is required because it
            is the fallback for every other dtype. Stored as a read-only mapping.
        dram_gbps: DRAM bandwidth in GB/s (``1e9`` bytes per second).
        allocator_rounding: Bytes each allocation is rounded up to: 512 for the CUDA/HIP caching allocator,
            1 for ``"cpu"`` (the profiler reports requested bytes there).
        is_cuda: Whether torch addresses the device as ``"cuda"``, which is true for NVIDIA and for AMD
            under ROCm/HIP.

    """

    name: str
    memory_gib: float
    # Excluded from the hash because mappings are unhashable; equality still compares it.
    tflops: Mapping[str, float] = field(hash=False)
    dram_gbps: float
    allocator_rounding: int
    is_cuda: bool

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("DeviceSpec.name must be a non-empty string.")
        _require_positive("memory_gib", self.memory_gib)
        _require_positive("dram_gbps", self.dram_gbps)
        if isinstance(self.allocator_rounding, bool) or not isinstance(self.allocator_rounding, int):
            raise TypeError(f"allocator_rounding must be an int, got {self.allocator_rounding!r}.")
        if self.allocator_rounding < 1:
            raise ValueError(f"allocator_rounding must be at least 1, got {self.allocator_rounding}.")
        unknown = set(self.tflops) - _TFLOPS_KEYS
        if unknown:
            raise ValueError(f"Unknown tflops keys {sorted(unknown)}; allowed keys are {sorted(_TFLOPS_KEYS)}.")
        if "fp32" not in self.tflops:
            raise ValueError("tflops must contain an 'fp32' figure; it is the fallback for other dtypes.")
        for key, value in self.tflops.items():
            _require_positive(f"tflops[{key!r}]", value)
        # Normalize numbers to float (JSON may hand back 80 for 80.0) and freeze the mapping so that entries
        # shared through DEVICE_SPECS cannot be edited by one caller behind another's back.
        object.__setattr__(self, "memory_gib", float(self.memory_gib))
        object.__setattr__(self, "dram_gbps", float(self.dram_gbps))
        object.__setattr__(self, "is_cuda", bool(self.is_cuda))
        frozen = {key: float(self.tflops[key]) for key in sorted(self.tflops)}
        object.__setattr__(self, "tflops", MappingProxyType(frozen))

    @property
    def memory_bytes(self) -> int:
        """Device memory in bytes."""
        return int(self.memory_gib * 2**30)

    def peak_tflops(self, dtype: torch.dtype, *, tf32: bool = False) -> float:
        """Dense peak TFLOP/s for arithmetic in ``dtype``.

        Mapping from dtype to figure:

        * ``float32``: the ``"tf32"`` figure when ``tf32`` is true and the device has tensor-core TF32,
          otherwise ``"fp32"``. Pass ``tf32=torch.backends.cuda.matmul.allow_tf32`` to mirror torch.
        * ``float64``: ``"fp64"``; without one, ``fp32 / 64``, the FP64 rate of the NVIDIA parts whose
          datasheets omit it.
        * ``bfloat16`` / ``float16``: ``"bf16"`` / ``"fp16"``.
        * float8 and float4 dtypes: ``"fp8"`` (there is no separate FP4 figure, so FP4 gets the FP8 one,
          a conservative stand-in).
        * complex dtypes: the figure of their real component dtype.
        * integer, bool and quantized dtypes: ``"fp32"``. Such tensors are indices, masks and counters whose
          ops are bandwidth-bound, so their flop rate hardly matters and FP32 is a neutral choice.

        Any figure the device lacks (e.g. bf16 on V100, fp8 before Hopper/Ada) falls back to ``"fp32"``,
        because on such hardware torch emulates or upcasts those dtypes on the FP32 units.

        Args:
            dtype: The dtype the arithmetic runs in.
            tf32: Whether float32 matmuls may use TF32 tensor cores.

        Returns:
            Peak throughput in TFLOP/s.

        """
        if dtype.is_complex:
            return self.peak_tflops(dtype.to_real(), tf32=tf32)
        fp32 = self.tflops["fp32"]
        if dtype == torch.float32:
            return self.tflops["tf32"] if tf32 and "tf32" in self.tflops else fp32
        if dtype == torch.float64:
            return self.tflops.get("fp64", fp32 / _FP64_FALLBACK_RATIO)
        if dtype == torch.bfloat16:
            return self.tflops.get("bf16", fp32)
        if dtype == torch.float16:
            return self.tflops.get("fp16", fp32)
        if dtype in _FP8_DTYPES:
            return self.tflops.get("fp8", fp32)
        return fp32

    def round_bytes(self, nbytes: int) -> int:
        """Bytes the allocator actually reserves for a request of ``nbytes``.

        Args:
            nbytes: Requested size; must not be negative.

        Returns:
            ``0`` for ``0``, otherwise ``nbytes`` rounded up to a multiple of :attr:`allocator_rounding`.

        Raises:
            ValueError: If ``nbytes`` is negative.

        """
        if nbytes < 0:
            raise ValueError(f"nbytes must not be negative, got {nbytes}.")
        step = self.allocator_rounding
        return -(-nbytes // step) * step

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe representation; :meth:`from_dict` restores an equal spec."""
        return {
            "name": self.name,
            "memory_gib": self.memory_gib,
            "tflops": dict(self.tflops),
            "dram_gbps": self.dram_gbps,
            "allocator_rounding": self.allocator_rounding,
            "is_cuda": self.is_cuda,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DeviceSpec:
        """Build a spec from the output of :meth:`to_dict` (possibly after a JSON round trip).

        Args:
            d: Mapping with exactly the keys :meth:`to_dict` produces.

        Returns:
            The reconstructed spec.

        Raises:
            ValueError: If keys are missing or unexpected.

        """
        expected = {f.name for f in fields(cls)}
        missing = expected - set(d)
        extra = set(d) - expected
        if missing or extra:
            raise ValueError(
                f"Cannot build DeviceSpec: missing keys {sorted(missing)}, unexpected keys {sorted(extra)}."
            )
        return cls(
            name=str(d["name"]),
            memory_gib=d["memory_gib"],
            tflops=dict(d["tflops"]),
            dram_gbps=d["dram_gbps"],
            allocator_rounding=d["allocator_rounding"],
            is_cuda=d["is_cuda"],
        )


def _require_positive(what: str, value: object) -> None:
    # bool is an int subclass; True would silently mean 1.0.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number, got {value!r}.")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be a finite positive number, got {value!r}.")


def _host_memory_gib() -> float:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        # os.sysconf is POSIX-only; a nominal 16 GiB keeps the table importable elsewhere.
        return 16.0
    return total / 2**30


def _gpu(name: str, *, memory_gib: float, tflops: dict[str, float], dram_gbps: float) -> tuple[str, DeviceSpec]:
    spec = DeviceSpec(
        name=name,
        memory_gib=memory_gib,
        tflops=tflops,
        dram_gbps=dram_gbps,
        allocator_rounding=_CUDA_ALLOCATOR_ROUNDING,
        is_cuda=True,
    )
    return name, spec


def _build_table() -> dict[str, DeviceSpec]:
    # Conventions for every GPU entry:
    # * Memory is the datasheet capacity. Vendors write "GB", but HBM/GDDR capacities are binary, so the
    #   number is taken as GiB; the driver exposes slightly less (detect_device() uses the real figure).
    # * Sparse "with sparsity" tensor figures are halved to dense; FP32/FP64 are never sparse figures.
    # * "fp64" is the FP64 Tensor Core / matrix-core figure where one exists: cuBLAS and rocBLAS use it for
    #   DGEMM without any opt-in (unlike TF32), so it is what a default float64 matmul can reach.
    # * "fp16" is the rate with FP32 accumulation, which is what torch's fp16 GEMMs use.
    # * "fp64" is omitted where the datasheet omits it; peak_tflops() then uses fp32 / 64.
    entries = [
        # NVIDIA A100 Tensor Core GPU datasheet, "A100 40GB SXM" column.
        _gpu(
            "A100-40GB",
            memory_gib=40,
            tflops={"fp64": 19.5, "fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312},
            dram_gbps=1555,
        ),
        # NVIDIA A100 Tensor Core GPU datasheet, "A100 80GB SXM" column (HBM2e).
        _gpu(
            "A100-80GB",
            memory_gib=80,
            tflops={"fp64": 19.5, "fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312},
            dram_gbps=2039,
        ),
        # NVIDIA H100 Tensor Core GPU datasheet, "H100 SXM" column; dense tensor figures as printed in the
        # NVIDIA H100 Tensor Core GPU Architecture whitepaper. FP64 non-tensor is 34.
        _gpu(
            "H100-SXM",
            memory_gib=80,
            tflops={"fp64": 67, "fp32": 67, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
            dram_gbps=3350,
        ),
        # NVIDIA H100 Tensor Core GPU Architecture whitepaper, "H100 PCIe" column (the datasheet rounds
        # these to 51 / 756* / 1513* / 3026* with sparsity). FP64 non-tensor is 25.6.
        _gpu(
            "H100-PCIe",
            memory_gib=80,
            tflops={"fp64": 51.2, "fp32": 51.2, "tf32": 378, "bf16": 756, "fp16": 756, "fp8": 1513},
            dram_gbps=2000,
        ),
        # NVIDIA H200 Tensor Core GPU datasheet, "H200 SXM" column: H100 SXM compute, 141 GB HBM3e.
        _gpu(
            "H200",
            memory_gib=141,
            tflops={"fp64": 67, "fp32": 67, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
            dram_gbps=4800,
        ),
        # NVIDIA DGX B200 / HGX B200 datasheets, 8-GPU totals divided by 8 (1,440 GB, 64 TB/s; FP32 600,
        # FP64 296, TF32 18 P*, BF16/FP16 36 P*, FP8 72 P* with sparsity). Early announcements said 192 GB.
        _gpu(
            "B200",
            memory_gib=180,
            tflops={"fp64": 37, "fp32": 75, "tf32": 1125, "bf16": 2250, "fp16": 2250, "fp8": 4500},
            dram_gbps=8000,
        ),
        # NVIDIA L4 Tensor Core GPU datasheet (no FP64 figure published).
        _gpu(
            "L4",
            memory_gib=24,
            tflops={"fp32": 30.3, "tf32": 60, "bf16": 121, "fp16": 121, "fp8": 242.5},
            dram_gbps=300,
        ),
        # NVIDIA L40S datasheet (dense | sparse printed side by side; no FP64 figure published).
        _gpu(
            "L40S",
            memory_gib=48,
            tflops={"fp32": 91.6, "tf32": 183, "bf16": 362.05, "fp16": 362.05, "fp8": 733},
            dram_gbps=864,
        ),
        # NVIDIA A10 Tensor Core GPU datasheet. The A10G is AWS's variant of this GA102 part (G5 instances)
        # with no public NVIDIA datasheet; AWS lists the same 24 GB / 600 GB/s, clocks are within ~1%.
        _gpu(
            "A10G",
            memory_gib=24,
            tflops={"fp32": 31.2, "tf32": 62.5, "bf16": 125, "fp16": 125},
            dram_gbps=600,
        ),
        # NVIDIA Ada Lovelace GPU Architecture whitepaper, appendix table, GeForce RTX 4090. GeForce runs
        # FP16/BF16 (and FP8) tensor math with FP32 accumulation at half the FP16-accumulate rate, so these
        # are 165.2 (not 330.3) and 330.3 (not 660.6).
        _gpu(
            "RTX-4090",
            memory_gib=24,
            tflops={"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3},
            dram_gbps=1008,
        ),
        # NVIDIA Tesla V100 GPU datasheet, "V100 SXM2" column, 32 GB model. No TF32, BF16 or FP8;
        # "fp16" is the 125 TFLOPS "Tensor Performance" figure.
        _gpu(
            "V100",
            memory_gib=32,
            tflops={"fp64": 7.8, "fp32": 15.7, "fp16": 125},
            dram_gbps=900,
        ),
        # AMD Instinct MI300X accelerator datasheet (FP64 matrix 163.4, vector 81.7; dense figures, the
        # sparse ones are printed separately).
        _gpu(
            "MI300X",
            memory_gib=192,
            tflops={
                "fp64": 163.4,
                "fp32": 163.4,
                "tf32": 653.7,
                "bf16": 1307.4,
                "fp16": 1307.4,
                "fp8": 2614.9,
            },
            dram_gbps=5300,
        ),
    ]
    table = dict(entries)
    # Not a datasheet: modest figures for a few-core x86 server (AVX2/AVX-512 FMA on ~4 cores, one or two
    # DDR4 channels), so that plans made on a laptop or CI runner are not wildly optimistic. torch runs bf16
    # matmuls on CPU at about the fp32 rate unless AMX is present. Memory is this machine's physical RAM.
    table["cpu"] = DeviceSpec(
        name="cpu",
        memory_gib=_host_memory_gib(),
        tflops={"fp64": 0.1, "fp32": 0.2, "bf16": 0.2},
        dram_gbps=20,
        allocator_rounding=1,
        is_cuda=False,
    )
    return table


DEVICE_SPECS: Mapping[str, DeviceSpec] = MappingProxyType(_build_table())
"""Canonical device name to its :class:`DeviceSpec`; read-only."""


def _normalize(name: str) -> str:
    # Users write "H100 SXM", "h100_sxm" and "H100-SXM" interchangeably.
    return re.sub(r"[-_ ]", "", name).lower()


_BY_NORMALIZED_NAME: Mapping[str, str] = MappingProxyType({_normalize(name): name for name in DEVICE_SPECS})

# Driver-reported names (torch.cuda.get_device_properties(...).name) to table entries, tried in order: the
# more specific pattern first wherever one name contains another (H100 PCIe before H100, L40S before L4).
_DRIVER_NAME_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), entry)
    for pattern, entry in (
        (r"\bH100\b.*\bPCIE\b", "H100-PCIe"),
        (r"\bH100\b", "H100-SXM"),  # "NVIDIA H100 80GB HBM3"; also H100 NVL, whose compute is close.
        (r"\bG?H200\b", "H200"),  # GH200's GPU is an H100/H200-class Hopper with HBM3/HBM3e.
        (r"\bG?B200\b", "B200"),
        (r"\bA100\b.*\b80\s*GB\b", "A100-80GB"),  # "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"
        (r"\bA100\b", "A100-40GB"),  # "NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"
        (r"\bL40S\b", "L40S"),
        (r"\bL4\b", "L4"),
        (r"\bA10G?\b", "A10G"),  # the plain A10 has the same datasheet figures
        (r"\bRTX\s*4090\b", "RTX-4090"),
        (r"\bV100\b", "V100"),
        (r"\bMI300X\b", "MI300X"),
    )
)


def _unknown_device_message(device: str) -> str:
    return (
        f"Unknown device {device!r}. Known devices: {', '.join(known_devices())} (matched ignoring case, "
        "'-', '_' and spaces), or 'auto' to detect the visible device. For other hardware pass your own "
        "spec instead of a name, e.g. get_device_spec(DeviceSpec(name='my-gpu', memory_gib=48, "
        "tflops={'fp32': 90.0, 'bf16': 360.0}, dram_gbps=900, allocator_rounding=512, is_cuda=True))."
    )


def known_devices() -> list[str]:
    """Canonical names of all entries in :data:`DEVICE_SPECS`, sorted."""
    return sorted(DEVICE_SPECS)


def get_device_spec(device: str | DeviceSpec = "auto") -> DeviceSpec:
    """Resolve a device name (or spec) to a :class:`DeviceSpec`.

    Args:
        device: A :class:`DeviceSpec`, returned unchanged; ``"auto"`` for :func:`detect_device`; or a name
            from :func:`known_devices`, matched ignoring case, ``-``, ``_`` and spaces (``"h100_sxm"`` and
            ``"H100 SXM"`` both give ``"H100-SXM"``).

    Returns:
        The matching spec.

    Raises:
        UnknownDeviceError: If the name matches no known device.
        TypeError: If ``device`` is neither a string nor a :class:`DeviceSpec`.

    """
    if isinstance(device, DeviceSpec):
        return device
    if not isinstance(device, str):
        raise TypeError(f"device must be a str or DeviceSpec, got {type(device).__name__}.")
    key = _normalize(device)
    if key == "auto":
        return detect_device()
    canonical = _BY_NORMALIZED_NAME.get(key)
    if canonical is None:
        raise UnknownDeviceError(_unknown_device_message(device))
    return DEVICE_SPECS[canonical]


def _table_entry_for_driver_name(name: str) -> str | None:
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
    entry = _table_entry_for_driver_name(name)
    if entry is None:
        entry = _FALLBACK_CUDA_ENTRY
        warnings.warn(
            f"No device table entry matches CUDA device {name!r}; using {entry} throughput and bandwidth. "
            "Pass a DeviceSpec with this device's figures for accurate plans.",
            UserWarning,
            stacklevel=2,
        )
    # The driver's total memory beats the datasheet's: it is what allocations can actually use.
    return replace(DEVICE_SPECS[entry], name=name, memory_gib=int(props.total_memory) / 2**30)
