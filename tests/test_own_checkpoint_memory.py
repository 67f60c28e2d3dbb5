"""A model's own checkpoints and a recompute of ops whose outputs the forward partly frees, to the byte.

Two holes a model that calls ``torch.utils.checkpoint`` itself found (its plans measured up to 0.15% above their
budget):

* The CPU generator's state that each of the model's own regions stashes, and that ``fork_rng`` copies during
  its recompute (5 KiB each), is made outside the dispatcher: the dry run counted none of them (the plain step,
  whose peak is in such a recompute, 11 KiB under). It now counts the step's own ``torch.get_rng_state`` calls
  (``dryrun/modules/own_checkpoints.py:GeneratorStates``).
* A LayerNorm whose output only a local variable holds (``nn.MultiheadAttention`` copies its transposed input)
  while autograd saves its mean and rstd: some storages of the op die in the forward, one outlives it. The
  recompute counted the whole op as a missing activation; it makes the output again and holds it as long as the
  forward did (``ModuleOpStats.freed_parts``; 131,072 bytes under at a block's recompute). And SAC's rerun takes a
  saved output out of its cache when it reaches the op, so it dies where the forward's did.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_sac import BudgetError, apply_plan, profile_model, solve_plan
from lightning_sac.dryrun.measured import measure_training_step

VOCAB = 128


class _Block(nn.Module):
    def __init__(self, d: int, own_checkpoint: bool) -> None:
        super().__init__()
        self.n = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, dropout=0.1, batch_first=True)
        self.n2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * d, d))
        self.own_checkpoint = own_checkpoint

    def _ff(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(self.n2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.n(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        if self.own_checkpoint:
            return x + torch.utils.checkpoint.checkpoint(self._ff, x, use_reentrant=False)
        return x + self._ff(x)


class _Net(nn.Module):
    """Block 0's feed-forward is checkpointed by the model, block 2 whole; the loss inside."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList([_Block(d, True), _Block(d, False), _Block(d, False)])
        self.head = nn.Linear(d, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for i, block in enumerate(self.blocks):
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if i == 2 else block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    model = _Net().train()
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, VOCAB, (4, 128), generator=g), torch.randint(0, VOCAB, (4, 128), generator=g))
    profile = profile_model(model, batch, optimizer_factory=_adamw, device="cpu", replace_existing=False)
    plain = measure_training_step(copy.deepcopy(model), batch, optimizer_factory=_adamw).peak_bytes
    return model, batch, profile, plain


def _measured(model: nn.Module, batch, plan) -> int:
    planned = copy.deepcopy(model)
    apply_plan(planned, plan)
    return measure_training_step(planned, batch, optimizer_factory=_adamw).peak_bytes


def test_the_plain_step_counts_the_generator_states_its_own_checkpoints_keep(case):
    _, _, profile, plain = case
    assert "blocks.2" in profile.peak_location  # the peak is in the model's own region's recompute
    assert profile.plain_peak_bytes == plain  # three 5,056-byte states were missing there


def test_a_checkpointed_block_whose_norm_output_dies_in_forward_is_predicted_to_the_byte(case):
    model, batch, profile, plain = case
    with pytest.raises(BudgetError) as below:
        solve_plan(profile, 1e-6)
    plan = solve_plan(profile, below.value.minimum_bytes * 1.02 / 2**30)
    assert "blocks.1" in plan.decisions
    measured = _measured(model, batch, plan)
    assert measured == plan.predicted_peak_bytes  # 71,296 bytes under before
    assert measured <= below.value.minimum_bytes * 1.02
    # The block alone, every op recomputed (its peak is in its own recompute).
    alone = solve_plan(profile, (plain - plan.decisions["blocks.1"].freed_bytes // 2) / 2**30, candidates=["blocks.1"])
    assert list(alone.decisions) == ["blocks.1"]
    assert _measured(model, batch, alone) == alone.predicted_peak_bytes
