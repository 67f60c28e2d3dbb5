"""``--device`` on the command line: the API's matcher, worded for the command line.

A family name (``H100``, ``A100``) lists the model's entries with their memory and exits 2 before the factory
runs; it never proposes another GPU by spelling (the CLI once answered ``--device H100`` with V100). Runs go through
the command line's ``main`` (the quick tier) and once through the installed ``lightning-sac`` entry point in a fresh
process (the slow tier, like tests/test_cli.py's entry-point runs).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from lightning_sac.cli.args import UsageError, check_plan_args
from lightning_sac.cli.main import main, plan_command_parser
from lightning_sac.devices import DEVICE_SPECS, UnknownDeviceError, device_mismatch_message, get_device_spec

REPO = Path(__file__).resolve().parents[1]
Run = tuple[int, str, str]  # exit code, stdout, stderr

# The smallest factory the command line accepts; it leaves a file behind when it runs, which a refused
# --device must prevent (the device is checked before the model is built).
FACTORY = """\
import pathlib
import torch


def make():
    pathlib.Path("factory_called").touch()
    return torch.nn.Linear(4, 4), (torch.randn(2, 4),)
"""

# Each family a user types, and the entries the one line must list (with their memory).
FAMILIES = {"H100": ["H100-PCIe", "H100-SXM"], "A100": ["A100-40GB", "A100-80GB"]}


def _env() -> dict[str, str]:
    # This checkout's package first, wherever the installed (editable) package points: PYTHONPATH precedes
    # site-packages for `python -m` and for the entry point's interpreter alike.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _run(command: list[str], folder: Path) -> Run:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiny_devices.py").write_text(FACTORY)
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True, env=_env(), timeout=600)
    return done.returncode, done.stdout, done.stderr


def _plan(device: str) -> list[str]:
    return ["plan", "tiny_devices:make", "--budget-gb", "1", "--device", device]


def _check_family(run: Run, folder: Path, family: list[str]) -> str:
    code, out, err = run
    assert code == 2, err
    assert out == "" and "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightning-sac: error: "), err
    line = lines[0]
    assert f"{family[0]} or {family[1]}?" in line
    listed = ", ".join(f"{n} ({DEVICE_SPECS[n].memory_gib:g} GiB)" for n in family)
    assert f"the table has {listed}" in line
    assert f"--device {family[0]}" in line
    assert "V100" not in line and "did you mean" not in line
    assert not (folder / "factory_called").exists(), "the factory ran before --device was checked"
    return line


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_family_lists_its_entries_and_exits_2(tmp_path, monkeypatch, capsys, name):
    (tmp_path / "tiny_devices.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(_plan(name))
    out, err = capsys.readouterr()
    _check_family((code, out, err), tmp_path, FAMILIES[name])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_api_refuses_the_same_names_with_the_same_candidates(name):
    with pytest.raises(UnknownDeviceError) as raised:
        get_device_spec(name)
    match = raised.value.match
    assert match is not None and match.kind == "family" and list(match.candidates) == FAMILIES[name]
    for entry in FAMILIES[name]:
        assert f"{entry} ({DEVICE_SPECS[entry].memory_gib:g} GiB)" in str(raised.value)
    # The command line's line is the API's match, worded for --device.
    assert device_mismatch_message(match, cli=True).startswith(f"device {name!r} is not a full device name")


def _checked(device: str) -> str:
    """The table entry ``lightning-sac plan ... --device DEVICE`` plans for (the checks only, no profiling)."""
    args = plan_command_parser().parse_args(["tiny_devices:make", "--budget-gb", "1", "--device", device])
    spec, _ = check_plan_args(args)
    return spec.name


def test_fsdp_n_is_world_size_n_sharded():
    parse = plan_command_parser().parse_args
    args = parse(["tiny_devices:make", "--budget-gb", "70", "--device", "H100-SXM", "--fsdp", "8"])
    check_plan_args(args)
    assert (args.world_size, args.sharding) == (8, "sharded")
    for wrong in (["--fsdp", "1"], ["--fsdp", "8", "--world-size", "4"]):
        with pytest.raises(UsageError, match=r"--fsdp \d means FSDP over \d devices"):
            check_plan_args(parse(["tiny_devices:make", "--budget-gb", "70", *wrong]))


@pytest.mark.parametrize(
    ("typed", "entry"),
    [
        ("a100-80", "A100-80GB"),  # an alias: the capacity without its unit
        ("4090", "RTX-4090"),
        ("h100 sxm", "H100-SXM"),
        ("H100 SXM5", "H100-SXM"),
        ("A10", "A10"),  # its own entry, not a prefix of the A100s
        ("a10g", "A10G"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("Tesla T4", "T4"),
    ],
)
def test_names_and_aliases_resolve_as_in_the_api(typed, entry):
    assert _checked(typed) == entry == get_device_spec(typed).name


@pytest.mark.parametrize(
    ("typed", "says", "never"),
    [
        ("H100-80GB", "the table has H100-PCIe (80 GiB), H100-SXM (80 GiB)", "did you mean"),  # both are 80 GB
        ("H100-SMX", "did you mean H100-SXM? Type --device H100-SXM", "PCIe"),  # a variant misspelled
        ("V10", "unknown device 'V10': type one of", "did you mean"),  # not a V100 by spelling
        ("H2", "unknown device 'H2'", "H20?"),
        ("MI300", "the table has MI300X (192 GiB)", "MI325X"),
    ],
)
def test_other_names_get_one_line_and_no_other_gpu(typed, says, never):
    with pytest.raises(UsageError) as raised:
        _checked(typed)
    line = str(raised.value)
    assert says in line and never not in line and "\n" not in line


def test_an_unknown_name_lists_the_table_and_how_to_pass_a_spec():
    with pytest.raises(UsageError) as raised:
        _checked("TPU-v5")
    line = str(raised.value)
    assert all(name in line for name in DEVICE_SPECS)
    assert "DeviceSpec(name=" in line and "did you mean" not in line


@pytest.mark.slow
def test_through_the_installed_entry_point(tmp_path):
    # The console script runs this checkout's code because _env() puts it first on PYTHONPATH (see
    # tests/test_cli.py, which starts the entry point the same way).
    cli = shutil.which("lightning-sac")
    assert cli is not None, "the lightning-sac entry point is not installed (pip install -e .)"
    line = _check_family(_run([cli, *_plan("H100")], tmp_path), tmp_path, FAMILIES["H100"])
    assert line.startswith("lightning-sac: error: device 'H100' is not a full device name")
