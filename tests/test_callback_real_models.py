"""AutoSAC on models we did not write, in Lightning: a Hugging Face decoder fed keyword batches from a DataLoader."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from test_callback import trainer
from torch.utils.data import DataLoader, Dataset
from zoo import gpt2, lm_batch

from lightning_sac import AutoSAC, profile_model
from lightning_sac.plan import plan_unit

GIB = 2**30


class Batches(Dataset):
    """Keyword batches as a tokenizer's collator makes them: input_ids, attention_mask (one row padded), labels."""

    def __init__(self, n: int = 4) -> None:
        self.batches = [lm_batch(128) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.batches[i]


class HFModule(pl.LightningModule):
    """The usual Hugging Face fine-tuning module: ``self.model(**batch).loss``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.losses: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Batches(), batch_size=None)


def fit(module: HFModule, tmp_path: Path, callbacks: list[Any], **trainer_kwargs: Any) -> HFModule:
    pl.seed_everything(0)
    trainer(callbacks, tmp_path, **trainer_kwargs).fit(module)
    return module


@pytest.mark.slow  # about 10 s: the matrix tier
def test_autosac_fits_a_hugging_face_decoder_as_a_plain_fit_does(tmp_path, caplog, capfd):
    model = gpt2().model
    profile = profile_model(model, lm_batch(128), optimizer_factory=lambda p: torch.optim.AdamW(p), device="cpu")
    plain = fit(HFModule(copy.deepcopy(model)), tmp_path, [])
    sac = AutoSAC(budget_gb=0.8 * profile.peak_bytes / GIB, log_figures=False)
    capfd.readouterr()
    with caplog.at_level(logging.INFO):
        planned = fit(HFModule(copy.deepcopy(model)), tmp_path, [sac])
    assert sac.plan is not None and sac.plan.decisions and sac.profiled
    assert sac.plan.predicted_peak_bytes <= sac.plan.budget_bytes
    assert planned.losses == plain.losses and len(plain.losses) == 4
    for (name, p), q in zip(plain.named_parameters(), planned.parameters(), strict=True):
        torch.testing.assert_close(q, p, msg=name)
    # The user's module is given its own forwards back at the end of fit.
    assert not any("forward" in m.__dict__ for m in planned.modules())
    # The measured step's verdict, once, on the console at Lightning's level for its summaries; nothing else of ours.
    assert sac.measured is not None
    verdicts = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AutoSAC measured")]
    unit = plan_unit(sac.plan, [sac.measured.peak_bytes])
    figures = f"peak {unit(sac.measured.peak_bytes)} of {unit(sac.plan.budget_bytes)} budget"
    assert len(verdicts) == 1 and verdicts[0].endswith("to spare."), verdicts
    assert f"{figures}, predicted {unit(sac.plan.predicted_peak_bytes)}: within budget" in verdicts[0]
    printed = capfd.readouterr()
    assert "Running HiGHS" not in printed.out + printed.err  # the solver's banner
    assert "Memory block of unknown size" not in printed.err  # c10's allocator notice (tests/test_quiet.py)
