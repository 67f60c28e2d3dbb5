from __future__ import annotations

import json
import os
import types
import warnings
from typing import Any

import pytest
import torch

from lightning_sac.devices import (
    DEVICE_ALIASES,
    DEVICE_SPECS,
    DeviceSpec,
    UnknownDeviceError,
    detect_device,
    device_family,
    driver_name_entry,
    get_device_spec,
    known_devices,
    match_device,
)
from lightning_sac.devices.names import model_of

REQUIRED = [
    "A100-40GB",
    "A100-80GB",
    "A800-40GB",
    "A800-80GB",
    "H100-SXM",
    "H100-PCIe",
    "H800",
    "H20",
    "H200",
    "GH200",
    "B100",
    "B200",
    "GB200",
    "T4",
    "L4",
    "L40",
    "L40S",
    "A10",
    "A10G",
    "A40",
    "RTX-A6000",
    "RTX-3090",
    "RTX-4090",
    "RTX-5090",
    "V100",
    "MI250X",
    "MI300X",
    "MI325X",
    "cpu",
]


def _fake_cuda(
    monkeypatch: pytest.MonkeyPatch, name: str, total_memory: int, capability: tuple[int, int] = (9, 0)
) -> None:
    major, minor = capability
    props = types.SimpleNamespace(
        name=name, total_memory=total_memory, multi_processor_count=132, major=major, minor=minor
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def get_device_properties(device: Any = None) -> types.SimpleNamespace:
        assert device == 0
        return props

    monkeypatch.setattr(torch.cuda, "get_device_properties", get_device_properties)


def test_detect_device_reads_the_compute_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    # An A100 whose driver reports SM 8.0: torch's default cuBLAS workspace is :4096:2:16:8 there.
    _fake_cuda(monkeypatch, "NVIDIA A100-SXM4-40GB", 42298834944, capability=(8, 0))
    spec = detect_device()
    assert spec.compute_capability == (8, 0)
    assert spec.blas_workspace_bytes == 2 * 4096 * 1024 + 8 * 16 * 1024


def test_old_profiles_without_the_new_device_fields_still_load() -> None:
    d = DEVICE_SPECS["H100-SXM"].to_dict()
    for key in ("compute_capability", "context_bytes", "blas_workspace_bytes", "nccl_bytes"):
        del d[key]
    old = DeviceSpec.from_dict(d)
    assert old.compute_capability is None and old.context_bytes == 0 and old.nccl_bytes == 0


# --- lookup -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", REQUIRED)
def test_required_devices_present(name: str) -> None:
    assert name in DEVICE_SPECS
    assert name in known_devices()
    assert DEVICE_SPECS[name].name == name


def test_known_devices_sorted_and_complete() -> None:
    names = known_devices()
    assert names == sorted(names)
    assert set(names) == set(DEVICE_SPECS)


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("H100-SXM", "H100-SXM"),
        ("h100_sxm", "H100-SXM"),
        ("H100 SXM", "H100-SXM"),
        ("h100sxm", "H100-SXM"),
        ("a100-40gb", "A100-40GB"),
        ("A100 80GB", "A100-80GB"),
        ("h100 pcie", "H100-PCIe"),
        ("rtx4090", "RTX-4090"),
        ("Mi300x", "MI300X"),
        ("CPU", "cpu"),
        ("l40s", "L40S"),
        ("l4", "L4"),
        ("NVIDIA A100 80GB", "A100-80GB"),  # a leading vendor word is not part of the name
        ("AMD Instinct MI325X", "MI325X"),
        ("GeForce RTX 5090", "RTX-5090"),
        ("Tesla T4", "T4"),
    ],
)
def test_lookup_ignores_case_and_separators(query: str, expected: str) -> None:
    assert get_device_spec(query) is DEVICE_SPECS[expected]


def test_unknown_name_raises_with_known_names() -> None:
    with pytest.raises(UnknownDeviceError, match=r"'TPU-v5'.*A100-40GB.*H100-SXM.*MI300X.*cpu") as info:
        get_device_spec("TPU-v5")
    message = str(info.value)
    for name in REQUIRED:
        assert name in message
    assert "DeviceSpec(" in message
    # Callers that catch ValueError keep working.
    assert isinstance(info.value, ValueError)


def test_every_alias_names_one_entry_and_shadows_no_name() -> None:
    names = {n.replace("-", "").lower() for n in DEVICE_SPECS}
    for alias, entry in DEVICE_ALIASES.items():
        assert get_device_spec(alias) is DEVICE_SPECS[entry], alias
        assert match_device(alias).kind == "alias" and alias.replace("-", "").replace(" ", "").lower() not in names


