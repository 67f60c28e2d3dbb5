"""AutoSAC in Lightning: single process and DDP on 2 processes (gloo), resume, budgets, precision, errors."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_sac.lightning.fit_step as fit_step_module
from lightning_sac import AutoSAC, BudgetError, Plan, ProfilingError
from lightning_sac.demos import GPTConfig
from lightning_sac.demos.lightning import GPTModule

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.1)
GIB = 2**30


def module() -> GPTModule:
    pl.seed_everything(0)
    return GPTModule(CONFIG, batch_size=8, n_samples=64)


def trainer(callbacks: list[Callback], tmp_path: Path, **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = dict(
        max_steps=4,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        default_root_dir=tmp_path,
    )
    defaults.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **defaults)


class Record(Callback):
    """Write what each rank saw (plan fingerprint and decisions, wrapped modules, losses) to a JSON file."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.wrapped: list[str] | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001, ANN201
        if self.wrapped is None:  # the first step of this fit (a resumed fit starts mid-epoch)
            self.wrapped = [n for n, m in pl_module.named_modules() if "forward" in m.__dict__]

    def on_train_end(self, trainer, pl_module):  # noqa: ANN001, ANN201
        sac = next((c for c in trainer.callbacks if isinstance(c, AutoSAC)), None)
        plan = sac.plan if sac is not None else None
        record = {
            "fingerprint": plan.fingerprint if plan else None,
            "decisions": sorted(plan.decisions) if plan else [],
            "wrapped": self.wrapped,
            "losses": pl_module.losses,
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def tight_budget_gb() -> float:
    """60% of the way from the minimum achievable peak to the unconstrained one, for this test model."""
    from lightning_sac import profile_model, solve_plan

    m = module()
    batch = next(iter(m.train_dataloader()))
    profile = profile_model(
        m.model,
        (batch[0],),
        loss_fn=lambda logits: torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten()),
        optimizer_factory=lambda ps: torch.optim.AdamW(ps),
        device="cpu",
    )
    with pytest.raises(BudgetError) as info:
        solve_plan(profile, 1e-6)
    lo, hi = info.value.minimum_bytes, info.value.unconstrained_bytes
    return (lo + 0.4 * (hi - lo)) / GIB


@pytest.mark.parametrize(
    ("strategy", "world_size"),
    # One process: about 10 s, in the matrix tier with the 2-process fit; the strategy matrix fits single-device too.
    [pytest.param("auto", 1, marks=pytest.mark.slow), pytest.param("ddp_spawn", 2, marks=pytest.mark.slow)],
)
def test_fit_matches_plain_fit_and_every_rank_applies_the_same_plan(tmp_path, strategy, world_size):
    budget = tight_budget_gb()
    runs = {}
    for name, callbacks in (("plain", []), ("autosac", [AutoSAC(budget_gb=budget)])):
        out = tmp_path / name
        out.mkdir()
        trainer(callbacks + [Record(out)], tmp_path, strategy=strategy, devices=world_size).fit(module())
        runs[name] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
    planned = runs["autosac"]
    assert planned[0]["decisions"], "the budget is below the unconstrained peak: something is checkpointed"
    assert all(
        r["fingerprint"] == planned[0]["fingerprint"] and r["decisions"] == planned[0]["decisions"] for r in planned
    )
    assert all(r["wrapped"] == planned[0]["decisions"] for r in planned)  # applied on every rank
    for plain, auto in zip(runs["plain"], planned, strict=True):
        assert len(auto["losses"]) == 4
        # Same seed, same data and dropout masks: only float reassociation in recompute may differ.
        assert auto["losses"] == pytest.approx(plain["losses"], rel=1e-5)


@pytest.mark.slow  # two fits; what calibration measures, and that the model is untouched: test_calibrate's quick tests
def test_benchmark_estimate_measures_the_modules_without_moving_the_fit(tmp_path):
    # Profiling for this CPU runs copies of the blocks for real (dropout, synthetic inputs): the fit must see
    # the same random stream, data and losses as a plain one.
    budget = tight_budget_gb()
    runs = {}
    cb = AutoSAC(budget_gb=budget, estimate="benchmark")
    for name, callbacks in (("plain", []), ("autosac", [cb])):
        out = tmp_path / name
        out.mkdir()
        trainer(callbacks + [Record(out)], tmp_path).fit(module())
        runs[name] = json.loads((out / "rank0.json").read_text())
    assert cb.profile is not None and cb.plan is not None and cb.plan.decisions
    assert runs["autosac"]["losses"] == pytest.approx(runs["plain"]["losses"], rel=1e-5)
    for fqn, d in cb.plan.decisions.items():
        fixed, factor, *whole = cb.profile.modules[fqn].measured_overhead["sac"]
        expected = fixed + (factor - 1) * d.recompute_ms
        if whole and not any(d.op_policy):  # a policy that saves nothing runs as a plain checkpoint, timed so
            expected = whole[0] - d.recompute_ms
        assert d.overhead_ms == pytest.approx(expected, rel=1e-9)


