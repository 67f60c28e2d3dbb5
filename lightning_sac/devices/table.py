"""The device table's data: datasheet figures of common training and inference GPUs, and driver names.

:mod:`lightning_sac.devices.spec` turns these figures into :class:`~lightning_sac.devices.spec.DeviceSpec` entries
(:data:`~lightning_sac.devices.spec.DEVICE_SPECS`) and matches driver-reported names with :data:`DRIVER_NAME_PATTERNS`.
Adding a GPU is one :class:`Datasheet` here, with the source of its figures in a comment, and, when the driver
calls it something the patterns miss, one pattern.
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
    "GPU_DATASHEETS",
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
    """

    name: str
    memory_gib: float
    tflops: Mapping[str, float]
    dram_gbps: float
    compute_capability: tuple[int, int] | None = None
    nccl_bytes: int = NCCL_BYTES_AMPERE


# Conventions for every GPU entry:
# * Memory is the datasheet capacity. Vendors write "GB", but HBM/GDDR capacities are binary, so the
#   number is taken as GiB; the driver exposes slightly less (detect_device() uses the real figure).
# * Sparse "with sparsity" tensor figures are halved to dense; FP32/FP64 are never sparse figures.
# * "fp64" is the FP64 Tensor Core / matrix-core figure where one exists: cuBLAS and rocBLAS use it for
#   DGEMM without any opt-in (unlike TF32), so it is what a default float64 matmul can reach.
# * "fp16" is the rate with FP32 accumulation, which is what torch's fp16 GEMMs use.
# * "fp64" is omitted where the datasheet omits it; peak_tflops() then uses fp32 / 64.
GPU_DATASHEETS: tuple[Datasheet, ...] = (
    # NVIDIA A100 Tensor Core GPU datasheet, "A100 40GB SXM" column.
    Datasheet(
        "A100-40GB",
        memory_gib=40,
        tflops={"fp64": 19.5, "fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312},
        dram_gbps=1555,
        compute_capability=(8, 0),
    ),
    # NVIDIA A100 Tensor Core GPU datasheet, "A100 80GB SXM" column (HBM2e).
    Datasheet(
        "A100-80GB",
        memory_gib=80,
        tflops={"fp64": 19.5, "fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312},
        dram_gbps=2039,
        compute_capability=(8, 0),
    ),
    # NVIDIA H100 Tensor Core GPU datasheet, "H100 SXM" column; dense tensor figures as printed in the
    # NVIDIA H100 Tensor Core GPU Architecture whitepaper. FP64 non-tensor is 34.
    Datasheet(
        "H100-SXM",
        memory_gib=80,
        tflops={"fp64": 67, "fp32": 67, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
        dram_gbps=3350,
        compute_capability=(9, 0), nccl_bytes=NCCL_BYTES_HOPPER,
    ),
    # NVIDIA H100 Tensor Core GPU Architecture whitepaper, "H100 PCIe" column (the datasheet rounds
    # these to 51 / 756* / 1513* / 3026* with sparsity). FP64 non-tensor is 25.6.
    Datasheet(
        "H100-PCIe",
        memory_gib=80,
        tflops={"fp64": 51.2, "fp32": 51.2, "tf32": 378, "bf16": 756, "fp16": 756, "fp8": 1513},
        dram_gbps=2000,
        compute_capability=(9, 0), nccl_bytes=NCCL_BYTES_HOPPER,
    ),
    # NVIDIA H200 Tensor Core GPU datasheet, "H200 SXM" column: H100 SXM compute, 141 GB HBM3e.
    Datasheet(
        "H200",
        memory_gib=141,
        tflops={"fp64": 67, "fp32": 67, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
        dram_gbps=4800,
        compute_capability=(9, 0), nccl_bytes=NCCL_BYTES_HOPPER,
    ),
    # NVIDIA DGX B200 / HGX B200 datasheets, 8-GPU totals divided by 8 (1,440 GB, 64 TB/s; FP32 600,
    # FP64 296, TF32 18 P*, BF16/FP16 36 P*, FP8 72 P* with sparsity). Early announcements said 192 GB.
    Datasheet(
        "B200",
        memory_gib=180,
        tflops={"fp64": 37, "fp32": 75, "tf32": 1125, "bf16": 2250, "fp16": 2250, "fp8": 4500},
        dram_gbps=8000,
        compute_capability=(10, 0), nccl_bytes=NCCL_BYTES_HOPPER,
    ),
    # NVIDIA L4 Tensor Core GPU datasheet (no FP64 figure published).
    Datasheet(
        "L4",
        memory_gib=24,
        tflops={"fp32": 30.3, "tf32": 60, "bf16": 121, "fp16": 121, "fp8": 242.5},
        dram_gbps=300,
        compute_capability=(8, 9),
    ),
    # NVIDIA L40S datasheet (dense | sparse printed side by side; no FP64 figure published).
    Datasheet(
        "L40S",
        memory_gib=48,
        tflops={"fp32": 91.6, "tf32": 183, "bf16": 362.05, "fp16": 362.05, "fp8": 733},
        dram_gbps=864,
        compute_capability=(8, 9),
    ),
    # NVIDIA A10 Tensor Core GPU datasheet. The A10G is AWS's variant of this GA102 part (G5 instances)
    # with no public NVIDIA datasheet; AWS lists the same 24 GB / 600 GB/s, clocks are within ~1%.
    Datasheet(
        "A10G",
        memory_gib=24,
        tflops={"fp32": 31.2, "tf32": 62.5, "bf16": 125, "fp16": 125},
        dram_gbps=600,
        compute_capability=(8, 6),
    ),
    # NVIDIA Ada Lovelace GPU Architecture whitepaper, appendix table, GeForce RTX 4090. GeForce runs
    # FP16/BF16 (and FP8) tensor math with FP32 accumulation at half the FP16-accumulate rate, so these
    # are 165.2 (not 330.3) and 330.3 (not 660.6).
    Datasheet(
        "RTX-4090",
        memory_gib=24,
        tflops={"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3},
        dram_gbps=1008,
        compute_capability=(8, 9),
    ),
    # NVIDIA Tesla V100 GPU datasheet, "V100 SXM2" column, 32 GB model. No TF32, BF16 or FP8;
    # "fp16" is the 125 TFLOPS "Tensor Performance" figure.
    Datasheet(
        "V100",
        memory_gib=32,
        tflops={"fp64": 7.8, "fp32": 15.7, "fp16": 125},
        dram_gbps=900,
        compute_capability=(7, 0),
    ),
    # AMD Instinct MI300X accelerator datasheet (FP64 matrix 163.4, vector 81.7; dense figures, the
    # sparse ones are printed separately).
    Datasheet(
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
        nccl_bytes=NCCL_BYTES_HOPPER,
    ),
)

# Not a datasheet: modest figures for a few-core x86 server (AVX2/AVX-512 FMA on ~4 cores, one or two DDR4
# channels), so that plans made on a laptop or CI runner are not wildly optimistic. torch runs bf16 matmuls on
# CPU at about the fp32 rate unless AMX is present. The "cpu" entry's memory is this machine's physical RAM.
CPU_TFLOPS: Mapping[str, float] = {"fp64": 0.1, "fp32": 0.2, "bf16": 0.2}
CPU_DRAM_GBPS = 20.0

#: Driver-reported names (``torch.cuda.get_device_properties(...).name``) to table entries, as (regular
#: expression, entry), tried in order, ignoring case: the more specific pattern first wherever one name contains
#: another (H100 PCIe before H100, L40S before L4).
DRIVER_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
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

#: The entry whose figures a CUDA device matching no pattern gets (its compute-to-bandwidth ratio is mid-table).
FALLBACK_CUDA_ENTRY = "A100-40GB"
