"""Convolution scratch on the CPU, measured on the kernel: conv nets' peaks, plain and planned, and the cache.

oneDNN's scratch depends on the kernel, layout and thread count (lightning_sac/dryrun/cpu/scratch.py): a 1x1
expansion's backward holds about 5x its input, a depthwise 7x7's 1x, a channels-last convolution almost none, a
three-channel stem's weight gradient a buffer of its output's size. Each family below is a tiny random-init conv net
of a kind users train (ConvNeXt's depthwise 7x7 and 1x1 expansion, Hugging Face's bottleneck ResNet, a channels-last
MobileNet-style segmentation net, a stem convolution whose backward is the step's peak): the plain prediction is
within 2% of torch.profiler's allocator events of a real step, and a plan at 80% of it measures at most 2% above
its prediction with the plain model's loss, gradients and buffers (the pattern of tests/test_real_models.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from test_real_models import Reference, build_reference, measured_planned_peak, train_planned
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from zoo import Family, _quiet_transformers

from lightning_sac import BudgetError, solve_plan
from lightning_sac.dryrun.cpu.scratch import KernelScratch, peak_beyond, scratch_bound

GIB = 2**30
aten = torch.ops.aten


class LayerNorm2d(nn.LayerNorm):
    """timm's channels-first LayerNorm: normalise over channels of a permuted (non-contiguous) view."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    """ConvNeXt's block with 1x1 convolutions: depthwise 7x7, norm, 1x1 to 4x, GELU, 1x1 back, layer scale."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = LayerNorm2d(c)
        self.pwconv1 = nn.Conv2d(c, 4 * c, 1)
        self.act = nn.GELU()
        self.pwconv2 = nn.Conv2d(4 * c, c, 1)
        self.gamma = nn.Parameter(torch.full((1, c, 1, 1), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gamma * self.pwconv2(self.act(self.pwconv1(self.norm(self.dwconv(x)))))


class ConvNeXt(nn.Module):
    """Two ConvNeXt stages with a patchify stem and a strided downsampling layer."""

    def __init__(self, c: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 2, stride=2), LayerNorm2d(c))
        self.stage1 = nn.Sequential(ConvNeXtBlock(c), ConvNeXtBlock(c))
        self.downsample = nn.Sequential(LayerNorm2d(c), nn.Conv2d(c, 2 * c, 2, stride=2))
        self.stage2 = nn.Sequential(ConvNeXtBlock(2 * c), ConvNeXtBlock(2 * c))
        self.norm = nn.LayerNorm(2 * c)
        self.head = nn.Linear(2 * c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stage2(self.downsample(self.stage1(self.stem(x))))
        return self.head(self.norm(x.mean((2, 3))))


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expansion, depthwise 3x3, 1x1 projection, BatchNorm, ReLU6 in place, residual."""

    def __init__(self, c: int, expand: int = 4) -> None:
        super().__init__()
        h = c * expand
        self.body = nn.Sequential(
            nn.Conv2d(c, h, 1, bias=False),
            nn.BatchNorm2d(h),
            nn.ReLU6(inplace=True),
            nn.Conv2d(h, h, 3, padding=1, groups=h, bias=False),
            nn.BatchNorm2d(h),
            nn.ReLU6(inplace=True),
            nn.Conv2d(h, c, 1, bias=False),
            nn.BatchNorm2d(c),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class MobileSegmenter(nn.Module):
    """A two-scale segmentation net: stem, inverted residuals, a strided conv, bilinear upsampling, skip, 1x1 head."""

    def __init__(self, w: int = 16, classes: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU6(inplace=True))
        self.enc1 = nn.Sequential(InvertedResidual(w), InvertedResidual(w))
        self.down = nn.Conv2d(w, 2 * w, 3, stride=2, padding=1, bias=False)
        self.enc2 = nn.Sequential(InvertedResidual(2 * w), InvertedResidual(2 * w))
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")
        self.head = nn.Conv2d(3 * w, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.enc1(self.stem(x))
        return self.head(torch.cat([a, self.up(self.enc2(self.down(a)))], 1))


class StemClassifier(nn.Module):
    """A 3x3 stem from three channels, global average pooling, a linear head: the stem's backward is the peak."""

    def __init__(self, w: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, w, 3, padding=1)
        self.head = nn.Linear(w, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stem(x).mean((2, 3)))


def _images(batch: int, size: int, classes: int, *, dense: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    labels = (batch, size, size) if dense else (batch,)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, classes, labels, generator=g)


def convnext() -> Family:
    torch.manual_seed(0)
    images, labels = _images(2, 32, 10)
    return Family("convnext", ConvNeXt().train(), (images,), lambda out: F.cross_entropy(out, labels))


def bottleneck_resnet() -> Family:
    from transformers import ResNetConfig, ResNetForImageClassification

    _quiet_transformers()
    torch.manual_seed(0)
    config = ResNetConfig(
        num_channels=3, embedding_size=16, hidden_sizes=[32, 64], depths=[2, 2], layer_type="bottleneck", num_labels=10
    )
    images, labels = _images(2, 64, 10)
    return Family(
        "bottleneck_resnet", ResNetForImageClassification(config).train(), {"pixel_values": images, "labels": labels}
    )


def channels_last_segmenter() -> Family:
    torch.manual_seed(0)
    model = MobileSegmenter().train().to(memory_format=torch.channels_last)
    images, labels = _images(2, 32, 8, dense=True)
    images = images.contiguous(memory_format=torch.channels_last)
    return Family("channels_last", model, (images,), lambda out: F.cross_entropy(out, labels))


def stem() -> Family:
    torch.manual_seed(0)
    images, labels = _images(4, 64, 10)
    return Family("stem", StemClassifier().train(), (images,), lambda out: F.cross_entropy(out, labels))


FAMILIES: dict[str, Callable[[], Family]] = {
    "convnext": convnext,
    "bottleneck_resnet": bottleneck_resnet,
    "channels_last": channels_last_segmenter,
    "stem": stem,
}
_REFERENCES: dict[str, Reference] = {}


def reference(name: str) -> Reference:
    """The family's profile, its measured plain peak and two plain optimizer steps (as test_real_models builds)."""
    if name not in _REFERENCES:
        _REFERENCES[name] = build_reference(FAMILIES[name]())
    return _REFERENCES[name]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_plain_prediction_is_within_2_percent_of_a_real_step(name):
    ref = reference(name)
    predicted = ref.profile.plain_peak_bytes
    assert abs(predicted - ref.plain_peak) <= 0.02 * ref.plain_peak, (predicted, ref.plain_peak)


@pytest.mark.slow  # six planned real steps and trainings: the plain predictions above are the quick check
@pytest.mark.parametrize("backend", ["sac", "graph"])
@pytest.mark.parametrize("name", ["convnext", "bottleneck_resnet", "channels_last"])
def test_a_plan_at_80_percent_measures_within_2_percent_and_trains_as_the_plain_model(name, backend):
    ref = reference(name)
    plan = solve_plan(ref.profile, 0.8 * ref.profile.plain_peak_bytes / GIB, backend=backend)
    assert plan.decisions
    train_planned(ref, plan)  # the plain model's loss, every gradient and every buffer over two steps
    measured = measured_planned_peak(ref, plan)
    assert measured <= 1.02 * plan.predicted_peak_bytes, (measured, plan.predicted_peak_bytes)
    assert measured <= ref.plain_peak


@pytest.mark.parametrize("backend", ["sac", "graph"])
def test_no_plan_goes_below_the_stem_convolutions_backward(backend):
    # The stem's backward (weight and bias gradients only) holds a buffer of its output's size: the step's peak,
    # which no checkpoint can lower. The planner says so, and the least it offers is what the step measures.
    ref = reference("stem")
    with pytest.raises(BudgetError) as info:
        solve_plan(ref.profile, 0.8 * ref.profile.plain_peak_bytes / GIB, backend=backend)
    assert abs(info.value.minimum_bytes - ref.plain_peak) <= 0.02 * ref.plain_peak, (info.value, ref.plain_peak)


def _conv_backward_args(
    batch: int, c_in: int, c_out: int, size: int, kernel: int, groups: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
    x = torch.zeros(batch, c_in, size, size)
    w = torch.zeros(c_out, c_in // groups, kernel, kernel)
    grad = torch.zeros(batch, c_out, size, size)
    rest = ([c_out], [1, 1], [kernel // 2] * 2, [1, 1], False, [0, 0], groups)
    return grad, x, w, rest


class _Seen(TorchDispatchMode):
    """Counts the ops that reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_each_signature_is_measured_once_on_the_kernel_unseen_by_the_dry_runs_modes():
    scratch = KernelScratch(cache_dir=None)  # measured here, not answered by a disk cache
    with FakeTensorMode() as fake:
        grad, x, w, rest = _conv_backward_args(2, 64, 256, 16, 1)
        grad, x, w = (fake.from_tensor(t) for t in (grad, x, w))
    func = aten.convolution_backward.default
    args = (grad, x, w, *rest, [True, True, True])
    out = None  # the convolution's fake outputs are not needed to measure it
    seen = _Seen()
    with fake, seen:
        first = scratch(func, args, {}, out)
        assert scratch(func, args, {}, out) == first
    assert scratch.measured == 1
    assert seen.ops == 0  # the zeros, the kernel and its outputs ran outside the dry run's modes

    # The same op on real tensors, measured directly: what the cache holds is the kernel's own figure.
    real_grad, real_x, real_w, _ = _conv_backward_args(2, 64, 256, 16, 1)
    with torch.no_grad():
        _, direct = peak_beyond(lambda: func(real_grad, real_x, real_w, *rest, [True, True, True]))
    assert first == direct > 0

    # Another output mask is another signature; so is another thread count.
    assert scratch(func, (*args[:-1], [False, True, True]), {}, out) is not None
    assert scratch.measured == 2
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        scratch(func, args, {}, out)
    finally:
        torch.set_num_threads(threads)
    assert scratch.measured == 3
    assert scratch(aten.relu.default, (x,), {}, None) is None  # not a measured op: its outputs are all it holds


def test_an_oversize_signature_is_charged_the_bound_without_running(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an oversize signature must not be allocated")

    monkeypatch.setattr(KernelScratch, "_measure", staticmethod(refuse))
    scratch = KernelScratch(cache_dir=None)  # 1 GiB, or a quarter of free memory
    with FakeTensorMode():  # a 1x1 expansion on 8 x 64 x 1024 x 1024: 2 GiB of input, 8 GiB of output gradient
        grad, x, w, rest = _conv_backward_args(8, 64, 256, 1024, 1)
    args = (grad, x, w, *rest, [True, True, True])
    bound = scratch(aten.convolution_backward.default, args, {}, None)
    # Twice input, output gradient and weight: above every signature measured (docs/benchmarks.md).
    assert (
        bound
        == 2 * (2 * GIB + 8 * GIB + 64 * 256 * 4)
        == scratch_bound(aten.convolution_backward.default, args, {}, None)
    )
    assert scratch.measured == 0

    # bf16 may take PyTorch's own kernel, which unfolds a 3x3 convolution's input into 9x its size.
    with FakeTensorMode():
        grad, x, w, rest = _conv_backward_args(8, 64, 64, 1024, 3)
        grad, x, w = grad.bfloat16(), x.bfloat16(), w.bfloat16()
    bf16 = scratch(aten.convolution_backward.default, (grad, x, w, *rest, [True] * 3), {}, None)
    assert bf16 == 2 * (GIB + GIB + 64 * 64 * 9 * 2) + 9 * GIB


def test_under_a_running_profiler_the_bound_stands_uncached():
    scratch = KernelScratch(cache_dir=None)  # measured here, not answered by a disk cache
    grad, x, w, rest = _conv_backward_args(2, 16, 16, 8, 3)
    args = (grad, x, w, *rest, [True, True, True])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        during = scratch(aten.convolution_backward.default, args, {}, None)
    assert during == scratch_bound(aten.convolution_backward.default, args, {}, None)
    assert scratch.measured == 0
    scratch(aten.convolution_backward.default, args, {}, None)  # measured once the profiler has stopped
    assert scratch.measured == 1