def test_resume_restores_the_plan_without_profiling(tmp_path, monkeypatch):
    budget = tight_budget_gb()
    # measure=False, log_figures=False: what a resume restores is the plan; the measured step is test_report's.
    first = AutoSAC(budget_gb=budget, measure=False, log_figures=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer([first, ckpt], tmp_path, enable_checkpointing=True, max_steps=2).fit(module())
    assert first.profiled and first.plan is not None and first.plan.decisions

    def no_profiling(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("resuming must not profile again")

    monkeypatch.setattr(fit_step_module, "profile_step", no_profiling)
    second = AutoSAC(budget_gb=budget, measure=False, log_figures=False)
    record = Record(tmp_path)
    trainer([second, record], tmp_path, max_steps=4).fit(module(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert second.plan == first.plan and not second.profiled
    assert record.wrapped == sorted(first.plan.decisions)


def test_a_budget_too_small_stops_before_the_first_step(tmp_path):
    m = module()
    with pytest.raises(BudgetError, match=r"minimum achievable peak of \d+\.\d+ [GM]iB \(the unconstrained peak is"):
        trainer([AutoSAC(budget_gb=0.001)], tmp_path).fit(m)
    assert m.losses == []
    assert all("forward" not in sub.__dict__ for sub in m.modules())


def test_strict_false_warns_and_applies_the_minimum_memory_plan(tmp_path):
    cb = AutoSAC(budget_gb=0.001, strict=False)
    with pytest.warns(UserWarning, match="applying the minimum-memory plan"):
        trainer([cb], tmp_path, max_steps=1).fit(module())
    assert cb.plan is not None and cb.plan.decisions


def test_a_budget_larger_than_needed_wraps_nothing(tmp_path):
    cb = AutoSAC(budget_gb=8.0)
    record = Record(tmp_path)
    trainer([cb, record], tmp_path, max_steps=1).fit(module())
    assert cb.plan is not None and cb.plan.decisions == {} and record.wrapped == []


@pytest.mark.slow  # a bf16 fit: test_loop_precision's llama cell is the quick one
def test_bf16_mixed_plans_with_bf16_activations(tmp_path, monkeypatch):
    profiles = []
    real = fit_step_module.profile_step

    def keep(*args: Any, **kwargs: Any) -> Any:
        profiles.append(real(*args, **kwargs))
        return profiles[-1]

    monkeypatch.setattr(fit_step_module, "profile_step", keep)
    for precision in ("32-true", "bf16-mixed"):
        trainer([AutoSAC(budget_gb=8.0)], tmp_path, max_steps=1, precision=precision).fit(module())
    fp32, bf16 = (p.modules["model.blocks.0.attn.qkv"].output_bytes for p in profiles)
    assert fp32 == 8 * 64 * 3 * 64 * 4 and bf16 == 8 * 64 * 3 * 64 * 2  # batch x T x 3C, 4 then 2 bytes


class ItemInStep(GPTModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if loss.item() < 1.5:  # a decision on the loss's value steers what is computed: the dry run cannot take it
            loss = loss * 2
        return loss


def test_profiling_error_names_the_op_and_strict_false_trains_without_a_plan(tmp_path):
    pl.seed_everything(0)
    with pytest.raises(ProfilingError, match=r"_local_scalar_dense"):
        trainer([AutoSAC(budget_gb=1.0)], tmp_path, max_steps=1).fit(ItemInStep(CONFIG))
    pl.seed_everything(0)
    m = ItemInStep(CONFIG)
    cb = AutoSAC(budget_gb=1.0, strict=False)
    with pytest.warns(UserWarning, match="training runs without a plan"):
        trainer([cb], tmp_path, max_steps=2).fit(m)
    assert cb.plan is None and len(m.losses) == 2


def test_plan_path_is_written_then_reused(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    budget = tight_budget_gb()
    quiet = {"measure": False, "log_figures": False}  # the plan file is the subject, not the measured step
    first = AutoSAC(budget_gb=budget, plan_path=path, **quiet)
    trainer([first], tmp_path, max_steps=1).fit(module())
    assert Plan.from_json(path.read_text()) == first.plan
    monkeypatch.setattr(fit_step_module, "profile_step", lambda *a, **k: pytest.fail("plan_path must be reused"))
    second = AutoSAC(budget_gb=budget, plan_path=path, **quiet)
    trainer([second], tmp_path, max_steps=1).fit(module())
    assert second.plan == first.plan and not second.profiled
    monkeypatch.undo()
    third = AutoSAC(budget_gb=budget * 0.9, plan_path=path, **quiet)  # another budget: planned again, and said so
    with pytest.warns(UserWarning, match=r"does not fit this run \(the budget changed\); planning again"):
        trainer([third], tmp_path, max_steps=1).fit(module())
    assert third.profiled


def test_bad_arguments_and_unsupported_strategies():
    with pytest.raises(ValueError, match="exactly one of budget_gb or budget_fraction"):
        AutoSAC()
    with pytest.raises(ValueError, match="exactly one of budget_gb or budget_fraction"):
        AutoSAC(budget_gb=1.0, budget_fraction=0.5)
    with pytest.raises(ValueError, match="backend must be"):
        AutoSAC(budget_gb=1.0, backend="magic")
    fake_trainer = types.SimpleNamespace(strategy=object())
    with pytest.raises(ValueError, match="supports single-device, DDP, FSDP and tensor-parallel .*; got object"):
        AutoSAC(budget_gb=1.0).setup(fake_trainer, module(), "fit")  # type: ignore[arg-type]
    AutoSAC(budget_gb=1.0).setup(fake_trainer, module(), "validate")  # other stages are not validated
