"""Every GPU of the device table against its source.

Each entry's figures are kept here as its source prints them (sparse tensor figures marked ``*`` or printed as
``dense/sparse``, petaFLOPS as ``PFLOPS``, capacities in the vendor's "GB", board totals as totals), beside the
document they come from; the tests derive the table's figures from them by the conventions of
``lightning_sac/devices/datasheets.py`` (sparse halved, board figures divided by the GPUs on the board, "GB" taken
as GiB), within the rounding of the printed digits. A typo in the table or here fails.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import pytest

from lightning_sac.devices import DEVICE_SPECS, DeviceSpec


@dataclass(frozen=True)
class Source:
    """A GPU's figures as one document prints them.

    Attributes:
        document: The vendor document and its column, or where it was seen when not in the original.
        memory: Capacity as printed ("80GB HBM3").
        bandwidth: DRAM bandwidth as printed ("3.35TB/s", "1,555GB/s").
        tflops: Table key to the figure printed for it: "19.5" (dense), "989*" (with sparsity), "156 | 312*" or
            "165.2/330.4" (dense then sparse), "36 PFLOPS*".
        per: The torch devices the printed figures are for (8 for a DGX total, 2 for an MI250X's two dies).
        derived: Table keys no source prints, with the rule the entry's comment gives for them.
    """

    document: str
    memory: str
    bandwidth: str
    tflops: Mapping[str, str]
    per: int = 1
    derived: Mapping[str, Callable[[Mapping[str, float]], float]] = field(default_factory=dict)


_A100 = {"fp64": "19.5", "fp32": "19.5", "tf32": "156 | 312*", "bf16": "312 | 624*", "fp16": "312 | 624*"}
_H100 = {"tf32": "494.7/989.4", "bf16": "989.4/1,978.9", "fp16": "989.4/1,978.9", "fp8": "1,978.9/3,957.8"}
_HOPPER_SPARSE = {"tf32": "989*", "bf16": "1,979*", "fp16": "1,979*", "fp8": "3,958*"}
_A10 = {"fp32": "31.2", "tf32": "62.5 | 125*", "bf16": "125 | 250*", "fp16": "125 | 250*"}
_CDNA3 = {"fp64": "163.4", "fp32": "163.4", "tf32": "653.7", "bf16": "1,307.4", "fp16": "1,307.4", "fp8": "2,614.9"}

SOURCES: dict[str, Source] = {
    "A100-40GB": Source("NVIDIA A100 datasheet, A100 40GB SXM", "40GB HBM2", "1,555GB/s", _A100),
    "A100-80GB": Source("NVIDIA A100 datasheet, A100 80GB SXM", "80GB HBM2e", "2,039GB/s", _A100),
    "A800-40GB": Source("NVIDIA A800 datasheet, A800 40GB PCIe (as reproduced)", "40GB HBM2", "1,555GB/s", _A100),
    "A800-80GB": Source("NVIDIA A800 datasheet, A800 80GB SXM (as reproduced)", "80GB HBM2e", "2,039GB/s", _A100),
    "H100-SXM": Source(
        "NVIDIA H100 datasheet, H100 SXM; tensor figures from the H100 architecture whitepaper",
        "80GB",
        "3.35TB/s",
        {"fp64": "67", "fp32": "67", **_H100},
    ),
    "H100-PCIe": Source(
        "NVIDIA H100 architecture whitepaper, H100 PCIe; memory from the H100 datasheet",
        "80GB",
        "2TB/s",
        {"fp64": "51.2", "fp32": "51.2", "tf32": "378/756", "bf16": "756/1513", "fp16": "756/1513", "fp8": "1513/3026"},
    ),
    "H800": Source(
        "NVIDIA H800 datasheet, H800 SXM5 (as reproduced)",
        "80GB",
        "3.35TB/s",
        {"fp64": "1", "fp32": "67", **_HOPPER_SPARSE},
    ),
    "H20": Source(
        "press reports of NVIDIA's H20 spec sheet (no public datasheet)",
        "96GB HBM3",
        "4.0TB/s",
        {"fp64": "1", "fp32": "44", "tf32": "74", "bf16": "148", "fp16": "148", "fp8": "296"},
    ),
    "H200": Source(
        "NVIDIA H200 datasheet, H200 SXM", "141GB", "4.8TB/s", {"fp64": "67", "fp32": "67", **_HOPPER_SPARSE}
    ),
    "GH200": Source(
        "NVIDIA GH200 Grace Hopper Superchip datasheet, HBM3 GPU",
        "96GB HBM3",
        "4TB/s",
        {"fp64": "67", "fp32": "67", **_HOPPER_SPARSE},
    ),
    "B100": Source(
        "NVIDIA Blackwell datasheet (GTC 2024), HGX B100 per GPU",
        "192GB",
        "8TB/s",
        {"fp64": "30", "tf32": "1.8 PFLOPS*", "bf16": "3.5 PFLOPS*", "fp16": "3.5 PFLOPS*", "fp8": "7 PFLOPS*"},
        derived={"fp32": lambda t: 2 * t["fp64"]},  # not printed: Blackwell's FP32 is twice its FP64
    ),
    "B200": Source(
        "NVIDIA DGX B200 datasheet, 8-GPU totals",
        "1,440GB",
        "64TB/s",
        {
            "fp64": "296",
            "fp32": "600",
            "tf32": "18 PFLOPS*",
            "bf16": "36 PFLOPS*",
            "fp16": "36 PFLOPS*",
            "fp8": "72 PFLOPS*",
        },
        per=8,
    ),
    "GB200": Source(
        "NVIDIA GB200 NVL72 datasheet, individual Blackwell GPU, GB200 NVL72 (as reproduced)",
        "186GB HBM3E",
        "8TB/s",
        {
            "fp64": "40",
            "fp32": "80",
            "tf32": "2.5 PFLOPS*",
            "bf16": "5 PFLOPS*",
            "fp16": "5 PFLOPS*",
            "fp8": "10 PFLOPS*",
        },
    ),
    "V100": Source(
        "NVIDIA Tesla V100 datasheet, V100 SXM2 32GB",
        "32GB HBM2",
        "900GB/sec",
        {"fp64": "7.8", "fp32": "15.7", "fp16": "125"},
    ),
    "T4": Source("NVIDIA T4 datasheet", "16 GB GDDR6", "320+ GB/s", {"fp32": "8.1", "fp16": "65"}),
    "L4": Source(
        "NVIDIA L4 datasheet",
        "24GB",
        "300GB/s",
        {"fp32": "30.3", "tf32": "120*", "bf16": "242*", "fp16": "242*", "fp8": "485*"},
    ),
    "L40": Source(
        "NVIDIA L40 datasheet",
        "48GB GDDR6",
        "864GB/s",
        {
            "fp32": "90.5",
            "tf32": "90.5 | 181*",
            "bf16": "181.05 | 362.1*",
            "fp16": "181.05 | 362.1*",
            "fp8": "362 | 724*",
        },
    ),
    "L40S": Source(
        "NVIDIA L40S datasheet",
        "48GB GDDR6",
        "864GB/s",
        {"fp32": "91.6", "tf32": "183 | 366*", "bf16": "362.05 | 733*", "fp16": "362.05 | 733*", "fp8": "733 | 1,466*"},
    ),
    "A10": Source("NVIDIA A10 datasheet", "24GB GDDR6", "600GB/s", _A10),
    "A10G": Source("NVIDIA A10 datasheet (no A10G datasheet; AWS lists the A10's memory)", "24GB", "600GB/s", _A10),
    "A40": Source(
        "NVIDIA A40 datasheet (FP16 with FP16 accumulate; BF16 with FP32 accumulate)",
        "48 GB GDDR6",
        "696 GB/s",
        {"fp32": "37.4", "tf32": "74.8 | 149.6*", "bf16": "149.7 | 299.4*", "fp16": "149.7 | 299.4*"},
    ),
    "RTX-A6000": Source(
        "NVIDIA Ampere GA102 whitepaper v2.0, Appendix C, RTX A6000",
        "48 GB GDDR6",
        "768 GB/sec",
        {"fp32": "38.7", "tf32": "77.4/154.8", "bf16": "154.8/309.7", "fp16": "154.8/309.7"},
    ),
    "RTX-3090": Source(
        "NVIDIA Ampere GA102 whitepaper v2.0, Appendix A, GeForce RTX 3090 (FP32 accumulate)",
        "24 GB GDDR6X",
        "936 GB/sec",
        {"fp32": "35.6", "tf32": "35.6/71", "bf16": "71/142", "fp16": "71/142"},
    ),
    "RTX-4090": Source(
        "NVIDIA Ada Lovelace whitepaper, appendix, GeForce RTX 4090 (FP32 accumulate)",
        "24 GB GDDR6X",
        "1008 GB/sec",
        {"fp32": "82.6", "tf32": "82.6/165.2", "bf16": "165.2/330.4", "fp16": "165.2/330.4", "fp8": "330.3/660.6"},
    ),
    "RTX-5090": Source(
        "NVIDIA RTX Blackwell whitepaper, appendix, GeForce RTX 5090 (FP32 accumulate)",
        "32 GB GDDR7",
        "1792 GB/sec",
        {"fp32": "104.8", "tf32": "104.8/209.5", "bf16": "209.5/419", "fp16": "209.5/419", "fp8": "419/838"},
    ),
    "MI250X": Source(
        "AMD Instinct MI250X datasheet, the module's two dies (FP64 and FP32 matrix)",
        "128GB HBM2e",
        "3.2 TB/s",
        {"fp64": "95.7", "fp32": "95.7", "bf16": "383.0", "fp16": "383.0"},
        per=2,
    ),
    "MI300X": Source("AMD Instinct MI300X datasheet (dense)", "192 GB HBM3", "5.3 TB/s", _CDNA3),
    "MI325X": Source("AMD Instinct MI325X datasheet (dense)", "256 GB HBM3E", "6 TB/s", _CDNA3),
}

_FIGURE = re.compile(r"^([\d,]+(?:\.\d+)?)\s*(PFLOPS|TFLOPS)?(\*)?$")
_SIZE = re.compile(r"([\d,]+(?:\.\d+)?)\+?\s*(TB|GB)")


def _number(text: str) -> tuple[float, float]:
    """A printed number and half a unit of its last digit (what rounding to that digit may hide)."""
    digits = text.replace(",", "")
    decimals = len(digits.partition(".")[2])
    return float(digits), 0.5 * 10.0**-decimals


def dense(printed: str, per: int = 1) -> tuple[float, float]:
    """The dense per-device TFLOP/s a printed figure stands for, and its rounding tolerance.

    "989*" is a sparse figure (halved); "156 | 312*" and "165.2/330.4" are dense then sparse (the first is taken);
    "36 PFLOPS*" is in petaFLOP/s; the result is divided by the devices the figure is for.
    """
    first = re.split(r"\s*[|/]\s*", printed)[0]
    found = _FIGURE.match(first.strip())
    assert found is not None, f"unreadable figure {printed!r}"
    value, tolerance = _number(found.group(1))
    scale = (1000.0 if found.group(2) == "PFLOPS" else 1.0) / per / (2.0 if found.group(3) else 1.0)
    return value * scale, tolerance * scale


def size(printed: str, per: int = 1) -> tuple[float, float]:
    """GB (or GB/s) a printed capacity or bandwidth stands for, per device, and its rounding tolerance."""
    found = _SIZE.search(printed)
    assert found is not None, f"unreadable size {printed!r}"
    value, tolerance = _number(found.group(1))
    scale = (1000.0 if found.group(2) == "TB" else 1.0) / per
    return value * scale, tolerance * scale


def mismatches(spec: DeviceSpec, source: Source) -> list[str]:
    """Each way ``spec`` does not follow from ``source``; empty when it does."""
    wrong = []
    memory, _ = size(source.memory, source.per)
    if spec.memory_gib != memory:  # "GB" is taken as GiB, exactly
        wrong.append(f"memory {spec.memory_gib} GiB, printed {source.memory!r} / {source.per}")
    bandwidth, slack = size(source.bandwidth, source.per)
    if abs(spec.dram_gbps - bandwidth) > slack:
        wrong.append(f"bandwidth {spec.dram_gbps} GB/s, printed {source.bandwidth!r} / {source.per}")
    printed = {k: dense(v, source.per) for k, v in source.tflops.items()}
    if set(spec.tflops) != set(printed) | set(source.derived):
        wrong.append(f"keys {sorted(spec.tflops)}, printed {sorted(printed)} + derived {sorted(source.derived)}")
    for key, (value, slack) in printed.items():
        if key in spec.tflops and abs(spec.tflops[key] - value) > slack + 1e-9:
            wrong.append(f"{key} {spec.tflops[key]}, printed {source.tflops[key]!r} -> {value:g} +- {slack:g}")
    for key, rule in source.derived.items():
        expected = rule({k: v for k, (v, _) in printed.items()})
        if spec.tflops.get(key) != pytest.approx(expected):
            wrong.append(f"{key} {spec.tflops.get(key)}, derived {expected:g}")
    return wrong


def test_every_gpu_of_the_table_has_a_source():
    assert set(SOURCES) == set(DEVICE_SPECS) - {"cpu"}


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_the_table_follows_from_its_source(name):
    assert mismatches(DEVICE_SPECS[name], SOURCES[name]) == []


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_a_printed_sparse_figure_is_twice_its_dense_one(name):
    # A transcription check on "dense | sparse" pairs. The L40S datasheet itself is 1.2% off (362.05 | 733*).
    for key, printed in SOURCES[name].tflops.items():
        parts = re.split(r"\s*[|/]\s*", printed)
        if len(parts) == 2:
            (low, _), (high, _) = _number(parts[0]), _number(parts[1].rstrip("*"))
            assert high == pytest.approx(2 * low, rel=0.015), (name, key, printed)


def test_the_reading_rules():
    assert dense("989*") == (494.5, 0.25)
    assert dense("1,979*") == (989.5, 0.25)
    assert dense("156 | 312*") == (156.0, 0.5)
    assert dense("165.2/330.4") == pytest.approx((165.2, 0.05))
    assert dense("36 PFLOPS*", per=8) == (2250.0, 31.25)
    assert size("1,440GB", per=8) == (180.0, 0.0625) and size("3.35TB/s") == (3350.0, 5.0)
    assert size("320+ GB/s") == (320.0, 0.5) and size("3.2 TB/s", per=2) == (1600.0, 25.0)


def _scaled(spec: DeviceSpec, key: str, factor: float) -> DeviceSpec:
    return replace(spec, tflops={**spec.tflops, key: spec.tflops[key] * factor})


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda s: _scaled(s, "fp16", 1.02), "fp16"),  # a 2% typo in a figure
        (lambda s: _scaled(s, "fp8", 2.0), "fp8"),  # a sparse figure not halved
        (lambda s: replace(s, memory_gib=80 * 2**30 / 1e9), "memory"),  # "GB" converted to GiB after all
        (lambda s: replace(s, dram_gbps=3380.0), "bandwidth"),
        (lambda s: replace(s, tflops={k: v for k, v in s.tflops.items() if k != "fp8"}), "keys"),  # a figure dropped
    ],
)
def test_a_wrong_entry_is_found(change, why):
    found = mismatches(change(DEVICE_SPECS["H100-SXM"]), SOURCES["H100-SXM"])
    assert len(found) == 1 and found[0].startswith(why), found
