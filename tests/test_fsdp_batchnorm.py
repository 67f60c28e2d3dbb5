"""Issue "FSDP": a plan under FSDP2 leaves a BatchNorm model's loss, every parameter and every buffer as the plain
fit leaves them: a Hugging Face ResNet (BatchNorm's running statistics are updated in forward, and must not be
updated again by a recompute), each stage and the model sharded with ``fully_shard`` on 2 gloo processes.

The planned fit runs AutoSAC at a budget below any plan (``strict=False``: it warns and applies the plan of least
memory), so the most modules are checkpointed.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from processes import start_ranks
from sharded_fits import _free_port
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_sac import AutoSAC


class ResNetModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import ResNetConfig, ResNetForImageClassification

        config = ResNetConfig(
            num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=10
        )
        self.model = ResNetForImageClassification(config).train()
        self.losses: list[float] = []

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for stage in self.model.resnet.encoder.stages:
            fully_shard(stage, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return self.model(pixel_values=images, labels=labels).loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        batches = [(torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(2)]
        return DataLoader(batches, batch_size=None)


def _fit(callbacks: list[Any], root: str) -> ResNetModule:
    pl.seed_everything(0)
    module = ResNetModule()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=2,
        callbacks=callbacks,
        logger=False,
        default_root_dir=root,  # AutoSAC's panels: in the test's folder, not the working directory
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    return module


def _state(module: ResNetModule) -> dict[str, torch.Tensor]:
    params = module.named_parameters()  # full_tensor gathers a shard: every rank calls it, in the same order
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in params}
    return full | {n: b.clone() for n, b in module.named_buffers()}


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    plain = _fit([], out)
    sac = AutoSAC(budget_gb=1e-6, strict=False, measure=False, log_figures=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the budget is below any plan on purpose
        planned = _fit([sac], out)
    assert sac.plan is not None
    torch.save(
        {
            "decisions": sorted(sac.plan.decisions),
            "losses": (plain.losses, planned.losses),
            "states": (_state(plain), _state(planned)),
        },
        Path(out, f"rank{rank}.pt"),
    )


@pytest.mark.slow  # 2 processes, about 20 s
def test_plan_keeps_loss_parameters_and_batchnorm_buffers_of_the_plain_fit(tmp_path: Path) -> None:
    start_ranks(_rank, (_free_port(), str(tmp_path)), 2)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["decisions"], "a plan of least memory checkpoints something"
        plain_losses, planned_losses = result["losses"]
        assert planned_losses == plain_losses
        plain, planned = result["states"]
        assert plain.keys() == planned.keys() and any("running_mean" in k for k in plain)
        for name in plain:
            torch.testing.assert_close(planned[name], plain[name], rtol=0, atol=0, msg=name)
