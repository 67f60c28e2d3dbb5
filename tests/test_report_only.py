"""``AutoSAC(report_only=True)``: the plan is made and printed, nothing is applied, the fit is a plain fit's."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import test_callback
import torch
from lightning.pytorch.callbacks import Callback

from lightning_sac import AutoSAC, BudgetError, profile_model, solve_plan
from lightning_sac.demos import GPTConfig
from lightning_sac.demos.lightning import GPTModule

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.1)
GIB = 2**30


def module() -> GPTModule:
    pl.seed_everything(0)
    return GPTModule(CONFIG, batch_size=8, n_samples=32)


def trainer(callbacks: list[Callback], root: Path) -> pl.Trainer:
    return test_callback.trainer(callbacks, root, max_steps=3)  # the shared deterministic CPU trainer


def tight_budget_gb() -> float:
    """40% of the way from the minimum achievable peak to the unconstrained one: a plan must checkpoint."""
    m = module()
    idx, targets = next(iter(m.train_dataloader()))
    profile = profile_model(
        m.model,
        (idx,),
        loss_fn=lambda logits: torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()),
        optimizer_factory=lambda ps: torch.optim.AdamW(ps),
        device="cpu",
    )
    with pytest.raises(BudgetError) as info:
        solve_plan(profile, 1e-6)
    lo, hi = info.value.minimum_bytes, info.value.unconstrained_bytes
    return (lo + 0.4 * (hi - lo)) / GIB


def _changed(model: torch.nn.Module) -> list[str]:
    """Modules whose forward is not their class's own (an applied plan replaces the planned modules' forwards)."""
    return [
        name
        for name, m in model.named_modules()
        if "forward" in vars(m) or getattr(m.forward, "__func__", None) is not type(m).forward
    ]


class Probe(Callback):
    """What the model looks like before each training step: changed modules and module types."""

    def __init__(self) -> None:
        self.changed: list[list[str]] = []
        self.types: list[list[str]] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.changed.append(_changed(pl_module))
        self.types.append([type(m).__name__ for m in pl_module.modules()])


def test_report_only_prints_the_plan_and_applies_nothing(tmp_path, caplog):
    budget = tight_budget_gb()
    report = AutoSAC(budget_gb=budget, report_only=True, log_figures=False)
    models, probes = {}, {}
    for name, callbacks in (("plain", []), ("report", [report])):
        models[name], probes[name] = module(), Probe()
        with caplog.at_level(logging.INFO):
            trainer([*callbacks, probes[name]], tmp_path / name).fit(models[name])
    plan = report.plan
    assert plan is not None and plan.decisions, "the budget is below the unconstrained peak: the plan checkpoints"
    # Nothing applied: no module's forward replaced before any step, the same modules, the same training.
    assert probes["report"].changed == [[], [], []] and probes["report"].types == probes["plain"].types
    assert report._handle is None
    assert models["report"].losses == models["plain"].losses
    plain_state, report_state = models["plain"].state_dict(), models["report"].state_dict()
    assert plain_state.keys() == report_state.keys()
    assert all(torch.equal(plain_state[k], report_state[k]) for k in plain_state)
    idx = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(models["plain"].eval()(idx), models["report"].eval()(idx))
    # Printed once on rank 0: the peak without a plan, and the table of the plan it would apply.
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AutoSAC (report_only=True)")]
    assert len(said) == 1
    assert said[0].startswith(
        f"AutoSAC (report_only=True): the step's peak without a plan is {plan.unconstrained_peak_bytes / GIB:.3f} GiB "
        f"per device on cpu, budget {plan.budget_bytes / GIB:.3f} GiB; the plan it would apply (sac backend)"
    )
    assert "nothing is applied" in said[0] and "discard %" in said[0]
    assert all(fqn in said[0] for fqn in plan.decisions)
    assert not any(r.getMessage().startswith("AutoSAC plan (") for r in caplog.records)


def test_report_only_is_a_flag():
    with pytest.raises(TypeError, match=r"report_only must be True or False, got 'yes'"):
        AutoSAC(budget_gb=1, report_only="yes")  # type: ignore[arg-type]
