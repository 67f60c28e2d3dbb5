"""The command line: its numbers are solve_plan's on the same factory; devices; and every wrong input answered with
one line on stderr, exit code 2 and no traceback, through the installed ``lightning-sac`` entry point."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import lightning_sac.profiling
from lightning_sac import ModelProfile, Plan, profile_model, solve_plan
from lightning_sac.cli.args import UsageError
from lightning_sac.cli.main import gather_devices, main, render_devices
from lightning_sac.demos import gpt_example
from lightning_sac.devices import known_devices
from lightning_sac.sharding.declared import declared_layout
from lightning_sac.solver.recompute import recompute_ms

FACTORY = "lightning_sac.demos:gpt_example"
REPO = Path(__file__).resolve().parents[1]
CLI = shutil.which("lightning-sac")
GIB, MIB = 2**30, 2**20
Run = tuple[int, str, str]  # exit code, stdout, stderr

# A factory in the current folder, loaded as `python -m` would: `tiny_factory:make`. Four MLP blocks whose
# activations (16 MiB each) dominate their parameters (1 MiB), so that a budget of 50 MiB needs a plan.
TINY = """\
import pathlib
import torch
from torch import nn


def make():
    pathlib.Path("factory_called").touch()  # wrong arguments must be refused before this runs
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(128, 1024), nn.GELU(), nn.Linear(1024, 128)) for _ in range(4)])
    return model, (torch.randn(2048, 128),)


def broken():
    return {}.missing


def bare():
    return nn.Linear(2, 2), torch.randn(1, 2)
