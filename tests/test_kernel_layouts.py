"""The dry run lays out an op's output as the real kernel does where its fake kernel does not (``kernel_layouts.py``).

BatchNorm's real kernel returns its output contiguous in the input's suggested memory format, where the fake one
keeps the input's strides: after ``BatchNorm1d`` between two transposes (PatchTST's ``norm_type="batchnorm"``) the
next Linear saw a transposed tensor in the dry run and ran ATen's other path (``t``, ``matmul``, a copy) where the
real step runs ``view``, ``addmm``, ``view``: PatchTST's plain peak was predicted 7% under the measured, and planned
modules met other ops than profiled.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_sac import profile_model
from lightning_sac.dryrun.measured import measure_training_step
from lightning_sac.ops import op_name


class _NormThenMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, length, channels)
        return self.mlp(self.norm(x.transpose(1, 2)).transpose(1, 2))


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.names.append(op_name(func))
        return func(*args, **(kwargs or {}))


def test_batch_norm_between_transposes_is_profiled_with_the_real_layout():
    torch.manual_seed(0)
    model, x = _NormThenMlp().train(), torch.randn(8, 16, 32)
    profile = profile_model(model, (x,), loss_fn=lambda out: out.square().sum(), device="cpu")
    # The MLP's forward ops as the real step runs them.
    real = copy.deepcopy(model)
    ops = _Ops()
    hooks = [
        real.mlp.register_forward_pre_hook(lambda *_: (ops.__enter__(), None)[1]),
        real.mlp.register_forward_hook(lambda *_: ops.__exit__(None, None, None)),
    ]
    real(x).square().sum().backward()
    for h in hooks:
        h.remove()
    assert profile.modules["mlp"].op_stats.func_names == ops.names
    assert "aten.addmm.default" in ops.names  # the contiguous path
    measured = measure_training_step(copy.deepcopy(model), (x,), loss_fn=lambda out: out.square().sum())
    assert profile.peak_bytes == measured.peak_bytes


def test_patchtst_with_batch_norm_is_predicted_to_the_byte():
    from transformers import PatchTSTConfig, PatchTSTForPrediction
    from zoo import _quiet_transformers

    _quiet_transformers()
    torch.manual_seed(0)
    config = PatchTSTConfig(
        num_input_channels=3,
        context_length=64,
        patch_length=8,
        patch_stride=8,
        prediction_length=16,
        d_model=32,
        num_attention_heads=4,
        num_hidden_layers=2,
        ffn_dim=64,
        norm_type="batchnorm",
    )
    model = PatchTSTForPrediction(config).train()
    g = torch.Generator().manual_seed(1)
    batch = {"past_values": torch.randn(8, 64, 3, generator=g), "future_values": torch.randn(8, 16, 3, generator=g)}

    def loss(out: object) -> torch.Tensor:
        return out.loss  # type: ignore[attr-defined]

    profile = profile_model(model, batch, loss_fn=loss, device="cpu")
    measured = measure_training_step(copy.deepcopy(model), batch, loss_fn=loss)
    assert profile.peak_bytes == measured.peak_bytes


class _SparseGcn(nn.Module):
    """A graph convolution as many are written: a sparse adjacency times the transformed node features."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.sparse.mm(adj, self.lin(x)))


class _SparseEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 16, sparse=True)  # its gradient is a sparse tensor
        self.head = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def test_sparse_tensors_are_refused_with_a_profiling_error_that_says_what_to_do():
    # A sparse tensor has no storage to count: the dry run stopped with torch's NotImplementedError ("Cannot access
    # storage of SparseTensorImpl").
    from lightning_sac import ProfilingError

    torch.manual_seed(0)
    edges = torch.randint(0, 50, (2, 200))
    adj = torch.sparse_coo_tensor(edges, torch.ones(200), (50, 50)).coalesce()
    with pytest.raises(ProfilingError, match="An input of the training step is a tensor of layout torch.sparse_coo"):
        profile_model(_SparseGcn(), (torch.randn(50, 16), adj), loss_fn=lambda out: out.sum(), device="cpu")
    with pytest.raises(ProfilingError, match=r"in module 'emb'.*layout torch.sparse_coo.*sparse=False") as info:
        profile_model(_SparseEmbedding(), (torch.randint(0, 100, (8, 5)),), loss_fn=lambda out: out.sum(), device="cpu")
    assert info.value.module == "emb"
