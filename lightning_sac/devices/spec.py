"""Hardware descriptions the planner reasons about: memory capacity, peak throughput and bandwidth.

A :class:`DeviceSpec` says how much memory a device has, how fast it multiplies in each dtype, how fast it
moves bytes, and how its allocator rounds requests. The table of known devices and the lookups are in
:mod:`lightning_sac.devices.lookup`.

All throughput figures are *dense* peaks. NVIDIA datasheets headline the 2:4 structured-sparsity numbers,
which are twice the dense ones and which ordinary training never reaches, so those are halved here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

import torch

from lightning_sac.devices.names import DeviceMatch
from lightning_sac.devices.table import FP64_FALLBACK_RATIO

__all__ = ["DeviceSpec", "UnknownDeviceError"]

# Throughput keys a DeviceSpec may carry, one per arithmetic the hardware rates separately.
_TFLOPS_KEYS = frozenset({"fp64", "fp32", "tf32", "bf16", "fp16", "fp8"})

# Collected by name so that float8/float4 variants added by newer torch releases are covered without a
# version check, and ones missing from older releases (torch>=2.6 is supported) are simply absent.
_FP8_DTYPES = frozenset(
    value
    for attr, value in vars(torch).items()
    if attr.startswith(("float8_", "float4_")) and isinstance(value, torch.dtype)
)


class UnknownDeviceError(ValueError):
    """Raised when a device name resolves to no entry of ``DEVICE_SPECS``.

    Attributes:
        match: What the name matched (the model's entries it lists, or a misspelled one), when a name was looked
            up; the command line words its own line from it.
    """

    def __init__(self, message: str, match: DeviceMatch | None = None) -> None:
        super().__init__(message)
        self.match = match


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
        compute_capability: NVIDIA SM version ``(major, minor)``, which decides the attention kernels
            ``scaled_dot_product_attention`` may pick (:mod:`lightning_sac.dryrun.cuda.sdpa`); ``None`` for the
            CPU and for AMD GPUs (ROCm's kernels have their own rules).
        context_bytes: Device memory the CUDA context takes outside PyTorch's allocator: driver state and the
            kernels a training step loads. Not part of ``torch.cuda.memory_reserved()``, but of what the device
            holds (``nvidia-smi``); a plan's budget counts it (:mod:`lightning_sac.plan.reserve`).
        blas_workspace_bytes: cuBLAS workspace per handle and stream, allocated through PyTorch's caching
            allocator at the first matmul and kept (torch's default ``CUBLAS_WORKSPACE_CONFIG``).
        nccl_bytes: Device memory NCCL's buffers take per communicator, outside PyTorch's allocator, when the step
            runs on several processes.

    """

    name: str
    memory_gib: float
    # Excluded from the hash because mappings are unhashable; equality still compares it.
    tflops: Mapping[str, float] = field(hash=False)
    dram_gbps: float
    allocator_rounding: int
    is_cuda: bool
    compute_capability: tuple[int, int] | None = None
    context_bytes: int = 0
    blas_workspace_bytes: int = 0
    nccl_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("DeviceSpec.name must be a non-empty string.")
        _require_positive("memory_gib", self.memory_gib)
        _require_positive("dram_gbps", self.dram_gbps)
        if isinstance(self.allocator_rounding, bool) or not isinstance(self.allocator_rounding, int):
            raise TypeError(f"allocator_rounding must be an int, got {self.allocator_rounding!r}.")
        if self.allocator_rounding < 1:
            raise ValueError(f"allocator_rounding must be at least 1, got {self.allocator_rounding}.")
        for key in ("context_bytes", "blas_workspace_bytes", "nccl_bytes"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{key} must be a non-negative int of bytes, got {value!r}.")
        if self.compute_capability is not None:
            object.__setattr__(self, "compute_capability", tuple(int(v) for v in self.compute_capability))
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
            return self.tflops.get("fp64", fp32 / FP64_FALLBACK_RATIO)
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
            "compute_capability": None if self.compute_capability is None else list(self.compute_capability),
            "context_bytes": self.context_bytes,
            "blas_workspace_bytes": self.blas_workspace_bytes,
            "nccl_bytes": self.nccl_bytes,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DeviceSpec:
        """Build a spec from the output of :meth:`to_dict` (possibly after a JSON round trip).

        Args:
            d: Mapping with the keys :meth:`to_dict` produces; the fields added after the first release
                (``compute_capability`` and the reserve figures) may be absent, as in older profiles.

        Returns:
            The reconstructed spec.

        Raises:
            ValueError: If keys are missing or unexpected.

        """
        expected = {f.name for f in fields(cls)}
        missing = expected - set(d) - _OPTIONAL_KEYS
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
            compute_capability=None if d.get("compute_capability") is None else tuple(d["compute_capability"]),
            context_bytes=d.get("context_bytes", 0),
            blas_workspace_bytes=d.get("blas_workspace_bytes", 0),
            nccl_bytes=d.get("nccl_bytes", 0),
        )


_OPTIONAL_KEYS = frozenset({"compute_capability", "context_bytes", "blas_workspace_bytes", "nccl_bytes"})


def _require_positive(what: str, value: object) -> None:
    # bool is an int subclass; True would silently mean 1.0.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number, got {value!r}.")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be a finite positive number, got {value!r}.")