"""
# Its output is a tensor with no .loss: the loss to plan is stated.
TINY_PLAN = ["plan", "tiny_factory:make", "--loss", "sum"]

# Each wrong input: the arguments, and what its one line must say.
WRONG = {
    "module not found": (
        ["plan", "tiny_factroy:make", "--budget-gb", "1"],
        ["no module 'tiny_factroy'", "tiny_factory?"],
    ),
    "attribute missing": (
        [*TINY_PLAN[:1], "tiny_factory:mak", "--budget-gb", "1"],
        ["has no 'mak'", "tiny_factory:make?"],
    ),
    "unit string": ([*TINY_PLAN, "--budget-gb", "80GB"], ["number of GiB without a unit", "type --budget-gb 80"]),
    "zero budget": ([*TINY_PLAN, "--budget-gb", "0"], ["above 0", "--budget-gb 40"]),
    "negative budget": ([*TINY_PLAN, "--budget-gb", "-3"], ["above 0", "--budget-gb 40"]),
    "misspelled device": (
        [*TINY_PLAN, "--budget-gb", "1", "--device", "H100-SMX"],
        ["did you mean H100-SXM?", "lightning-sac devices"],
    ),
    "a GPU family, not a GPU": (
        [*TINY_PLAN, "--budget-gb", "1", "--device", "H100"],
        ["the table has H100-PCIe (80 GiB), H100-SXM (80 GiB)", "--device H100-PCIe"],
    ),
    "another GPU family": (
        [*TINY_PLAN, "--budget-gb", "1", "--device", "A100"],
        ["the table has A100-40GB (40 GiB), A100-80GB (80 GiB)", "--device A100-40GB"],
    ),
    "sharded on one device": (
        [*TINY_PLAN, "--budget-gb", "1", "--sharding", "sharded"],
        ["world size is 1", "add --world-size N"],
    ),
    "candidates match nothing": (
        [*TINY_PLAN, "--budget-gb", "1", "--device", "H100-SXM", "--candidates", "blocks.*"],
        ["--candidates blocks.* matches no module", "include 0, 0.0, 0.1", "e.g. --candidates '*'"],
    ),
    "report on a missing file": (["report", "missing.json", "--out", "tb"], ["no file 'missing.json'", "--json FILE"]),
    "a .py as --profile": (
        ["report", "plan.json", "--profile", "tiny_factory.py", "--out", "tb"],
        ["tiny_factory.py is not a profile (not JSON", "--profile-json FILE"],
    ),
}


def _env() -> dict[str, str]:
    # This checkout's package, wherever the installed entry point's (editable) install points.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    assert CLI is not None, "the lightning-sac entry point is not installed (pip install -e .)"
    return subprocess.Popen(
        [CLI, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )


def _prepare(folder: Path) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "tiny_factory.py").write_text(TINY)
    (folder / "plan.json").write_text(Plan(budget_bytes=GIB).to_json())
    return folder


def _error_line(run: Run) -> str:
    """The one line a wrong input gets: exit code 2, nothing else on stderr, no traceback."""
    code, _, err = run
    assert "Traceback" not in err, err
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightning-sac: error: "), err
    return lines[0]


# The checks of each run, shared by the runs in this process (quick) and through the entry point (slow: each
# start of `lightning-sac` imports the package, about 10 s of CPU here).


def _check_wrong(case: str, folder: Path, run: Run) -> None:
    line = _error_line(run)
    for expected in WRONG[case][1]:
        assert expected in line
    assert "below the minimum" not in line and "sharding='sharded'" not in line
    assert run[1] == ""  # nothing printed, nothing written
    assert not (folder / "tb").exists()
    if case != "candidates match nothing":  # that check needs the model's modules, so it runs the factory
        assert not (folder / "factory_called").exists(), "checked after running the factory"


def _check_plan_once(folder: Path, run: Run) -> None:
    code, out, err = run
    assert code == 0, err
    # No --device: one line says so and how to plan for a GPU (a CUDA machine plans for its own GPU).
    assert len(err.splitlines()) == 1 and "planning for this machine's" in err and "(no --device given)" in err
    plan = Plan.from_json((folder / "plan.json").read_text())
    assert plan.decisions and plan.predicted_peak_bytes <= plan.budget_bytes
    assert out.count("discard %") == 2  # the table's header and its legend, once
    assert out.count("peak per device") == 1 and out.count("profile of one training step") == 1
    # One unit on the screen (the model's figures are under 1 GiB) and the peak reads as within the budget.
    assert "GiB" not in out and "MiB" in out
    found = re.search(r": ([\d.]+) MiB of ([\d.]+) MiB budget with the plan \(recompute included\)", out)
    assert found is not None, out
    peak, budget = map(float, found.groups())
    assert peak <= budget == pytest.approx(plan.budget_bytes / MIB, abs=0.05)


def _check_above_memory(run: Run) -> None:
    code, out, err = run
    assert code == 0, err
    assert err.splitlines() == [
        "lightning-sac: warning: --budget-gb 100 is more than the 80.0 GiB of one H100-SXM; a plan for it may not "
        "fit on the device (at most --budget-gb 80)"
    ]
    assert "no module needs checkpointing" in out


def _check_too_small(run: Run) -> str:
    """The budget the one line says to type."""
    line = _error_line(run)
    assert "--budget-gb 0.001 is below the minimum achievable peak of" in line
    assert "--sharding sharded --world-size N" in line and "sharding='sharded'" not in line
    found = re.search(r"type --budget-gb ([\d.]+) or more", line)
    assert found is not None, line
    return found.group(1)


def _check_typed_budget(folder: Path, run: Run) -> None:
    assert run[0] == 0, run[2]
    plan = Plan.from_json((folder / "plan.json").read_text())
    assert plan.decisions and plan.predicted_peak_bytes <= plan.budget_bytes


PLAN_ONCE = [*TINY_PLAN, "--budget-gb", "0.05", "--json", "plan.json"]
TOO_SMALL = [*TINY_PLAN, "--budget-gb", "0.001", "--device", "H100-SXM"]
ABOVE_MEMORY = [*TINY_PLAN, "--budget-gb", "100", "--device", "H100-SXM"]


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``tmp_path`` as the current folder, with the tiny factory in it; the import it leaves is undone after."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # main puts the current folder on it, as `python -m` does
    monkeypatch.delitem(sys.modules, "tiny_factory", raising=False)
    yield _prepare(tmp_path)
    sys.modules.pop("tiny_factory", None)


def _main(capsys: pytest.CaptureFixture[str], argv: list[str]) -> Run:
    """``main(argv)`` in this process: exit code, stdout, stderr."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("case", list(WRONG))
