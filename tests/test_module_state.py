"""Modules a recompute cannot rerun as their forward ran are never checkpointed.

A module whose forward stores state computed from its inputs, nor any module around it:

RecurrentGemma's RG-LRU keeps its last ``recurrent_states`` as an attribute and starts its next call from them. A
checkpoint's recompute reruns the forward from the state the forward left and stores it again: a selective policy's
cache then handed saved values to other ops than the ones that made them, and a plan near the minimum trained
gradients 1e-2 away from the plain model's, silently. The dry run names such modules
(``ModelProfile.module_state``) and the planner leaves them and their ancestors out.

A module whose forward writes to one of its inputs in place (Mixtral's sparse block with router jitter:
``hidden_states *= noise``): a checkpoint reruns it from the input it keeps, which then holds the written values; a
plan checkpointing the block failed in backward under the selective policy (``ModelProfile.writes_input``).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from zoo import Family, _quiet_transformers, lm_batch, mixtral_grouped_mm

from lightning_sac import BudgetError, Plan, apply_plan, profile_model, solve_plan
from lightning_sac.solver import find_candidates

GIB = 2**30


class _Carry(nn.Module):
    """Adds a tenth of its last output to its input: state that the next call starts from."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(x if self.last is None else x + 0.1 * self.last.mean()))
        self.last = h
        return h


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 16), _Carry(), nn.Linear(16, 16))
        self.other = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.other(self.block(x))


def test_a_module_that_stores_state_and_those_around_it_are_no_candidates():
    torch.manual_seed(0)
    profile = profile_model(_Net(), (torch.randn(32, 16),), loss_fn=lambda out: out.square().sum(), device="cpu")
    assert profile.modules["block.1"].calls == 1
    assert profile.module_state == {"block.1": "last"}
    names = {c.fqn for c in find_candidates(profile)}
    assert "other" in names  # what runs apart from it stays a candidate
    assert not names & {"", "block", "block.1"}


def assert_trains_as_plain(family: Family, plan: Plan) -> None:
    """Two steps of a planned copy: the plain model's loss, every gradient and every buffer, bit for bit."""
    from test_real_models import two_steps

    plain = two_steps(copy.deepcopy(family.model), family)
    planned = copy.deepcopy(family.model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*trains with use_cache=False.*")
        handle = apply_plan(planned, plan)
        steps = two_steps(planned, family)
    handle.remove()
    for (loss0, grads0, bufs0), (loss1, grads1, bufs1) in zip(plain, steps, strict=True):
        assert torch.equal(loss0, loss1)
        assert grads0.keys() == grads1.keys() and bufs0.keys() == bufs1.keys()
        assert [n for n in grads0 if not torch.equal(grads0[n], grads1[n])] == []
        assert [n for n in bufs0 if not torch.equal(bufs0[n], bufs1[n])] == []


def test_a_model_whose_state_has_a_gradient_history_is_profiled():
    # After a training step, _Carry.last holds a tensor with a gradient history, which torch cannot deep-copy: the
    # dry run's copy failed with torch's RuntimeError ("Only Tensors created explicitly by the user ...").
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(32, 16)
    model(x).square().sum().backward()
    last = model.block[1].last
    assert last is not None and last.grad_fn is not None
    profile = profile_model(model, (x,), loss_fn=lambda out: out.square().sum(), device="cpu")
    assert profile.module_state == {"block.1": "last"}
    assert model.block[1].last is last  # the user's model keeps its own state


def recurrent_gemma() -> Family:
    from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM

    _quiet_transformers()
    torch.manual_seed(0)
    config = RecurrentGemmaConfig(
        num_hidden_layers=3,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        lru_width=64,
        attention_window_size=32,
        conv1d_width=4,
        block_types=["recurrent", "attention"],
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    return Family("recurrent_gemma", RecurrentGemmaForCausalLM(config).train(), lm_batch(128))


@pytest.mark.slow  # two plans trained twice each, about 20 s
@pytest.mark.parametrize("backend", ["sac", "graph"])
def test_recurrent_gemma_planned_at_its_minimum_trains_as_the_plain_model(backend):
    family = recurrent_gemma()
    profile = profile_model(
        family.model, family.batch, loss_fn=family.loss_fn, optimizer_factory=family.optimizer, device="cpu"
    )
    lrus = {f"model.layers.{i}.temporal_block.rg_lru" for i in (0, 2)}
    assert profile.module_state == dict.fromkeys(sorted(lrus), "recurrent_states")
    with pytest.raises(BudgetError) as info:
        solve_plan(profile, 1e-6, backend=backend)
    plan = solve_plan(profile, info.value.minimum_bytes * 1.02 / GIB, backend=backend)
    assert plan.decisions and not any(f in lrus or any(x.startswith(f + ".") for x in lrus) for f in plan.decisions)
    assert_trains_as_plain(family, plan)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x *= 2.0  # on the input, in place
        return self.mlp(x)


def test_a_module_that_writes_its_input_in_place_is_no_candidate():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _Scaled(), nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)))
    profile = profile_model(model, (torch.randn(32, 16),), loss_fn=lambda out: out.square().sum(), device="cpu")
    assert profile.writes_input == {"1": "aten.mul_.Tensor"}
    names = {c.fqn for c in find_candidates(profile)}
    assert {"1.mlp", "2"} <= names and "1" not in names  # its children and the others stay candidates


@pytest.mark.slow  # a MoE plan trained twice, about 15 s
def test_mixtral_with_router_jitter_trains_as_the_plain_model():
    family = mixtral_grouped_mm(router_jitter_noise=0.1)
    profile = profile_model(
        family.model, family.batch, loss_fn=family.loss_fn, optimizer_factory=family.optimizer, device="cpu"
    )
    blocks = [f"model.layers.{i}.mlp" for i in range(2)]
    assert profile.writes_input == dict.fromkeys(blocks, "aten.mul_.Tensor")
    with pytest.raises(BudgetError) as info:
        solve_plan(profile, 1e-6)
    plan = solve_plan(profile, info.value.minimum_bytes * 1.02 / GIB, backend="sac")
    assert plan.decisions and not set(blocks) & set(plan.decisions)
    assert_trains_as_plain(family, plan)
