"""The step ``lightning-sac plan`` dry-runs: the optimizer and the loss it plans, named in the header, and their bytes.

The optimizer's state is exact arithmetic: AdamW keeps two moments of each trainable parameter's size, in fp32, and
a scalar step counter per parameter, which a GPU target keeps on the host (not in device memory) and the CPU target
counts as a 4-byte tensor; SGD with momentum keeps one buffer per parameter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lightning_sac import Plan, profile_model
from lightning_sac.cli.main import main

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30

# Two MLP blocks whose parameter tensors are multiples of 512 bytes, so that the CUDA allocator's rounding adds
# nothing: the optimizer state is 2 x 4 bytes x parameters on a GPU target, to the byte.
FACTORY = """\
import torch
from torch import nn

D, H = 128, 256


def model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D)) for _ in range(2)])


def make():
    return model(), (torch.randn(1024, D),)


def with_own_step():
    net = model()
    return net, (torch.randn(1024, D),), lambda out: out.square().mean(), lambda ps: torch.optim.SGD(ps, momentum=0.9)
"""
N_PARAMS = 2 * (128 * 256 + 256 + 256 * 128 + 128)
N_TENSORS = 8  # two Linear layers of two blocks, a weight and a bias each


def _env() -> dict[str, str]:
    # This checkout's package, whatever the installed (editable) package points to.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``tmp_path`` as the current folder, holding ``mlp_factory.py``; the import it leaves is undone after."""
    (tmp_path / "mlp_factory.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # main puts the current folder on it, as `python -m` does
    monkeypatch.delitem(sys.modules, "mlp_factory", raising=False)
    yield tmp_path
    sys.modules.pop("mlp_factory", None)


def _plan(capsys: pytest.CaptureFixture[str], folder: Path, name: str, *flags: str) -> tuple[str, dict, Plan]:
    """``main(plan ...)`` in this process: what it printed, the profile and the plan it wrote."""
    profile, plan = folder / f"{name}.profile.json", folder / f"{name}.plan.json"
    argv = ["plan", "--budget-gb", "1", "--profile-json", str(profile), "--json", str(plan), *flags]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    return out, json.loads(profile.read_text()), Plan.from_json(plan.read_text())


def _adamw_state_bytes(step_counter_bytes: int) -> int:
    return 2 * 4 * N_PARAMS + step_counter_bytes * N_TENSORS


@pytest.mark.parametrize(("device", "step_counter_bytes"), [("H100-SXM", 0), ("cpu", 4)])
def test_adamw_adds_its_state_to_the_unplanned_peak(here, capsys, device, step_counter_bytes):
    base = ["mlp_factory:make", "--device", device, "--loss", "sum"]
    out, adamw, adamw_plan = _plan(capsys, here, "adamw", *base)  # adamw is the default
    assert out.splitlines()[0] == "training step: AdamW (torch defaults), loss = output.sum()"
    none_out, none, none_plan = _plan(capsys, here, "none", *base, "--optimizer", "none")
    assert none_out.splitlines()[0].startswith("training step: no optimizer (--optimizer none")
    state = _adamw_state_bytes(step_counter_bytes)
    assert adamw["modules"][""]["optimizer_state_bytes"] == state
    assert adamw["peak_bytes"] - none["peak_bytes"] == state
    assert adamw_plan.unconstrained_peak_bytes - none_plan.unconstrained_peak_bytes == state
    assert adamw["peak_breakdown"]["optimizer_state"] == state and none["peak_breakdown"]["optimizer_state"] == 0


def test_the_factory_s_optimizer_and_loss_win_unless_a_flag_says_otherwise(here, capsys):
    out, own, _ = _plan(capsys, here, "own", "mlp_factory:with_own_step", "--device", "H100-SXM")
    assert out.splitlines()[0] == "training step: the factory's optimizer_factory (SGD), loss = the factory's loss_fn"
    # SGD with momentum: one buffer per parameter, and no step counter.
    assert own["modules"][""]["optimizer_state_bytes"] == 4 * N_PARAMS
    out, flagged, _ = _plan(
        capsys, here, "flagged", "mlp_factory:with_own_step", "--device", "H100-SXM", "--optimizer", "adamw"
    )
    assert out.splitlines()[0] == (
        "training step: AdamW (torch defaults, by --optimizer instead of the factory's optimizer_factory), "
        "loss = the factory's loss_fn"
    )
    assert flagged["peak_bytes"] - own["peak_bytes"] == 2 * 4 * N_PARAMS - 4 * N_PARAMS
    out, _, _ = _plan(capsys, here, "summed", "mlp_factory:with_own_step", "--device", "H100-SXM", "--loss", "sum")
    assert out.splitlines()[0] == (
        "training step: the factory's optimizer_factory (SGD), loss = output.sum() (by --loss instead of the "
        "factory's loss_fn)"
    )
    # The same numbers as the Python API given the same step.
    import mlp_factory
    import torch

    net, inputs, loss_fn, _ = mlp_factory.with_own_step()
    direct = profile_model(
        net, inputs, loss_fn=loss_fn, optimizer_factory=lambda ps: torch.optim.AdamW(ps), device="H100-SXM"
    )
    assert direct.peak_bytes == flagged["peak_bytes"]


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out.count("\n") == 0 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_an_output_without_a_loss_asks_for_one(here, capsys):
    err = _error(capsys, ["plan", "mlp_factory:make", "--budget-gb", "1", "--device", "H100-SXM"])
    assert "the model's output (a Tensor) has no .loss" in err and "type --loss sum" in err
    err = _error(
        capsys, ["plan", "mlp_factory:make", "--budget-gb", "1", "--device", "H100-SXM", "--loss", "output.loss"]
    )
    assert "--loss output.loss: the model returned a Tensor with no scalar .loss" in err
    assert not list(here.glob("*.json"))


def test_a_model_and_no_model(here, capsys):
    err = _error(capsys, ["plan", "--budget-gb", "1"])
    assert "no model to plan: give MODULE:FACTORY" in err and "--hf-config" in err
    err = _error(capsys, ["plan", "mlp_factory:make", "--hf-config", "config.json", "--budget-gb", "1"])
    assert "not both" in err
    err = _error(capsys, ["plan", "mlp_factory:make", "--batch", "8", "--budget-gb", "1"])
    assert "--batch describe(s) the model of --hf-config, which is not given" in err


@pytest.mark.slow  # two starts of the entry point, about 10 s of CPU each
def test_through_python_m_lightning_sac(tmp_path):
    (tmp_path / "mlp_factory.py").write_text(FACTORY)

    def run(optimizer: str) -> tuple[str, dict]:
        args = ["plan", "mlp_factory:make", "--budget-gb", "1", "--device", "H100-SXM", "--loss", "sum"]
        args += ["--optimizer", optimizer, "--profile-json", f"{optimizer}.json"]
        done = subprocess.run(
            [sys.executable, "-m", "lightning_sac", *args],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout, json.loads((tmp_path / f"{optimizer}.json").read_text())

    with ThreadPoolExecutor(max_workers=2) as pool:
        (adamw_out, adamw), (none_out, none) = pool.map(run, ["adamw", "none"])
    assert adamw_out.splitlines()[0] == "training step: AdamW (torch defaults), loss = output.sum()"
    assert none_out.splitlines()[0].startswith("training step: no optimizer")
    assert adamw["peak_bytes"] - none["peak_bytes"] == _adamw_state_bytes(0)
