"""The GPUs of the device table: one :class:`~lightning_sac.devices.table.Datasheet` each, with its source.

Every entry names the document and the column its figures come from; ``tests/test_device_sources.py`` keeps the
figures as that document prints them and checks that each entry follows from them by the conventions below. A
figure no source at hand confirms says so beside it.
"""

from __future__ import annotations

from lightning_sac.devices.table import NCCL_BYTES_HOPPER, Datasheet

__all__ = ["GPU_DATASHEETS"]

_HOPPER = NCCL_BYTES_HOPPER
# H100 SXM5's dense tensor figures (NVIDIA H100 Tensor Core GPU Architecture whitepaper), shared by every GH100
# board at its clocks: the datasheets print them with sparsity, rounded (989*, 1,979*, 3,958*).
_GH100_SXM = {"tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}
# GA100 at A100 clocks (NVIDIA A100 datasheet, dense column), shared by the A800, whose figures equal the A100's.
_GA100 = {"fp64": 19.5, "fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312}

# Conventions for every GPU entry:
# * Memory is the datasheet capacity. Vendors write "GB", but HBM/GDDR capacities are binary, so the
#   number is taken as GiB; the driver exposes slightly less (detect_device() uses the real figure).
# * Sparse "with sparsity" tensor figures are halved to dense; FP32/FP64 are never sparse figures.
# * An entry is one GPU as torch addresses it: figures a vendor prints for a board of several (DGX/HGX totals, a
#   GB200 superchip, the two dies of an MI250X, each its own device) are divided by their count.
# * "fp64" is the FP64 Tensor Core / matrix-core figure where one exists: cuBLAS and rocBLAS use it for
#   DGEMM without any opt-in (unlike TF32), so it is what a default float64 matmul can reach. "fp32" is, for the
#   same reason, the FP32 matrix figure on AMD parts that print one above the vector figure (MI250X).
# * "fp16" (and "fp8") is the rate with FP32 accumulation, which is what torch's fp16 GEMMs use. GeForce parts and
#   the L40 run it at half the FP16-accumulate rate; where a datasheet prints only the FP16-accumulate figure of
#   a part that accumulates in FP32 at full rate (the A40: its BF16-with-FP32-accumulate figure is the same), that.
# * "fp64" is omitted where the datasheet omits it; peak_tflops() then uses fp32 / 64.
GPU_DATASHEETS: tuple[Datasheet, ...] = (
    # NVIDIA A100 Tensor Core GPU datasheet, "A100 40GB SXM" column.
    Datasheet("A100-40GB", memory_gib=40, tflops=_GA100, dram_gbps=1555, compute_capability=(8, 0)),
    # NVIDIA A100 Tensor Core GPU datasheet, "A100 80GB SXM" column (HBM2e).
    Datasheet("A100-80GB", memory_gib=80, tflops=_GA100, dram_gbps=2039, compute_capability=(8, 0)),
    # NVIDIA A800 datasheet (the A100 made for export to China, NVLink cut to 400 GB/s), "A800 40GB PCIe" column:
    # 40 GB HBM2, 1,555 GB/s. Not seen in the original here: its compute figures as reproduced by spec databases
    # and the press (Tweakers, 2022-11: "the listed performance is the A100 series'") equal the A100's.
    Datasheet("A800-40GB", memory_gib=40, tflops=_GA100, dram_gbps=1555, compute_capability=(8, 0)),
    # NVIDIA A800 datasheet, "A800 80GB SXM" column: 80 GB HBM2e, 2,039 GB/s (the PCIe card's 1,935 GB/s is not a
    # separate entry, as for the A100 80GB). Same caveat as A800-40GB.
    Datasheet("A800-80GB", memory_gib=80, tflops=_GA100, dram_gbps=2039, compute_capability=(8, 0)),
    # NVIDIA H100 Tensor Core GPU datasheet, "H100 SXM" column; dense tensor figures as printed in the
    # NVIDIA H100 Tensor Core GPU Architecture whitepaper. FP64 non-tensor is 34.
    Datasheet(
        "H100-SXM",
        memory_gib=80,
        tflops={"fp64": 67, "fp32": 67, **_GH100_SXM},
        dram_gbps=3350,
        compute_capability=(9, 0),
        nccl_bytes=_HOPPER,
    ),
    # NVIDIA H100 Tensor Core GPU Architecture whitepaper, "H100 PCIe" column (the datasheet rounds
    # these to 51 / 756* / 1513* / 3026* with sparsity). FP64 non-tensor is 25.6.
    Datasheet(
        "H100-PCIe",
        memory_gib=80,
        tflops={"fp64": 51.2, "fp32": 51.2, "tf32": 378, "bf16": 756, "fp16": 756, "fp8": 1513},
        dram_gbps=2000,
        compute_capability=(9, 0),
        nccl_bytes=_HOPPER,
    ),
    # NVIDIA H800 datasheet (the H100 made for export to China), "H800 SXM5" column: H100 SXM compute but FP64 and
    # FP64 Tensor Core 1 TFLOPS (and NVLink 400 GB/s), 80 GB HBM3, 3.35 TB/s. Not seen in the original here; the
    # figures as the press and spec databases reproduce it. NCCL's buffers: Hopper's tuning, unmeasured on the
    # narrower NVLink.
    Datasheet(
        "H800",
        memory_gib=80,
        tflops={"fp64": 1, "fp32": 67, **_GH100_SXM},
        dram_gbps=3350,
        compute_capability=(9, 0),
        nccl_bytes=_HOPPER,
    ),
    # NVIDIA H20 (Hopper for export to China, 2024): no public NVIDIA datasheet. The figures press reports of its
    # spec sheet give, dense: FP64 1, FP32 44, TF32 74, BF16/FP16 148, FP8 296 TFLOPS; 96 GB HBM3, 4.0 TB/s.
    # Unconfirmed by a vendor document.
    Datasheet(
        "H20",
        memory_gib=96,
        tflops={"fp64": 1, "fp32": 44, "tf32": 74, "bf16": 148, "fp16": 148, "fp8": 296},
        dram_gbps=4000,
        compute_capability=(9, 0),
        nccl_bytes=_HOPPER,
    ),
    # NVIDIA H200 Tensor Core GPU datasheet, "H200 SXM" column: H100 SXM compute, 141 GB HBM3e.
    Datasheet(
        "H200",
        memory_gib=141,
        tflops={"fp64": 67, "fp32": 67, **_GH100_SXM},
        dram_gbps=4800,
        compute_capability=(9, 0),
        nccl_bytes=_HOPPER,
    ),
    # NVIDIA GH200 Grace Hopper Superchip datasheet, the GPU of the HBM3 superchip: 96 GB HBM3, 4 TB/s, H100 SXM
    # compute (FP64 Tensor Core 67, FP32 67, TF32 989*, BF16/FP16 1,979*, FP8 3,958*). The driver calls it
    # "NVIDIA GH200 480GB" (480 GB is the Grace CPU's LPDDR5X). The HBM3e superchip (144 GB, 4.9 TB/s) has H200's
    # figures and is matched to H200 (DRIVER_NAME_PATTERNS).
    Datasheet(
        "GH200",
        memory_gib=96,
        tflops={"fp64": 67, "fp32": 67, **_GH100_SXM},
        dram_gbps=4000,
        compute_capability=(9, 0),
        nccl_bytes=_HOPPER,
    ),
    # NVIDIA Blackwell datasheet (GTC 2024), "HGX B100" column, per GPU: FP64 30, TF32 1.8 P*, FP16/BF16 3.5 P*,
    # FP8 7 P* (with sparsity); 192 GB HBM3e, 8 TB/s. FP32 is not printed: 60 is 2 x FP64, the ratio of every
    # Blackwell column that prints both (B200 75/37, GB200 80/40). Unconfirmed.
    Datasheet(
        "B100",
        memory_gib=192,
        tflops={"fp64": 30, "fp32": 60, "tf32": 900, "bf16": 1750, "fp16": 1750, "fp8": 3500},
        dram_gbps=8000,
        compute_capability=(10, 0),
        nccl_bytes=_HOPPER,
    ),
    # NVIDIA DGX B200 / HGX B200 datasheets, 8-GPU totals divided by 8 (1,440 GB, 64 TB/s; FP32 600,
    # FP64 296, TF32 18 P*, BF16/FP16 36 P*, FP8 72 P* with sparsity). Early announcements said 192 GB.
    Datasheet(
        "B200",
        memory_gib=180,
        tflops={"fp64": 37, "fp32": 75, "tf32": 1125, "bf16": 2250, "fp16": 2250, "fp8": 4500},
        dram_gbps=8000,
        compute_capability=(10, 0),
        nccl_bytes=_HOPPER,
    ),
    # NVIDIA GB200 NVL72 datasheet, "Individual Blackwell GPU Specifications", GB200 NVL72 column (one of a
    # superchip's two GPUs): FP64/FP64 Tensor Core 40, FP32 80, TF32 2.5 P*, FP16/BF16 5 P*, FP8 10 P*;
    # 186 GB HBM3E, 8 TB/s. Seen as reproduced in a public summary of the datasheet.
    Datasheet(
        "GB200",
        memory_gib=186,
        tflops={"fp64": 40, "fp32": 80, "tf32": 1250, "bf16": 2500, "fp16": 2500, "fp8": 5000},
        dram_gbps=8000,
        compute_capability=(10, 0),
        nccl_bytes=_HOPPER,
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
    # NVIDIA T4 Tensor Core GPU datasheet: FP32 8.1, "Mixed Precision (FP16/FP32)" 65 TFLOPS, 16 GB GDDR6,
    # "320+ GB/s". Turing has no TF32, BF16 or FP8. FP64 is not printed; the part runs it at 1/32 of FP32, so the
    # fp32 / 64 stand-in makes float64 estimates twice too slow.
    Datasheet("T4", memory_gib=16, tflops={"fp32": 8.1, "fp16": 65}, dram_gbps=320, compute_capability=(7, 5)),
    # NVIDIA L4 Tensor Core GPU datasheet (no FP64 figure published).
    Datasheet(
        "L4",
        memory_gib=24,
        tflops={"fp32": 30.3, "tf32": 60, "bf16": 121, "fp16": 121, "fp8": 242.5},
        dram_gbps=300,
        compute_capability=(8, 9),
    ),
    # NVIDIA L40 datasheet (dense | sparse side by side: TF32 90.5 | 181*, BF16/FP16 181.05 | 362.1*, FP8
    # 362 | 724*), 48 GB GDDR6, 864 GB/s. Half the L40S's tensor rates: FP32 accumulation at half rate, as on
    # GeForce AD102 (the RTX 4090's 165.2 scaled to 142 SMs gives 181).
    Datasheet(
        "L40",
        memory_gib=48,
        tflops={"fp32": 90.5, "tf32": 90.5, "bf16": 181.05, "fp16": 181.05, "fp8": 362},
        dram_gbps=864,
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
    # NVIDIA A10 Tensor Core GPU datasheet: FP32 31.2, TF32 62.5 | 125*, BF16/FP16 125 | 250*, 24 GB GDDR6,
    # 600 GB/s.
    Datasheet(
        "A10",
        memory_gib=24,
        tflops={"fp32": 31.2, "tf32": 62.5, "bf16": 125, "fp16": 125},
        dram_gbps=600,
        compute_capability=(8, 6),
    ),
    # The A10G is AWS's GA102 board of its G5 instances, with no public NVIDIA datasheet: AWS lists the A10's
    # 24 GB and 600 GB/s. A public A10 vs A10G comparison (Baseten) reports more FP32 and less tensor throughput
    # than the A10, without figures a source confirms, so the entry keeps the A10 datasheet's figures.
    Datasheet(
        "A10G",
        memory_gib=24,
        tflops={"fp32": 31.2, "tf32": 62.5, "bf16": 125, "fp16": 125},
        dram_gbps=600,
        compute_capability=(8, 6),
    ),
    # NVIDIA A40 datasheet: FP32 37.4, TF32 74.8 | 149.6*, BF16 with FP32 accumulate 149.7 | 299.4*, FP16 with FP16
    # accumulate 149.7 | 299.4* (no FP32-accumulate FP16 figure printed; see the conventions), 48 GB GDDR6, 696 GB/s.
    Datasheet(
        "A40",
        memory_gib=48,
        tflops={"fp32": 37.4, "tf32": 74.8, "bf16": 149.7, "fp16": 149.7},
        dram_gbps=696,
        compute_capability=(8, 6),
    ),
    # NVIDIA Ampere GA102 GPU Architecture whitepaper v2.0, Appendix C (RTX A6000): FP32 38.7, TF32 77.4/154.8,
    # FP16 with FP32 accumulate 154.8/309.7, BF16 154.8/309.7; 48 GB GDDR6, 768 GB/s. The figures match the RTX
    # A6000 datasheet (38.7 TFLOPS, "Tensor performance 309.7 TFLOPS" with sparsity).
    Datasheet(
        "RTX-A6000",
        memory_gib=48,
        tflops={"fp32": 38.7, "tf32": 77.4, "bf16": 154.8, "fp16": 154.8},
        dram_gbps=768,
        compute_capability=(8, 6),
    ),
    # NVIDIA Ampere GA102 GPU Architecture whitepaper v2.0, Appendix A (GeForce RTX 3090): FP32 35.6, TF32 35.6/71,
    # FP16 and BF16 with FP32 accumulate 71/142; 24 GB GDDR6X, 936 GB/s. The appendix table itself was not at
    # hand; press tables of the same document agree (FP32 35.6, FP16 142 | 285 with FP16 accumulate, 936 GB/s).
    Datasheet(
        "RTX-3090",
        memory_gib=24,
        tflops={"fp32": 35.6, "tf32": 35.6, "bf16": 71, "fp16": 71},
        dram_gbps=936,
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
    # NVIDIA RTX Blackwell GPU Architecture whitepaper, appendix table, GeForce RTX 5090: FP32 104.8, TF32
    # 104.8/209.5, FP16 and BF16 with FP32 accumulate 209.5/419, FP8 with FP32 accumulate 419/838; 32 GB GDDR7,
    # 1,792 GB/s. The table was seen as its per-instruction figures are quoted beside measurements (mmapeak);
    # the FP16-accumulate headline (838* FP16) agrees.
    Datasheet(
        "RTX-5090",
        memory_gib=32,
        tflops={"fp32": 104.8, "tf32": 104.8, "bf16": 209.5, "fp16": 209.5, "fp8": 419},
        dram_gbps=1792,
        compute_capability=(12, 0),
    ),
    # AMD Instinct MI250X accelerator datasheet: FP64/FP32 vector 47.9, FP64/FP32 matrix 95.7, FP16/BF16 383.0
    # TFLOPS, 128 GB HBM2e, 3.2 TB/s, for the module's two dies (GCDs); torch sees each die as a device with
    # half of all of it. CDNA2 has no TF32 or FP8. Its Infinity Fabric links are of the A100's generation.
    Datasheet(
        "MI250X",
        memory_gib=64,
        tflops={"fp64": 47.85, "fp32": 47.85, "bf16": 191.5, "fp16": 191.5},
        dram_gbps=1600,
        gcn_arch="gfx90a",
    ),
    # AMD Instinct MI300X accelerator datasheet (FP64 matrix 163.4, vector 81.7; dense figures, the
    # sparse ones are printed separately).
    Datasheet(
        "MI300X",
        memory_gib=192,
        tflops={"fp64": 163.4, "fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9},
        dram_gbps=5300,
        nccl_bytes=_HOPPER,
        gcn_arch="gfx942",
    ),
    # AMD Instinct MI325X accelerator datasheet: the MI300X's compute (FP64 matrix 163.4, FP32 163.4, TF32 653.7,
    # FP16/BF16 1,307.4, FP8 2,614.9; dense, sparse printed separately) with 256 GB HBM3E at 6 TB/s.
    Datasheet(
        "MI325X",
        memory_gib=256,
        tflops={"fp64": 163.4, "fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9},
        dram_gbps=6000,
        nccl_bytes=_HOPPER,
        gcn_arch="gfx942",
    ),
)
