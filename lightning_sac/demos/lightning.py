"""A LightningModule GPT on synthetic tokens, for the example, the callback's tests and the CLI's factory."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_sac.demos.models import GPT, GPTConfig

__all__ = ["GPTModule", "synthetic_tokens"]


def synthetic_tokens(n: int, seq_len: int, vocab_size: int, seed: int = 0) -> TensorDataset:
    """Token sequences whose next token is a fixed function of the current one, so the loss can fall."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab_size, (n, 1), generator=g)
    steps = torch.arange(seq_len + 1).unsqueeze(0)
    tokens = (start + 7 * steps) % vocab_size
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


class GPTModule(pl.LightningModule):
    """Next-token prediction with :class:`~lightning_sac.demos.models.GPT` and AdamW; logs ``train_loss`` per step."""

    def __init__(self, config: GPTConfig | None = None, lr: float = 3e-3, batch_size: int = 8, n_samples: int = 64):
        super().__init__()
        self.config = config or GPTConfig()
        self.lr = lr
        self.batch_size = batch_size
        self.n_samples = n_samples
        self.model = GPT(self.config)
        self.losses: list[float] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits for token ids."""
        return self.model(idx)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Cross-entropy of the next token."""
        idx, targets = batch
        logits = self.model(idx)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Keep each step's loss (outside training_step: a dry run on fake tensors cannot read values)."""
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW."""
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        """Synthetic tokens, in a fixed order."""
        data = synthetic_tokens(self.n_samples, self.config.block_size, self.config.vocab_size)
        return DataLoader(data, batch_size=self.batch_size, shuffle=False)
