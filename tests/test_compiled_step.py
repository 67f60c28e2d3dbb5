"""AutoSAC plans a compiled model from the compiled step's own memory (issue "Ahead of every peer").

A Hugging Face ``LlamaForCausalLM`` compiled by inductor, random init: a plain fit measured by the independent
harness (``fit_harness.BatchPeaks``) gives its compiled peak P; ``AutoSAC(budget_gb=0.8 * P)`` then fits it. The
issue's acceptance: the planned fit's measured peak within the budget + 2% and at most 3% below it, and the plan's
prediction for the compiled step within 3% of what was measured. Before, compiled plans were made from the eager
step's profile and landed 15-20% below their budget (docs/benchmarks.md).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from fit_harness import BatchPeaks
from test_callback import trainer

from lightning_sac import AutoSAC

GIB = 2**30
VOCAB, BATCH, SEQ = 512, 8, 128


class CompiledLlama(pl.LightningModule):
    """A one-layer Llama (GQA 8/4), compiled with torch.compile's default backend, trained with AdamW."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=1,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=SEQ,
            use_cache=False,
            attn_implementation="sdpa",
        )
        self.model = torch.compile(LlamaForCausalLM(config))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> Any:
        ids = torch.randint(0, VOCAB, (4 * BATCH, SEQ), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=BATCH)


def fit(tmp_path: Path, callbacks: list[Any]) -> list[int]:
    torch._dynamo.reset()
    peaks = BatchPeaks()
    trainer([*callbacks, peaks], tmp_path, max_steps=4).fit(CompiledLlama())
    assert len(peaks.peaks) == 4
    return peaks.peaks


@pytest.mark.slow  # inductor compiles the plain and the planned step (C++ kernels), and the plans are traced
def test_autosac_lands_a_compiled_llama_on_its_budget(tmp_path):
    began = time.perf_counter()
    plain = max(fit(tmp_path / "plain", []))
    budget = int(0.8 * plain)
    sac = AutoSAC(budget_gb=budget / GIB, measure=False, log_figures=False)
    peaks = fit(tmp_path / "planned", [sac])
    plan = sac.plan
    assert plan is not None and plan.decisions, "80% of the plain compiled peak needs a plan"
    measured = max(peaks)
    report = (
        f"plain {plain / 2**20:.3f} MiB, budget {budget / 2**20:.3f}, measured {measured / 2**20:.3f} "
        f"({measured / budget - 1:+.2%}), predicted {plan.predicted_peak_bytes / 2**20:.3f} "
        f"({plan.predicted_peak_bytes / measured - 1:+.2%} of measured), {time.perf_counter() - began:.0f} s"
    )
    print(report)
    # The plan's budget is the user's, and its prediction is the compiled step's: within the budget.
    assert abs(plan.budget_bytes - budget) <= 1 and plan.predicted_peak_bytes <= budget, report
    assert plan.unconstrained_peak_bytes == pytest.approx(plain, rel=0.03), report
    assert 0.97 * budget <= measured <= 1.02 * budget, report
    assert plan.predicted_peak_bytes == pytest.approx(measured, rel=0.03), report
