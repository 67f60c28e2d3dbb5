"""Integer buffers are constants of the model that the dry run reads as the step does.

EnCodec's and Mimi's convolutions keep their stride, kernel size and padding as int64 buffers and pad by them
(``F.pad(x, (self.padding_total, extra))``), a read on the host. The dry run made every buffer fake, so the read
was refused as a value derived from the weights (EnCodec), or answered by stand-ins: a residual whose lengths the
stand-in happened to keep profiled silently with other paddings, and one it did not (Mimi) stopped with a fake
kernel's shape error at the residual's add, naming neither the read nor the buffer. Integer and boolean buffers
are now real copies in the dry run (``dryrun/emulation.py:fake_copy``): read as in training, the user's untouched.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_sac import apply_plan, profile_model, solve_plan
from lightning_sac.dryrun.measured import measure_training_step


class _PaddedConv(nn.Module):
    """A causal convolution that pads by its own integer buffers, as Hugging Face's EnCodec and Mimi do."""

    def __init__(self, channels: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, kernel, stride)
        self.kernel_size = nn.Buffer(torch.tensor(kernel), persistent=False)
        self.stride = nn.Buffer(torch.tensor(stride), persistent=False)
        self.padding_total = nn.Buffer(torch.tensor(kernel - stride), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        frames = torch.ceil((length - self.kernel_size + self.padding_total) / self.stride + 1).to(torch.int64) - 1
        extra = frames * self.stride + self.kernel_size - self.padding_total - length
        return self.conv(F.pad(x, (self.padding_total, extra)))


class _Residual(nn.Module):
    def __init__(self, kernel: int) -> None:
        super().__init__()
        self.a, self.b = _PaddedConv(8, kernel, 1), _PaddedConv(8, kernel, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class _Reconstruction(nn.Module):
    """A codec trained to reconstruct its input waveform."""

    def __init__(self, codec: nn.Module) -> None:
        super().__init__()
        self.codec = codec

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.codec(input_values=audio).audio_values[..., : audio.shape[-1]], audio)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


@pytest.mark.parametrize("kernel", [3, 7])
def test_a_convolution_padded_by_its_buffers_is_profiled_as_it_runs(kernel):
    torch.manual_seed(0)
    model, x = _Residual(kernel), torch.randn(2, 8, 100)
    before = {name: b.clone() for name, b in model.named_buffers()}
    profile = profile_model(model, (x,), loss_fn=_loss, optimizer_factory=_sgd, device="cpu")
    measured = measure_training_step(copy.deepcopy(model), (x,), loss_fn=_loss, optimizer_factory=_sgd).peak_bytes
    # The paddings are the real ones: every padded input is as large as in the step (other paddings: other bytes).
    assert profile.plain_peak_bytes == measured
    pads = [m for m in profile.modules.values() if m.module_type == "Conv1d"]
    assert [m.input_bytes for m in pads] == [2 * 8 * (100 + kernel - 1) * 4] * 2
    assert all(torch.equal(b, before[name]) for name, b in model.named_buffers())  # the user's buffers as they were


def test_encodecs_step_is_profiled_and_planned_as_measured():
    from transformers import EncodecConfig, EncodecModel
    from zoo import _quiet_transformers

    _quiet_transformers()
    torch.manual_seed(0)
    config = EncodecConfig(
        target_bandwidths=[12.0],
        sampling_rate=8000,
        audio_channels=1,
        hidden_size=32,
        num_filters=8,
        num_residual_layers=1,
        upsampling_ratios=[4, 4],
        codebook_size=64,
        codebook_dim=32,
        num_lstm_layers=1,
        use_causal_conv=True,
    )
    model = _Reconstruction(EncodecModel(config)).train()
    audio = torch.randn(2, 1, 4000, generator=torch.Generator().manual_seed(1))
    profile = profile_model(model, (audio,), optimizer_factory=_sgd, device="cpu")
    measured = measure_training_step(copy.deepcopy(model), (audio,), optimizer_factory=_sgd).peak_bytes
    assert profile.plain_peak_bytes == measured
    plan = solve_plan(profile, (measured - 64 * 1024) / 2**30)
    assert plan.decisions
    planned = copy.deepcopy(model)
    apply_plan(planned, plan)
    got = measure_training_step(planned, (audio,), optimizer_factory=_sgd).peak_bytes
    assert abs(got - plan.predicted_peak_bytes) <= 64  # a scalar or two of the padding's arithmetic (8 bytes here)
