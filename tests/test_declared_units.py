"""FSDP2 units declared by pattern (``--fsdp-units``) against those ``fully_shard`` really makes of the same model.

The real units come from ``fully_shard`` over torch's fake process group (no other process, no communication):
shard sizes with FSDP's own padding, all-gather buffers, gradient dtypes, which units reshard.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from conftest import fake_ranks
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from zoo import _llama_config

from lightning_sac.sharding import sharded_layout
from lightning_sac.sharding.declared import declared_layout, declared_units

WORLD = 3  # not a divisor of most dims: every shard is padded


def tiny_llama(tie: bool = False) -> nn.Module:
    from transformers import LlamaForCausalLM

    config = _llama_config()
    config.tie_word_embeddings = tie
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


@pytest.fixture
def fake_world() -> Iterator[None]:
    with fake_ranks(WORLD):
        yield


def _shard(model: nn.Module, units: list[str], mp: MixedPrecisionPolicy | None = None) -> None:
    modules = dict(model.named_modules())
    kw = {} if mp is None else {"mp_policy": mp}
    for fqn in sorted(units, key=lambda f: -f.count(".")):  # innermost first, as fully_shard needs
        fully_shard(modules[fqn], **kw)
    fully_shard(model, **kw)


@pytest.mark.parametrize("patterns", [["model.layers.*"], ["LlamaAttention", "LlamaMLP", "model.layers.0"]])
def test_declared_units_are_those_fully_shard_makes(fake_world: None, patterns: list[str]) -> None:
    declared_model = tiny_llama()
    declared = declared_layout(declared_model, patterns, WORLD)
    model = tiny_llama()
    _shard(model, declared_units(model, patterns))
    real = sharded_layout(model)
    assert real is not None
    assert declared == real
    assert len(real.units) > 1


def test_declared_mixed_precision_and_tied_parameters(fake_world: None) -> None:
    # bf16 gathers, fp32 reduction; embedding and lm_head tied: the parameter once, in the root.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    declared = declared_layout(
        tiny_llama(tie=True), ["model.layers.*"], WORLD, param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    model = tiny_llama(tie=True)
    _shard(model, declared_units(model, ["model.layers.*"]), mp)
    assert declared == sharded_layout(model)
    root = declared.units[0]
    assert root.fqn == "" and not root.reshard_after_forward
    assert root.gathered_bytes * 2 == root.param_bytes  # bf16 gathers of fp32 parameters


def test_a_pattern_naming_no_module_says_what_to_give() -> None:
    with pytest.raises(ValueError, match=r"'blocks\.\*' name no module of the model.*model\.layers\.\*"):
        declared_layout(tiny_llama(), ["blocks.*"], 4)


def test_on_one_rank_fsdp2_has_no_all_gather_buffer() -> None:
    # World size 1: FSDP2 copies the shards straight into the unsharded parameters, with no all-gather.
    with fake_ranks(1):
        model = tiny_llama()
        _shard(model, declared_units(model, ["model.layers.*"]))
        real = sharded_layout(model)
    declared = declared_layout(tiny_llama(), ["model.layers.*"], 1)
    assert real == declared
    assert all(u.buffer_bytes == 0 and u.gathered_bytes == u.param_bytes > 0 for u in declared.units)
