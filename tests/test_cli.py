"""The command line: its numbers are solve_plan's on the same factory; devices; errors."""

from __future__ import annotations

import subprocess
import sys

from lightning_sac import Plan, profile_model, solve_plan
from lightning_sac.cli import gather_devices, main, render_devices
from lightning_sac.demos import gpt_example
from lightning_sac.devices import known_devices
from lightning_sac.recompute import recompute_ms

FACTORY = "lightning_sac.demos:gpt_example"


def test_plan_command_numbers_equal_solve_plan(tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = ["plan", FACTORY, "--budget-gb", "6", "--device", "H100-SXM", "--world-size", "8", "--sharding", "sharded"]
    assert main([*argv, "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    cli = Plan.from_json(path.read_text())
    model, inputs, loss_fn, optimizer_factory = gpt_example()
    profile = profile_model(model, inputs, loss_fn=loss_fn, optimizer_factory=optimizer_factory, device="H100-SXM")
    direct = solve_plan(profile, 6, world_size=8, sharding="sharded")
    assert cli.decisions == direct.decisions and cli.decisions
    assert (cli.predicted_peak_bytes, cli.unconstrained_peak_bytes) == (
        direct.predicted_peak_bytes,
        direct.unconstrained_peak_bytes,
    )
    assert cli.predicted_recompute_ms == direct.predicted_recompute_ms
    assert f"peak {direct.predicted_peak_bytes / 2**30:.3f} GiB" in printed
    assert "world size 8 (sharded)" in printed
    # --backend: the plan for that backend (SAC's recompute also brings back a copy of a module's output, the
    # graph backend's does not, so the choice may differ), and under one policy graph reruns no more than SAC.
    assert main([*argv, "--backend", "graph", "--json", str(path)]) == 0
    graph = Plan.from_json(path.read_text())
    direct_graph = solve_plan(profile, 6, world_size=8, sharding="sharded", backend="graph")
    assert graph.backend == "graph" and graph.decisions == direct_graph.decisions and graph.decisions
    assert graph.predicted_peak_bytes <= graph.budget_bytes
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


def test_errors_exit_2_with_a_message(capsys):
    assert main(["plan", "no-colon", "--budget-gb", "1"]) == 2
    assert "Expected MODULE:FACTORY" in capsys.readouterr().err
    assert main(["plan", FACTORY, "--budget-gb", "0.01", "--device", "H100-SXM"]) == 2
    assert "below the minimum achievable peak" in capsys.readouterr().err
    assert main(["plan", FACTORY, "--budget-gb", "1", "--device", "H900"]) == 2
    assert "H100-SXM" in capsys.readouterr().err


def test_a_factory_may_return_a_keyword_batch(tmp_path, capsys):
    factory = tmp_path / "hf_factory.py"
    factory.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})\n"
        "from zoo import gpt2\n"
        "def make():\n"
        "    family = gpt2()\n"
        "    return family.model, family.batch\n"
    )
    path = tmp_path / "plan.json"
    assert main(["plan", f"{factory}:make", "--budget-gb", "0.012", "--device", "cpu", "--json", str(path)]) == 0
    plan = Plan.from_json(path.read_text())
    assert plan.decisions and plan.predicted_peak_bytes <= plan.budget_bytes and plan.kv_cache_off