@pytest.mark.parametrize(
    ("query", "kind", "offered"),
    [
        ("H100-80GB", "model", ("H100-PCIe", "H100-SXM")),  # both H100s have 80 GB: no alias, both listed
        ("NVIDIA H100 80GB HBM3", "model", ("H100-PCIe", "H100-SXM")),
        ("H100-SMX", "misspelling", ("H100-SXM",)),
        ("A100-80GB-SXM", "misspelling", ("A100-80GB",)),
        ("V10", "unknown", ()),  # not V100: a prefix that stops inside a number is another model
        ("H900x", "unknown", ()),
        ("RTX 4080", "unknown", ()),  # not the 4090 one digit away
    ],
)
def test_a_name_of_no_entry_offers_only_its_own_model(query, kind, offered):
    match = match_device(query)
    assert (match.kind, match.candidates) == (kind, offered)
    assert all(model_of(n) == model_of(query) for n in offered)
    with pytest.raises(UnknownDeviceError) as info:
        get_device_spec(query)
    assert info.value.match == match
    assert all(f"{n}" in str(info.value) for n in offered)


def test_non_string_device_is_type_error() -> None:
    with pytest.raises(TypeError, match="str or DeviceSpec"):
        get_device_spec(80)  # type: ignore[arg-type]


def test_user_spec_passes_through_unchanged() -> None:
    mine = DeviceSpec(
        name="my-accelerator",
        memory_gib=48.0,
        tflops={"fp32": 90.0, "bf16": 360.0},
        dram_gbps=900.0,
        allocator_rounding=512,
        is_cuda=True,
    )
    assert get_device_spec(mine) is mine


def test_auto_is_detect_device() -> None:
    assert get_device_spec("auto") == detect_device()
    assert get_device_spec() == detect_device()


# --- table figures ----------------------------------------------------------------------------------


def test_h100_sxm_dense_figures() -> None:
    h100 = DEVICE_SPECS["H100-SXM"]
    # Dense, not the 1979 / 989 / 3958 "with sparsity" datasheet headline numbers.
    assert h100.tflops["bf16"] == pytest.approx(989.4)
    assert h100.tflops["fp16"] == pytest.approx(989.4)
    assert h100.tflops["tf32"] == pytest.approx(494.7)
    assert h100.tflops["fp8"] == pytest.approx(1978.9)
    assert h100.tflops["fp32"] == pytest.approx(67.0)
    assert h100.memory_gib == 80.0
    assert h100.dram_gbps == 3350.0
    assert h100.is_cuda and h100.allocator_rounding == 512


def test_a100_dense_figures() -> None:
    a100 = DEVICE_SPECS["A100-40GB"]
    assert a100.tflops["bf16"] == pytest.approx(312.0)
    assert a100.tflops["tf32"] == pytest.approx(156.0)
    assert a100.tflops["fp32"] == pytest.approx(19.5)
    assert a100.dram_gbps == 1555.0
    assert a100.memory_gib == 40.0
    assert DEVICE_SPECS["A100-80GB"].dram_gbps == 2039.0
    assert DEVICE_SPECS["A100-80GB"].memory_gib == 80.0


def test_l4_dense_figures() -> None:
    l4 = DEVICE_SPECS["L4"]
    assert l4.tflops["tf32"] == pytest.approx(60.0)
    assert l4.tflops["bf16"] == pytest.approx(121.0)
    assert l4.tflops["fp8"] == pytest.approx(242.5)
    assert l4.dram_gbps == 300.0


# FP8 tensor math came with Ada (SM 8.9), Hopper and CDNA3; Volta and Turing have no BF16 or TF32, CDNA2 no TF32.
NO_FP8 = ("A100-40GB", "A100-80GB", "A800-40GB", "A800-80GB", "A10", "A10G", "A40", "RTX-A6000", "RTX-3090", "T4")
NO_FP8 += ("V100", "MI250X", "cpu")


def test_fp8_only_where_it_exists() -> None:
    for name in NO_FP8:
        assert "fp8" not in DEVICE_SPECS[name].tflops, name
    for name in set(REQUIRED) - set(NO_FP8):
        assert "fp8" in DEVICE_SPECS[name].tflops, name
    for name in ("V100", "T4"):
        assert "bf16" not in DEVICE_SPECS[name].tflops and "tf32" not in DEVICE_SPECS[name].tflops, name
    assert "tf32" not in DEVICE_SPECS["MI250X"].tflops


