"""The device table's shared data: the :class:`Datasheet` record, reserve figures, the CPU entry, driver names.

:mod:`lightning_sac.devices.datasheets` holds one :class:`Datasheet` per GPU, with its source; :mod:`lookup
<lightning_sac.devices.lookup>` turns them into :class:`~lightning_sac.devices.spec.DeviceSpec` entries
(``DEVICE_SPECS``) and matches driver-reported names with :data:`DRIVER_NAME_PATTERNS`. Adding a GPU is one
datasheet there and, when the driver calls it something the patterns miss, one pattern here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "CPU_DRAM_GBPS",
    "CPU_TFLOPS",
    "CUDA_ALLOCATOR_ROUNDING",
    "CUDA_CONTEXT_BYTES",
    "DRIVER_NAME_PATTERNS",
    "FALLBACK_CUDA_ENTRY",
    "FP64_FALLBACK_RATIO",
    "NCCL_BYTES_AMPERE",
    "NCCL_BYTES_HOPPER",
    "Datasheet",
    "blas_workspace_bytes",
]

#: The CUDA and HIP caching allocators round every block up to a multiple of 512 bytes.
CUDA_ALLOCATOR_ROUNDING = 512

_MIB = 2**20

#: The CUDA context of a training process, outside PyTorch's allocator: with lazy module loading (CUDA >= 11.7,
#: torch's default) about 300-430 MiB right after initialization (pytorch/pytorch#107667, #109888), growing as a
#: step's kernels are loaded. Measured by ``tests/gpu`` (``mem_get_info()``'s used bytes less
#: ``torch.cuda.memory_reserved()``, after GPT, GPT-2, Llama and ResNet steps in fp32 and bf16): 708.8 MiB on an
#: NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, cuDNN 9.19, driver 580.159), twice. The figure for every CUDA GPU
#: until the suite measures another; pass a DeviceSpec with your own to override it.
CUDA_CONTEXT_BYTES = 709 * _MIB

#: NCCL's buffers per communicator, outside PyTorch's allocator, scale with the channels NCCL opens (more on
#: faster links): 544 MiB for a 2-GPU and 688 MiB for a 3- or 4-GPU group on 4 x A100 NVLink
#: (NVIDIA/nccl#964), 1.06 GB on 8 x H100 before any all-to-all (NVIDIA/nccl#1685).
NCCL_BYTES_AMPERE = 688 * _MIB
NCCL_BYTES_HOPPER = 1088 * _MIB


def blas_workspace_bytes(capability: tuple[int, int] | None, *, amd_cdna3: bool = False) -> int:
    """CuBLAS (hipBLAS) workspace torch allocates per handle and stream when ``CUBLAS_WORKSPACE_CONFIG`` is unset.

    torch's ``parseChosenWorkspaceSize`` (``aten/src/ATen/cuda/CublasHandlePool.cpp``): ``:4096:8`` (32 MiB) on SM
    9.x to 12.x (Hopper, Blackwell), ``:4096:2:16:8`` (8 MiB + 128 KiB) on earlier NVIDIA parts; on ROCm 32 MiB,
    128 MiB on gfx94x/gfx95x (MI300X). It comes from the caching allocator, so it is in
    ``torch.cuda.memory_allocated()`` from the first matmul on.

    Args:
        capability: NVIDIA SM version, ``None`` for an AMD GPU.
        amd_cdna3: An AMD gfx94x/gfx95x part (MI300 series).
    """
    if capability is None:
        return 128 * _MIB if amd_cdna3 else 32 * _MIB
    if 9 <= capability[0] <= 12:
        return 4096 * 1024 * 8
    return 4096 * 1024 * 2 + 16 * 1024 * 8


#: NVIDIA parts whose datasheets omit FP64 (GA10x, AD10x) run it at 1/64 of the FP32 rate.
FP64_FALLBACK_RATIO = 64.0


@dataclass(frozen=True)
class Datasheet:
    """One GPU's published figures.

    Attributes:
        name: The table entry's canonical name.
        memory_gib: Device memory, GiB.
        tflops: Dense peak TFLOP/s per arithmetic (keys as :attr:`~lightning_sac.devices.spec.DeviceSpec.tflops`).
        dram_gbps: DRAM bandwidth, GB/s.
        compute_capability: NVIDIA SM version; ``None`` for AMD parts.
        nccl_bytes: NCCL's buffers per communicator on this part (see :data:`NCCL_BYTES_AMPERE`).
        gcn_arch: The AMD architecture (``gcnArchName``, e.g. ``"gfx942"``); ``None`` for NVIDIA parts.
    """

    name: str
    memory_gib: float
    tflops: Mapping[str, float]
    dram_gbps: float
    compute_capability: tuple[int, int] | None = None
    nccl_bytes: int = NCCL_BYTES_AMPERE
    gcn_arch: str | None = None

    @property
    def amd_cdna3(self) -> bool:
        """Whether this is an AMD gfx94x/gfx95x part (MI300 series), whose hipBLAS workspace is larger."""
        return self.gcn_arch is not None and self.gcn_arch.startswith(("gfx94", "gfx95"))


# Not a datasheet: modest figures for a few-core x86 server (AVX2/AVX-512 FMA on ~4 cores, one or two DDR4
# channels), so that plans made on a laptop or CI runner are not wildly optimistic. torch runs bf16 matmuls on
# CPU at about the fp32 rate unless AMX is present. The "cpu" entry's memory is this machine's physical RAM.
CPU_TFLOPS: Mapping[str, float] = {"fp64": 0.1, "fp32": 0.2, "bf16": 0.2}
CPU_DRAM_GBPS = 20.0

#: Driver-reported names (``torch.cuda.get_device_properties(...).name``) to table entries, as (regular
#: expression, entry), tried in order, ignoring case. A pattern ends its model number with ``\b``, so that no
#: model matches a longer one (``H20`` is not ``H200``, ``A40`` not ``A4000``, ``L4`` not ``L40``); the more
#: specific pattern comes first wherever one name contains another (H100 PCIe before H100, L40S before L40).
DRIVER_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"\bH100\b.*\bPCIE\b", "H100-PCIe"),
    (r"\bH100\b", "H100-SXM"),  # "NVIDIA H100 80GB HBM3"; also H100 NVL, whose compute is close.
    # "NVIDIA GH200 144G HBM3e": the HBM3e superchip's GPU has H200's 144 GB class memory, 4.9 TB/s and compute.
    (r"\bGH200\b.*\b144\s*GB?\b", "H200"),
    (r"\bGH200\b", "GH200"),  # "NVIDIA GH200 480GB": 96 GB HBM3 (480 GB is the CPU's memory)
    (r"\bH200\b", "H200"),
    # "NVIDIA H800 PCIe": the H100 PCIe board with FP64 and NVLink cut (no datasheet at hand): its other figures.
    (r"\bH800\b.*\bPCIE\b", "H100-PCIe"),
    (r"\bH800\b", "H800"),
    (r"\bH20\b", "H20"),
    (r"\bGB200\b", "GB200"),
    (r"\bB200\b", "B200"),
    (r"\bB100\b", "B100"),
    (r"\bA100\b.*\b80\s*GB\b", "A100-80GB"),  # "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"
    (r"\bA100\b", "A100-40GB"),  # "NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"
    (r"\bA800\b.*\b80\s*GB\b", "A800-80GB"),  # "NVIDIA A800-SXM4-80GB", "NVIDIA A800 80GB PCIe"
    (r"\bA800\b", "A800-40GB"),
    (r"\bL40S\b", "L40S"),
    (r"\bL40\b", "L40"),
    (r"\bL4\b", "L4"),
    (r"\bA10G\b", "A10G"),
    (r"\bA10\b", "A10"),
    (r"\bA40\b", "A40"),
    (r"\bRTX\s*A6000\b", "RTX-A6000"),  # "NVIDIA RTX A6000", not the "RTX 6000 Ada Generation"
    (r"\bRTX\s*3090\b(?!\s*TI\b)", "RTX-3090"),  # the 3090 Ti is faster: no entry
    (r"\bRTX\s*4090\b", "RTX-4090"),
    (r"\bRTX\s*5090\b", "RTX-5090"),
    (r"\bT4\b", "T4"),  # "Tesla T4"
    (r"\bV100\b", "V100"),
    (r"\bMI250X\b", "MI250X"),  # each of the module's two dies: "AMD Instinct MI250X"
    (r"\bMI300X\b", "MI300X"),
    (r"\bMI325X\b", "MI325X"),
)

#: The entry whose figures a CUDA device matching no pattern gets (its compute-to-bandwidth ratio is mid-table).
FALLBACK_CUDA_ENTRY = "A100-40GB"
