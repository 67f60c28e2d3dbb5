"""FSDP2's own mixed precision in the dry run: the unsharded copy computes as ``MixedPrecisionPolicy`` casts.

``fully_shard`` runs over torch's ``fake`` process group of 4 ranks (no other process); the strategy matrix's
``fsdp2-mp`` cells (``tests/test_strategy_matrix.py``, slow) check whole fits against torch.profiler.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from conftest import fake_ranks
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lightning_sac.dryrun.emulation import fake_copy


@pytest.fixture
def four_ranks() -> Iterator[None]:
    with fake_ranks(4):
        yield


def _sharded(mp: MixedPrecisionPolicy) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    fully_shard(model[0], mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def test_parameters_are_gathered_in_param_dtype_and_inputs_cast(four_ranks: None) -> None:
    model = _sharded(MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    mode = FakeTensorMode()
    copy = fake_copy(model, mode, "cpu")
    # Global shapes, in the dtype the units gather them in; the user's shards stay fp32.
    assert [(tuple(p.shape), p.dtype) for p in copy.parameters()] == [
        ((5, 6), torch.bfloat16),
        ((5,), torch.bfloat16),
        ((3, 5), torch.bfloat16),
        ((3,), torch.bfloat16),
    ]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with mode:
        x = torch.empty(2, 6)  # fp32, as a batch comes: the root unit casts it
        hidden = copy[0](x)
        out = copy(x)
    assert hidden.dtype == out.dtype == torch.bfloat16


def test_an_output_dtype_casts_the_units_output(four_ranks: None) -> None:
    model = _sharded(MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32))
    mode = FakeTensorMode()
    copy = fake_copy(model, mode, "cpu")
    with mode:
        out = copy(torch.empty(2, 6))
    assert out.dtype == torch.float32


def test_without_cast_forward_inputs_a_float_input_is_not_cast(four_ranks: None) -> None:
    seen: list[torch.dtype] = []
    for cast, expected in ((True, torch.bfloat16), (False, torch.float32)):
        model = _sharded(MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=cast))
        mode = FakeTensorMode()
        copy = fake_copy(model, mode, "cpu")
        # Registered after the copy's own cast: it sees what the unit's forward receives.
        copy[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
        with mode:
            copy[0](torch.empty(2, 6))
        assert seen[-1] == expected