def test_the_hip_blas_workspace_follows_the_amd_architecture() -> None:
    # hipBLAS takes 128 MiB per handle on gfx94x (MI300X, MI325X), 32 MiB on the MI250X's gfx90a.
    assert DEVICE_SPECS["MI300X"].blas_workspace_bytes == DEVICE_SPECS["MI325X"].blas_workspace_bytes == 128 * 2**20
    assert DEVICE_SPECS["MI250X"].blas_workspace_bytes == 32 * 2**20
    assert DEVICE_SPECS["RTX-5090"].blas_workspace_bytes == 32 * 2**20  # SM 12.0: torch's :4096:8
    assert DEVICE_SPECS["T4"].blas_workspace_bytes == 2 * 4096 * 1024 + 8 * 16 * 1024


@pytest.mark.parametrize("name", [n for n in REQUIRED if n != "cpu"])
def test_tensor_figures_are_ordered(name: str) -> None:
    # Sanity against typos: low-precision tensor math is never slower than FP32 vector math, and bf16/fp16
    # are at least tf32 where the part has them. (L40S prints bf16 362.05 but fp8 733, hence the 2% slack.)
    t = DEVICE_SPECS[name].tflops
    assert t["fp16"] >= t["fp32"]
    if "tf32" in t:
        assert t["tf32"] >= t["fp32"]
        assert t["fp16"] >= t["tf32"]
    if "fp8" in t:
        assert t["fp8"] == pytest.approx(2 * t["fp16"], rel=0.02)


def test_cpu_entry() -> None:
    cpu = DEVICE_SPECS["cpu"]
    assert not cpu.is_cuda
    assert cpu.allocator_rounding == 1
    expected_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert cpu.memory_bytes == expected_bytes
    assert cpu.tflops["fp32"] == pytest.approx(0.2)
    assert cpu.dram_gbps == 20.0


def test_table_is_read_only() -> None:
    with pytest.raises(TypeError):
        DEVICE_SPECS["H100-SXM"].tflops["bf16"] = 1.0  # type: ignore[index]
    with pytest.raises(TypeError):
        DEVICE_SPECS["fake"] = DEVICE_SPECS["cpu"]  # type: ignore[index]


# --- DeviceSpec behaviour ---------------------------------------------------------------------------


def test_memory_bytes() -> None:
    assert DEVICE_SPECS["H100-SXM"].memory_bytes == 80 * 2**30
    assert DEVICE_SPECS["V100"].memory_bytes == 32 * 2**30


@pytest.mark.parametrize(("nbytes", "expected"), [(0, 0), (1, 512), (511, 512), (512, 512), (513, 1024)])
def test_round_bytes_cuda(nbytes: int, expected: int) -> None:
    assert DEVICE_SPECS["H100-SXM"].round_bytes(nbytes) == expected


@pytest.mark.parametrize("nbytes", [0, 1, 7, 512, 513, 10**9 + 3])
def test_round_bytes_cpu_is_identity(nbytes: int) -> None:
    assert DEVICE_SPECS["cpu"].round_bytes(nbytes) == nbytes


def test_round_bytes_rejects_negative() -> None:
    with pytest.raises(ValueError, match="negative"):
        DEVICE_SPECS["A100-40GB"].round_bytes(-1)


def test_peak_tflops_mapping() -> None:
    h100 = DEVICE_SPECS["H100-SXM"]
    assert h100.peak_tflops(torch.float32) == pytest.approx(67.0)
    assert h100.peak_tflops(torch.float32, tf32=True) == pytest.approx(494.7)
    assert h100.peak_tflops(torch.float64) == pytest.approx(67.0)
    assert h100.peak_tflops(torch.bfloat16) == pytest.approx(989.4)
    assert h100.peak_tflops(torch.float16) == pytest.approx(989.4)
    assert h100.peak_tflops(torch.float8_e4m3fn) == pytest.approx(1978.9)
    assert h100.peak_tflops(torch.float8_e5m2) == pytest.approx(1978.9)
    # Index and mask dtypes use the fp32 figure.
    assert h100.peak_tflops(torch.int64) == pytest.approx(67.0)
    assert h100.peak_tflops(torch.bool) == pytest.approx(67.0)
    assert h100.peak_tflops(torch.uint8) == pytest.approx(67.0)
    # Complex dtypes use their real component's figure.
    assert h100.peak_tflops(torch.complex64) == pytest.approx(67.0)
    assert h100.peak_tflops(torch.complex64, tf32=True) == pytest.approx(494.7)


