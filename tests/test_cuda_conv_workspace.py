"""cuDNN's convolution workspaces for CUDA targets: the bound an emulated target is charged, computed by hand.

On a GPU the workspace is measured (``tests/gpu/test_cuda_conv_workspace.py`` compares the measurement and the bound
with the real allocator); here, without one, the bound of :mod:`lightning_sac.dryrun.cuda.conv_workspace`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_sac import profile_model
from lightning_sac.dryrun.cuda.conv_workspace import BOUND_RATIOS, POINTWISE_BOUND, STRIDED_POINTWISE_BOUND, bound_bytes

aten = torch.ops.aten


def _round512(n: float) -> int:
    return -(-int(n) // 512) * 512


def _call(c_in: int, c_out: int, size: int, stride: int, dtype: torch.dtype, channels_last: bool, kernel: int = 3):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.empty(4, c_in, size, size, dtype=dtype, device="meta").to(memory_format=fmt)
    w = torch.empty(c_out, c_in, kernel, kernel, dtype=dtype, device="meta").to(memory_format=fmt)
    args = (x, w, None, [stride] * 2, [kernel // 2] * 2, [1, 1], False, [0, 0], 1)
    return args, aten.convolution.default(*args)


def test_a_contiguous_float32_convolution_is_bounded_by_its_input():
    conv, y = _call(16, 16, 32, 1, torch.float32, channels_last=False)
    x, w = conv[0], conv[1]
    nbytes = 4 * 16 * 32 * 32 * 4  # 256 KiB, input and output alike
    assert bound_bytes(aten.convolution.default, conv, y) == _round512(2.4 * nbytes) == 629248
    grad = torch.empty_like(y)
    args = (grad, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False])
    assert bound_bytes(aten.convolution_backward.default, args) == _round512(18.0 * nbytes) == 4718592


def test_a_stem_is_bounded_by_its_output_when_that_is_larger():
    # 3 -> 64 channels at stride 2 (a strided bound): the output (64 x 16 x 16) is 5.3x the input (3 x 32 x 32).
    conv, y = _call(3, 64, 32, 2, torch.bfloat16, channels_last=True)
    x, w = conv[0], conv[1]
    out_bytes = 4 * 64 * 16 * 16 * 2
    assert out_bytes > x.numel() * 2
    assert bound_bytes(aten.convolution.default, conv, y) == _round512(0.53 * out_bytes) == 69632
    grad = torch.empty_like(y)
    args = (grad, x, w, None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1, [False, True, False])
    assert bound_bytes(aten.convolution_backward.default, args) == _round512(0.62 * out_bytes) == 81408


@pytest.mark.parametrize("stride", [1, 2], ids=["stride1", "strided"])
@pytest.mark.parametrize("half", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_each_precision_layout_and_stride_takes_its_own_ratio(half, channels_last, stride):
    dtype = torch.bfloat16 if half else torch.float32
    conv, y = _call(8, 8, 16, stride, dtype, channels_last)
    x = conv[0]
    nbytes = x.numel() * x.element_size()  # as large as the output or larger
    assert bound_bytes(aten.convolution.default, conv, y) == _round512(
        BOUND_RATIOS[(half, channels_last, stride > 1)].forward * nbytes
    )


def test_a_1x1_convolution_takes_the_pointwise_bound():
    # 64 -> 256 channels: the output (4 x 256 x 16 x 16 fp32, 1 MiB) is the base.
    conv, y = _call(64, 256, 16, 1, torch.float32, channels_last=False, kernel=1)
    x, w = conv[0], conv[1]
    out_bytes = 4 * 256 * 16 * 16 * 4
    assert bound_bytes(aten.convolution.default, conv, y) == _round512(POINTWISE_BOUND.forward * out_bytes)
    assert _round512(POINTWISE_BOUND.forward * out_bytes) == 52736
    grad = torch.empty_like(y)
    args = (grad, x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, False])
    assert bound_bytes(aten.convolution_backward.default, args) == _round512(0.15 * out_bytes) == 157696


def test_other_ops_and_other_ranks_are_charged_nothing():
    x = torch.empty(4, 8, 100, device="meta")
    w = torch.empty(8, 8, 3, device="meta")
    conv = (x, w, None, [1], [1], [1], False, [0], 1)
    assert (
        bound_bytes(aten.convolution.default, conv, aten.convolution.default(*conv)) == 0
    )  # 1-D: not measured, not bounded
    assert bound_bytes(aten.mm.default, (torch.empty(4, 4, device="meta"),)) == 0


def test_an_emulated_gpu_target_charges_the_backward_bound_at_its_peak(monkeypatch):
    # One 3x3 conv, fp32, whose backward's bound (18x its 512 KiB input, 9 MiB) dwarfs the rest of the step (about
    # 1 MiB alive then): the step's peak is that call. One more x of the input in the ratio moves the peak by one
    # input's bytes, to the byte, and the peak's temporaries hold the bound.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1))
    x = torch.randn(8, 16, 32, 32)
    loss = lambda out: out.square().mean()  # noqa: E731
    profile = profile_model(model, (x,), loss_fn=loss, device="H100-SXM")
    workspace = _round512(18.0 * x.numel() * 4)
    assert workspace == 9437184
    assert profile.peak_breakdown["temporary"] >= workspace
    assert profile.peak_bytes - workspace < 2 * 2**20
    ratios = dict(BOUND_RATIOS)
    ratios[(False, False, False)] = type(ratios[(False, False, False)])(forward=2.4, backward=19.0)
    monkeypatch.setattr("lightning_sac.dryrun.cuda.conv_workspace.BOUND_RATIOS", ratios)
    larger = profile_model(model, (x,), loss_fn=loss, device="H100-SXM")
    assert larger.peak_bytes - profile.peak_bytes == x.numel() * 4


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_a_strided_1x1_convolution_on_a_contiguous_input_holds_its_input_again(channels_last):
    # GPU-found: ResNet's downsampling shortcut (1x1, stride 2) on a contiguous input held 1.06-1.12x its input
    # (H100, cuDNN 9.19), where the pointwise bound charged 0.15x; channels-last it held 0.06x.
    conv, y = _call(64, 32, 16, 2, torch.bfloat16, channels_last=channels_last, kernel=1)
    x, w = conv[0], conv[1]
    in_bytes = 4 * 64 * 16 * 16 * 2  # the input (the output is 4 x 32 x 8 x 8) is the base
    bound = STRIDED_POINTWISE_BOUND if not channels_last else POINTWISE_BOUND
    assert bound_bytes(aten.convolution.default, conv, y) == _round512(bound.forward * in_bytes)
    grad = torch.empty_like(y)
    args = (grad, x, w, None, [2, 2], [0, 0], [1, 1], False, [0, 0], 1, [True, True, False])
    assert bound_bytes(aten.convolution_backward.default, args) == _round512(bound.backward * in_bytes)
    assert bound_bytes(aten.convolution_backward.default, args) == (151040 if not channels_last else 19968)