def test_a_wrong_input_gets_one_line_exit_2_and_no_traceback(here, capsys, case):
    _check_wrong(case, here, _main(capsys, WRONG[case][0]))


def test_plan_printed_once_says_which_device_and_reads_within_budget(here, capsys):
    _check_plan_once(here, _main(capsys, PLAN_ONCE))


def test_a_budget_above_the_device_memory_warns(here, capsys):
    _check_above_memory(_main(capsys, ABOVE_MEMORY))


def test_a_budget_below_the_minimum_says_what_to_type_in_cli_syntax(here, capsys):
    typed = _check_too_small(_main(capsys, TOO_SMALL))
    _check_typed_budget(
        here, _main(capsys, [*TINY_PLAN, "--budget-gb", typed, "--device", "H100-SXM", "--json", "plan.json"])
    )


# Every wrong input's line is checked in-process above; through the entry point, one of each stage that can refuse:
# the factory, the device, the arguments' combination, the report command (each start imports torch: about 4 s).
ENTRY_POINT_WRONG = ("module not found", "misspelled device", "sharded on one device", "report on a missing file")


@pytest.fixture(scope="module")
def entry_point_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Run]]:
    """Runs above again through the installed entry point, each in its own folder, one per CPU at a time."""
    root = tmp_path_factory.mktemp("cli")
    jobs = {name: WRONG[name][0] for name in ENTRY_POINT_WRONG}
    jobs.update({"plan once": PLAN_ONCE, "too small": TOO_SMALL, "above memory": ABOVE_MEMORY})

    def run(name: str) -> tuple[Path, Run]:
        folder = _prepare(root / re.sub(r"\W+", "_", name))
        process = _start(jobs[name], folder)
        out, err = process.communicate(timeout=900)
        return folder, (process.returncode, out, err)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return dict(zip(jobs, pool.map(run, jobs), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("case", [*ENTRY_POINT_WRONG, "plan once", "above memory", "too small"])
def test_through_the_entry_point_in_a_temporary_folder(entry_point_runs, case):
    folder, run = entry_point_runs[case]
    if case in WRONG:
        _check_wrong(case, folder, run)
    elif case == "plan once":
        _check_plan_once(folder, run)
    elif case == "above memory":
        _check_above_memory(run)
    else:
        typed = _check_too_small(run)
        process = _start([*TINY_PLAN, "--budget-gb", typed, "--device", "H100-SXM", "--json", "plan.json"], folder)
        out, err = process.communicate(timeout=900)
        _check_typed_budget(folder, (process.returncode, out, err))


@pytest.mark.slow  # two dry runs of the demo GPT; the plan command's output is checked quick by the tests above
def test_plan_command_numbers_equal_solve_plan(tmp_path, capsys, monkeypatch):
    path = tmp_path / "plan.json"
    argv = ["plan", FACTORY, "--budget-gb", "7.5", "--device", "H100-SXM", "--world-size", "8", "--sharding", "sharded"]
    assert main([*argv, "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    cli = Plan.from_json(path.read_text())
    model, inputs, loss_fn, optimizer_factory = gpt_example()
    profile = profile_model(model, inputs, loss_fn=loss_fn, optimizer_factory=optimizer_factory, device="H100-SXM")
    direct = solve_plan(profile, 7.5, world_size=8, sharding="sharded")
    assert cli.decisions == direct.decisions and cli.decisions
    assert (cli.predicted_peak_bytes, cli.unconstrained_peak_bytes) == (
        direct.predicted_peak_bytes,
        direct.unconstrained_peak_bytes,
    )
    assert cli.predicted_recompute_ms == direct.predicted_recompute_ms
    device_total = direct.predicted_peak_bytes + sum(direct.reserve.values())  # the peak the budget bounds
    assert f"{device_total / GIB:.3f} GiB of 7.500 GiB budget with the plan" in printed
    assert f"tensors at the peak {profile.peak_bytes / GIB:.3f} GiB" in printed  # one device, whole model
    assert "world size 8, sharded" in printed and "(sharded, world size 8)" in printed
    # The budget keeps the device's reserve (CUDA context, NCCL on 8 ranks, cuBLAS, fragmentation): said, in GiB.
    assert cli.reserve == direct.reserve and cli.reserve["nccl_bytes"] == 1088 * 2**20
    assert f"the tensors get {cli.tensor_budget_bytes / GIB:.3f} GiB" in printed
    assert printed.count("AutoSAC") == 0 and printed.count("recompute ms") == 2  # header, legend: once
    # --backend: the plan for that backend (SAC's recompute also brings back a copy of a module's output, the
    # graph backend's does not, so the choice may differ), and under one policy graph reruns no more than SAC.
    # The dry run is the one above (the CLI's equals it): not made a third time.
    monkeypatch.setattr(
        lightning_sac.profiling, "profile_model", lambda *_, **__: ModelProfile.from_json(profile.to_json())
    )
    assert main([*argv, "--backend", "graph", "--json", str(path)]) == 0
    graph = Plan.from_json(path.read_text())
    direct_graph = solve_plan(profile, 7.5, world_size=8, sharding="sharded", backend="graph")
    assert graph.backend == "graph" and graph.decisions == direct_graph.decisions and graph.decisions
    assert graph.predicted_peak_bytes <= graph.tensor_budget_bytes
    for fqn, d in cli.decisions.items():
        stats = profile.modules[fqn].op_stats
        assert recompute_ms(stats, d.op_policy, "graph") <= d.recompute_ms


def test_devices_command_lists_the_table():
    specs = gather_devices()
    assert [s.name for s in specs] == known_devices()
    text = render_devices(specs)
    assert "H100-SXM" in text and "989.4" in text and "MI300X" in text
    out = subprocess.run([sys.executable, "-m", "lightning_sac", "devices"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == text


def _in_process(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """``main(argv)``'s one error line, run in this process."""
    return _error_line(_main(capsys, argv))


def test_more_wrong_inputs(here, capsys):
    tmp_path = here
    assert "expected MODULE:FACTORY, got 'no-colon'" in _in_process(capsys, ["plan", "no-colon", "--budget-gb", "1"])
    line = _in_process(capsys, ["plan", "tiny_factory.py", "--budget-gb", "1"])
    assert "e.g. lightning-sac plan tiny_factory.py:make" in line
    assert "type --budget-gb 0.4883" in _in_process(capsys, [*TINY_PLAN, "--budget-gb", "500MiB"])
    assert "got 'lots'" in _in_process(capsys, [*TINY_PLAN, "--budget-gb", "lots"])
    assert "at least 1, got 0" in _in_process(capsys, [*TINY_PLAN, "--budget-gb", "1", "--world-size", "0"])
    line = _in_process(capsys, [*TINY_PLAN, "--budget-gb", "1", "--device", "H900x"])
    assert "unknown device 'H900x'" in line
    line = _in_process(capsys, [*TINY_PLAN, "--budget-gb", "1", "--device", "zzz"])
    assert "H100-SXM" in line and "MI300X" in line  # no close match: the known names
    assert "no folder 'out'" in _in_process(capsys, [*TINY_PLAN, "--budget-gb", "1", "--json", "out/plan.json"])
    assert "tiny_factory.py is not a plan (not JSON" in _in_process(
        capsys, ["report", "tiny_factory.py", "--out", "tb"]
    )
    line = _in_process(capsys, ["report", "plan.json", "--profile", "plan.json", "--out", "tb"])
    assert "plan.json is not a profile (its keys: backend, budget_bytes" in line
    assert not (tmp_path / "factory_called").exists() and not (tmp_path / "tb").exists()
    line = _in_process(capsys, ["plan", "tiny_factory:broken", "--budget-gb", "1", "--device", "H100-SXM"])
    where = f"tiny_factory.py:{TINY.splitlines().index('    return {}.missing') + 1}"
    assert "tiny_factory:broken() raised AttributeError" in line and where in line and "--debug" in line
    line = _in_process(capsys, ["plan", "tiny_factory:bare", "--budget-gb", "1", "--loss", "sum"])
    assert "returned a Tensor as the example inputs" in line and "return (x,)" in line  # exit 2, as the others
    # --debug: the traceback instead of the line.
    with pytest.raises(UsageError) as raised:
        main(["plan", "tiny_factory:broken", "--budget-gb", "1", "--device", "H100-SXM", "--debug"])
    assert isinstance(raised.value.__cause__, AttributeError)  # Python prints the factory's traceback above it
    # argparse's own errors: one line too, and where the help is.
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "tiny_factory:make"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "lightning-sac plan: error: the following arguments are required: --budget-gb (see: lightning-sac plan --help)"
    ]


def test_candidates_that_no_plan_may_checkpoint(here, capsys):
    # 0.0 is a Linear layer: it matches, but a single layer frees nothing under checkpointing.
    line = _in_process(capsys, [*TINY_PLAN, "--budget-gb", "0.05", "--device", "H100-SXM", "--candidates", "0.0"])
    assert "no module matching --candidates 0.0 can be checkpointed" in line and "modules that can: 0, 1, 2" in line


def test_a_factory_may_return_a_keyword_batch(tmp_path, capsys):
    factory = tmp_path / "hf_factory.py"
    factory.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from zoo import gpt2\n"
        "def make():\n"
        "    family = gpt2()\n"
        "    return family.model, family.batch\n"
    )
    path = tmp_path / "plan.json"
    assert main(["plan", f"{factory}:make", "--budget-gb", "0.012", "--device", "cpu", "--json", str(path)]) == 0
    plan = Plan.from_json(path.read_text())
    assert plan.decisions and plan.predicted_peak_bytes <= plan.budget_bytes and plan.kv_cache_off


@pytest.mark.slow  # three plans of the demo GPT; the units themselves: tests/test_declared_units.py
def test_fsdp_units_count_what_each_unit_gathers(tmp_path, capsys):
    # The demo GPT sharded per block over 8 devices: the plan counts each block's gathered parameters as FSDP2
    # holds them, on top of the evenly divided states, and equals solve_plan on the same profile with the units.
    path = tmp_path / "plan.json"
    argv = ["plan", FACTORY, "--budget-gb", "7.5", "--device", "H100-SXM", "--fsdp", "8"]
    model, inputs, loss_fn, optimizer_factory = gpt_example()
    blocks = len(model.blocks)
    assert main([*argv, "--fsdp-units", "blocks.*", "--json", str(path)]) == 0
    err = capsys.readouterr().err
    assert f"FSDP2 over 8 devices: {blocks + 1} units ({blocks} modules matching --fsdp-units, and the root" in err
    with_units = Plan.from_json(path.read_text())
    profile = profile_model(model, inputs, loss_fn=loss_fn, optimizer_factory=optimizer_factory, device="H100-SXM")
    profile.sharded = declared_layout(model, ["blocks.*"], 8)
    direct = solve_plan(profile, 7.5, world_size=8, sharding="sharded")
    assert with_units.decisions == direct.decisions
    assert with_units.unconstrained_peak_bytes == direct.unconstrained_peak_bytes
    # Without units the states are divided and nothing is gathered: less than with them, and said.
    assert main([*argv, "--json", str(path)]) == 0
    assert "sharded without FSDP units" in capsys.readouterr().err
    assert Plan.from_json(path.read_text()).unconstrained_peak_bytes < with_units.unconstrained_peak_bytes


def test_fsdp_units_without_sharding_or_matching_nothing_exit_2(capsys):
    argv = ["plan", FACTORY, "--budget-gb", "7.5", "--device", "H100-SXM"]
    assert main([*argv, "--fsdp-units", "blocks.*"]) == 2
    assert "add --fsdp N" in capsys.readouterr().err
    assert main([*argv, "--fsdp", "4", "--fsdp-units", "layers.*"]) == 2
    assert "'layers.*' name no module of the model" in capsys.readouterr().err
