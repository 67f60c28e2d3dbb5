"""Shared test models: a small GPT with dropout, an MLP and a conv net, each with inputs and a loss."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from lightning_sac import ModuleOpStats
from lightning_sac.demos import GPT, MLP, ConvNet, GPTConfig
from lightning_sac.tradeoff import module_tradeoff


@dataclass
class Case:
    name: str
    model: nn.Module
    inputs: tuple[Any, ...]
    loss_fn: Callable[[Any], torch.Tensor] | None


GPT_CONFIG = GPTConfig(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=128, dropout=0.1)


def gpt_case() -> Case:
    torch.manual_seed(0)
    idx = torch.randint(0, GPT_CONFIG.vocab_size, (4, 128))
    targets = torch.randint(0, GPT_CONFIG.vocab_size, (4, 128))

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return Case("gpt", GPT(GPT_CONFIG), (idx,), loss)


def mlp_case() -> Case:
    torch.manual_seed(0)
    return Case("mlp", nn.Sequential(MLP(256, 1024), nn.ReLU(), MLP(256, 1024)), (torch.randn(64, 256),), None)


def conv_case() -> Case:
    torch.manual_seed(0)
    labels = torch.randint(0, 10, (16,))
    return Case(
        "conv",
        ConvNet(width=16),
        (torch.randn(16, 3, 32, 32),),
        lambda out: nn.functional.cross_entropy(out, labels),
    )


CASES = {"gpt": gpt_case, "mlp": mlp_case, "conv": conv_case}


@pytest.fixture(params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    return CASES[request.param]()


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def recompute_all_policy(stats: ModuleOpStats) -> list[int]:
    """Every op recomputed but those a policy must save (stateful ops, in-place writes to outside storage...)."""
    forced = {i for unit in module_tradeoff(stats).stored for i in unit.ops}
    return [int(i in forced) for i in range(len(stats.func_names))]
