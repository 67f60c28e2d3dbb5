"""Bad input: clear errors naming what was expected, what was got and how to fix it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_sac import ProfilingError, UnknownDeviceError, profile_model


class Masking(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x > 0].sum() * torch.ones_like(x)


class ItemCall(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decision on a weight-derived value: which ops run depends on it (a value only logged would not stop
        # the dry run: it gets a recorded placeholder).
        return x * 2 if x.max().item() > 1.5 else x


def _model(inner: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), inner))


@pytest.mark.parametrize(
    ("inner", "op"),
    [(Masking(), "aten.index.Tensor"), (ItemCall(), "aten._local_scalar_dense.default")],
    ids=["boolean-mask", "item"],
)
def test_data_dependent_op_names_the_op_and_module_and_leaves_the_model_alone(inner, op):
    model = _model(inner)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ProfilingError, match=r"Module '1\.1' calls aten\.") as info:
        profile_model(model, (torch.randn(2, 4),), optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert info.value.op == op and info.value.module == "1.1"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    model(torch.randn(2, 4)).sum().backward()  # training without a plan still works


def test_unknown_device_lists_known_ones():
    with pytest.raises(UnknownDeviceError, match="H100-SXM"):
        profile_model(nn.Linear(2, 2), (torch.randn(1, 2),), device="H900")


def test_example_inputs_must_be_a_tuple():
    with pytest.raises(TypeError, match=r"must be a tuple .* pass \(x,\)"):
        profile_model(nn.Linear(2, 2), torch.randn(1, 2))  # type: ignore[arg-type]


def test_loss_must_be_a_scalar():
    with pytest.raises(ValueError, match=r"scalar floating-point tensor, got a tensor of shape \(3, 2\)"):
        profile_model(nn.Linear(2, 2), (torch.randn(3, 2),), loss_fn=lambda out: out)


def test_unknown_estimate_and_benchmark_for_a_gpu_are_refused():
    with pytest.raises(ValueError, match="'roofline' or 'benchmark', got 'magic'"):
        profile_model(nn.Linear(2, 2), (torch.randn(1, 2),), estimate="magic")
    with pytest.raises(ValueError, match="cannot estimate 'H100-SXM'"):
        profile_model(nn.Linear(2, 2), (torch.randn(1, 2),), estimate="benchmark", device="H100-SXM")