def test_peak_tflops_fallbacks() -> None:
    v100 = DEVICE_SPECS["V100"]
    # No BF16, TF32 or FP8 on Volta: fall back to the FP32 figure.
    assert v100.peak_tflops(torch.bfloat16) == pytest.approx(15.7)
    assert v100.peak_tflops(torch.float32, tf32=True) == pytest.approx(15.7)
    assert v100.peak_tflops(torch.float8_e4m3fn) == pytest.approx(15.7)
    assert v100.peak_tflops(torch.float16) == pytest.approx(125.0)
    assert v100.peak_tflops(torch.float64) == pytest.approx(7.8)
    # No published FP64 figure: fp32 / 64.
    assert DEVICE_SPECS["L4"].peak_tflops(torch.float64) == pytest.approx(30.3 / 64)
    # A100 has TF32 but no FP8.
    a100 = DEVICE_SPECS["A100-40GB"]
    assert a100.peak_tflops(torch.float32, tf32=True) == pytest.approx(156.0)
    assert a100.peak_tflops(torch.float8_e5m2) == pytest.approx(19.5)
    # CPU: no fp16 figure.
    assert DEVICE_SPECS["cpu"].peak_tflops(torch.float16) == pytest.approx(0.2)


@pytest.mark.parametrize("name", sorted(DEVICE_SPECS))
def test_json_round_trip(name: str) -> None:
    spec = DEVICE_SPECS[name]
    restored = DeviceSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert restored == spec
    assert restored.memory_bytes == spec.memory_bytes
    assert dict(restored.tflops) == dict(spec.tflops)
    assert hash(restored) == hash(spec)


def test_from_dict_rejects_bad_keys() -> None:
    d = DEVICE_SPECS["L4"].to_dict()
    with pytest.raises(ValueError, match="unexpected keys"):
        DeviceSpec.from_dict({**d, "sm_count": 58})
    del d["dram_gbps"]
    with pytest.raises(ValueError, match="missing keys.*dram_gbps"):
        DeviceSpec.from_dict(d)


def test_spec_validation() -> None:
    base: dict[str, Any] = {
        "name": "x",
        "memory_gib": 1.0,
        "tflops": {"fp32": 1.0},
        "dram_gbps": 1.0,
        "allocator_rounding": 1,
        "is_cuda": False,
    }
    DeviceSpec(**base)
    with pytest.raises(ValueError, match="fp32"):
        DeviceSpec(**{**base, "tflops": {"bf16": 1.0}})
    with pytest.raises(ValueError, match="int8"):
        DeviceSpec(**{**base, "tflops": {"fp32": 1.0, "int8": 2.0}})
    with pytest.raises(ValueError, match="memory_gib"):
        DeviceSpec(**{**base, "memory_gib": 0})
    with pytest.raises(ValueError, match="allocator_rounding"):
        DeviceSpec(**{**base, "allocator_rounding": 0})


def test_spec_does_not_alias_caller_dict() -> None:
    tflops = {"fp32": 1.0}
    spec = DeviceSpec(name="x", memory_gib=1, tflops=tflops, dram_gbps=1, allocator_rounding=1, is_cuda=False)
    tflops["fp32"] = 99.0
    assert spec.tflops["fp32"] == 1.0
    assert isinstance(spec.memory_gib, float)


# --- detection --------------------------------------------------------------------------------------


def test_detect_device_without_cuda_is_cpu() -> None:
    assert not torch.cuda.is_available()  # this machine has no GPU
    assert detect_device() is DEVICE_SPECS["cpu"]


def test_detect_device_fake_h100(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, "NVIDIA H100 80GB HBM3", 85520809984)
    spec = detect_device()
    h100 = DEVICE_SPECS["H100-SXM"]
    assert spec.is_cuda
    assert spec.name == "NVIDIA H100 80GB HBM3"
    assert spec.memory_bytes == 85520809984
    assert spec.memory_gib == pytest.approx(79.6474609375)
    assert spec.tflops == h100.tflops
    assert spec.dram_gbps == h100.dram_gbps
    assert spec.allocator_rounding == 512
    assert spec.peak_tflops(torch.bfloat16) == pytest.approx(989.4)
    # SM 9.0: torch's cuBLAS workspace is :4096:8, eight 4 MiB chunks.
    assert spec.compute_capability == (9, 0) and spec.blas_workspace_bytes == 8 * 4096 * 1024
    assert get_device_spec("auto") == spec
    # The detected spec serializes like any other.
    assert DeviceSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


