"""A branch of the graph no backward reaches is freed in the dry run when the step frees it.

The dry run's hook on saved tensors returned the tensor itself: an op that saves its own output (``tanh``,
``sigmoid``, ``softmax``, a recurrent cell) then held its own ``grad_fn``, a cycle through autograd's graph that
only a backward breaks. A branch whose result gets no gradient (an encoder ahead of a quantizer's ``argmax``, as
in EnCodec; probabilities computed for a metric) stayed alive to the end of the dry run where the step frees it at
once: EnCodec's step was predicted 77% above the allocator's (``dryrun/recorder.py:_pack``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_sac import profile_model
from lightning_sac.dryrun.measured import measure_training_step


class _Quantized(nn.Module):
    """An encoder (a recurrent layer or a tanh MLP) whose codes (``argmax``) feed the rest: no gradient reaches it."""

    def __init__(self, encoder: str) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.gru = nn.GRU(64, 64, batch_first=True) if encoder == "gru" else None
        self.mlp = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64), nn.Sigmoid())
        self.codebook = nn.Embedding(64, 64)
        self.head = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.gru(h)[0] if self.gru is not None else self.mlp(h)
        return self.head(self.codebook(h.argmax(-1))).square().mean()


class _Logged(nn.Module):
    """A classifier whose step also computes probabilities for a metric, outside ``no_grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 1000))
        self.confidence = torch.zeros(())

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.net(x)
        self.confidence = logits.softmax(-1).amax(-1).mean().detach()  # for a log, never backpropagated
        return nn.functional.cross_entropy(logits, y)


@pytest.mark.parametrize("encoder", ["gru", "mlp"])
def test_an_encoder_ahead_of_a_quantizer_is_freed_after_its_forward(encoder):
    torch.manual_seed(0)
    model, x = _Quantized(encoder), torch.randn(8, 64, 16)
    profile = profile_model(model, (x,), optimizer_factory=_adamw, device="cpu")
    measured = measure_training_step(copy.deepcopy(model), (x,), optimizer_factory=_adamw).peak_bytes
    assert profile.timeline[-1].at["activation"] == 0  # nothing of the step is left when it is over
    assert profile.plain_peak_bytes == measured


def test_probabilities_for_a_metric_are_freed_with_their_branch():
    torch.manual_seed(0)
    model, x, y = _Logged(), torch.randn(256, 64), torch.randint(0, 1000, (256,))
    profile = profile_model(model, (x, y), optimizer_factory=_adamw, device="cpu")
    measured = measure_training_step(copy.deepcopy(model), (x, y), optimizer_factory=_adamw).peak_bytes
    # Kept alive, the probabilities (256 x 1000 floats, 1 MB) would count at the backward's peak; what is left is
    # the metric's scalars (16 bytes here).
    assert abs(profile.plain_peak_bytes - measured) <= 64, (profile.plain_peak_bytes, measured)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)