# Near names each reach their own entry: L4 / L40 / L40S, H20 / H200 / GH200, A10 / A10G / A100, B200 / GB200.
@pytest.mark.parametrize(
    ("driver_name", "entry"),
    [
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40", "L40"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("Tesla V100-SXM2-32GB", "V100"),
        ("AMD Instinct MI300X", "MI300X"),
        ("Tesla T4", "T4"),
        ("NVIDIA A40", "A40"),
        ("NVIDIA RTX A6000", "RTX-A6000"),
        ("NVIDIA GeForce RTX 3090", "RTX-3090"),
        ("NVIDIA GeForce RTX 5090", "RTX-5090"),
        ("NVIDIA H800", "H800"),
        ("NVIDIA H800 PCIe", "H100-PCIe"),
        ("NVIDIA A800-SXM4-80GB", "A800-80GB"),
        ("NVIDIA A800 80GB PCIe", "A800-80GB"),
        ("NVIDIA A800-PCIE-40GB", "A800-40GB"),
        ("NVIDIA H20", "H20"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("NVIDIA GH200 144G HBM3e", "H200"),
        ("NVIDIA B100", "B100"),
        ("NVIDIA GB200", "GB200"),
        ("AMD Instinct MI250X", "MI250X"),
        ("AMD Instinct MI325X", "MI325X"),
    ],
)
def test_detect_device_matches_driver_names(monkeypatch: pytest.MonkeyPatch, driver_name: str, entry: str) -> None:
    assert driver_name_entry(driver_name) == entry
    _fake_cuda(monkeypatch, driver_name, 20 * 2**30)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a matched name must not warn
        spec = detect_device()
    assert spec.name == driver_name
    assert spec.memory_bytes == 20 * 2**30
    assert spec.tflops == DEVICE_SPECS[entry].tflops
    assert spec.dram_gbps == DEVICE_SPECS[entry].dram_gbps
    assert spec.is_cuda


# Names the table has no entry for, though they contain one's number: the fallback (with its warning), not a guess.
NO_ENTRY = ["NVIDIA RTX A4000", "NVIDIA T400", "NVIDIA GeForce RTX 3090 Ti", "NVIDIA RTX 6000 Ada Generation"]


@pytest.mark.parametrize("driver_name", NO_ENTRY)
def test_a_driver_name_of_no_entry_gets_the_fallback_and_a_warning(monkeypatch, driver_name):
    assert driver_name_entry(driver_name) is None
    _fake_cuda(monkeypatch, driver_name, 16 * 2**30)
    with pytest.warns(UserWarning, match="No device table entry"):
        spec = detect_device()
    assert spec.tflops == DEVICE_SPECS["A100-40GB"].tflops


def test_detect_device_unknown_gpu_warns_and_uses_default(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, "NVIDIA GeForce GTX 1080", 8 * 2**30)
    with pytest.warns(UserWarning, match="GTX 1080.*A100-40GB"):
        spec = detect_device()
    assert spec.name == "NVIDIA GeForce GTX 1080"
    assert spec.memory_bytes == 8 * 2**30
    assert spec.tflops == DEVICE_SPECS["A100-40GB"].tflops
    assert spec.is_cuda


FAMILIES = [
    ("H100", ["H100-PCIe", "H100-SXM"]),
    ("a100", ["A100-40GB", "A100-80GB"]),
    ("A800", ["A800-40GB", "A800-80GB"]),
    ("MI300", ["MI300X"]),  # a family of one is listed, not taken for its member
    ("RTX", ["RTX-3090", "RTX-4090", "RTX-5090", "RTX-A6000"]),
]


@pytest.mark.parametrize(("name", "family"), FAMILIES)
def test_a_family_name_lists_its_devices_and_picks_none(name, family):
    # The CLI once suggested V100 for "H100" and "A100" (the nearest spelling): a plan for the wrong card.
    assert device_family(name) == family
    with pytest.raises(UnknownDeviceError, match="is not a full device name") as info:
        get_device_spec(name)
    message = str(info.value)
    assert all(f"{n} ({DEVICE_SPECS[n].memory_gib:g} GiB)" in message for n in family) and "V100" not in message


def test_a_prefix_inside_a_model_number_is_no_family():
    # "A10" and "L40" are entries of their own; "H20" is not the start of "H200", nor "V10" of "V100".
    assert device_family("A10") == device_family("L40") == device_family("H20") == device_family("V10") == []
    assert device_family("H100-SXM") == [] and device_family("x") == []
    assert get_device_spec("A10").name == "A10" and get_device_spec("L40").name == "L40"
