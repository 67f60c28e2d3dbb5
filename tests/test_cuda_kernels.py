"""CUDA's kernel choices on fake CPU tensors: SDPA backend selection, attention workspaces, autocast in a model."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import SacOps
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from zoo import resnet

from lightning_sac import get_device_spec, profile_model
from lightning_sac.dryrun.cuda.batch_norm import CudnnBatchNormEmulation
from lightning_sac.dryrun.cuda.sdpa import (
    CUDNN,
    EFFICIENT,
    FLASH,
    MATH,
    attention_workspace_bytes,
    choose_backend,
    cuda_sdpa,
)

aten = torch.ops.aten


def _qkv(
    shape: tuple[int, ...], dtype: torch.dtype, kv_heads: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kv = shape if kv_heads is None else (shape[0], kv_heads, *shape[2:])
    return (
        torch.empty(shape, dtype=dtype, requires_grad=True),
        torch.empty(kv, dtype=dtype, requires_grad=True),
        torch.empty(kv, dtype=dtype, requires_grad=True),
    )


CASES = [
    # (device, q shape, dtype, kv heads, mask, gqa, kernels enabled, expected)
    ("H100-SXM", (2, 8, 128, 64), torch.bfloat16, None, False, False, None, CUDNN),  # cuDNN first on SM 9.0
    ("A100-40GB", (2, 8, 128, 64), torch.float16, None, False, False, None, FLASH),  # flash first elsewhere
    ("H100-SXM", (2, 8, 128, 64), torch.float32, None, False, False, None, EFFICIENT),  # cuDNN, flash: half only
    ("H100-SXM", (2, 8, 128, 64), torch.bfloat16, None, True, False, None, CUDNN),  # cuDNN takes a mask
    ("A100-40GB", (2, 8, 128, 64), torch.bfloat16, None, True, False, None, EFFICIENT),  # flash takes no mask
    ("H100-SXM", (2, 8, 128, 256), torch.bfloat16, None, False, False, None, CUDNN),  # head dim 256 on SM 9.0
    ("H100-SXM", (2, 8, 128, 512), torch.bfloat16, None, False, False, None, EFFICIENT),  # cuDNN, flash: <= 256
    ("H100-SXM", (2, 8, 128, 60), torch.bfloat16, None, False, False, None, FLASH),  # cuDNN: multiples of 8
    ("H100-SXM", (2, 8, 128, 60), torch.bfloat16, None, True, False, None, MATH),  # 60 % 8: no efficient either
    ("A100-40GB", (2, 8, 128, 64), torch.bfloat16, 2, False, True, None, FLASH),  # flash runs GQA natively
    ("H100-SXM", (2, 8, 128, 64), torch.float32, 2, False, True, None, MATH),  # efficient takes no GQA
    ("H100-SXM", (16, 128, 64), torch.bfloat16, None, False, False, None, MATH),  # fused kernels want 4-D
    ("V100", (2, 8, 128, 64), torch.float16, None, False, False, None, EFFICIENT),  # no flash below SM 8.0
    ("V100", (2, 8, 128, 64), torch.bfloat16, None, False, False, None, MATH),  # nor bf16 efficient
    ("L4", (2, 8, 128, 200), torch.bfloat16, None, False, False, None, EFFICIENT),  # SM 8.9 trains no dim 200
    ("H100-SXM", (2, 8, 128, 64), torch.bfloat16, None, False, False, [SDPBackend.MATH], MATH),
    ("H100-SXM", (2, 8, 128, 64), torch.bfloat16, None, False, False, [SDPBackend.EFFICIENT_ATTENTION], EFFICIENT),
    ("A100-40GB", (2, 8, 128, 64), torch.bfloat16, None, False, False, [SDPBackend.CUDNN_ATTENTION], CUDNN),
]


@pytest.mark.parametrize(("device", "shape", "dtype", "kv_heads", "mask", "gqa", "enabled", "expected"), CASES)
def test_sdpa_backend_follows_cudas_rules(
    device: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    kv_heads: int | None,
    mask: bool,
    gqa: bool,
    enabled: list[SDPBackend] | None,
    expected: int,
) -> None:
    spec = get_device_spec(device)
    with FakeTensorMode():
        q, k, v = _qkv(shape, dtype, kv_heads)
        attn_mask = torch.ones(shape[-2], shape[-2], dtype=torch.bool) if mask else None
        if enabled is None:
            got = choose_backend(spec, q, k, v, attn_mask, 0.1, False, gqa)
        else:
            with sdpa_kernel(enabled):
                got = choose_backend(spec, q, k, v, attn_mask, 0.1, False, gqa)
    assert got == expected


def test_cudnn_attention_yields_to_deterministic_algorithms_and_to_torch_s_switch(monkeypatch) -> None:
    # GPU-found: an H100 run under torch.use_deterministic_algorithms(True) took another kernel than the profile.
    spec = get_device_spec("H100-SXM")
    with FakeTensorMode():
        q, k, v = _qkv((2, 8, 128, 64), torch.bfloat16)
        was = torch.are_deterministic_algorithms_enabled()
        was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
        try:
            torch.use_deterministic_algorithms(True)
            assert choose_backend(spec, q, k, v) == FLASH  # check_cudnn_deterministic refuses cuDNN
            torch.use_deterministic_algorithms(True, warn_only=True)
            assert choose_backend(spec, q, k, v) == CUDNN  # warn_only lets it run
        finally:
            torch.use_deterministic_algorithms(was, warn_only=was_warn)
        monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
        assert choose_backend(spec, q, k, v) == FLASH


def test_no_enabled_backend_takes_the_call_raises_as_cuda_does() -> None:
    with FakeTensorMode():
        q, k, v = _qkv((2, 8, 128, 64), torch.bfloat16)
        mask = torch.ones(128, 128, dtype=torch.bool)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), pytest.raises(RuntimeError, match="No available kernel"):
            choose_backend(get_device_spec("H100-SXM"), q, k, v, mask)


def test_flash_backward_workspace_in_hand_numbers() -> None:
    # FlashAttention-2's mha_bwd: softmax_d fp32 (b, h, s_q rounded to 128) and dq_accum fp32 (b, s_q rounded to
    # 128, h, d rounded to 32); with GQA, dK and dV expanded to every query head in the input dtype.
    b, h, s, d = 2, 4, 100, 48
    with FakeTensorMode():
        q, k, v = _qkv((b, h, s, d), torch.bfloat16)
        args = (q, q, k, v, q, torch.empty(b, h, s), None, None, s, s, 0.0, True, None, None)
        got = attention_workspace_bytes(aten._scaled_dot_product_flash_attention_backward.default, args, {})
        assert got == b * h * 128 * 4 + b * 128 * h * 64 * 4
        _, k2, v2 = _qkv((b, h, s, d), torch.bfloat16, kv_heads=1)
        args = (q, q, k2, v2, q, torch.empty(b, h, s), None, None, s, s, 0.0, True, None, None)
        gqa = attention_workspace_bytes(aten._scaled_dot_product_flash_attention_backward.default, args, {})
        assert gqa == got + 2 * b * s * h * d * 2


N, D = 4096, 1024


def _plain(x: torch.Tensor, stack: nn.Module) -> torch.Tensor:
    return stack.l2(torch.softmax(stack.ln(stack.l1(x)), -1))


def _autocast_torch(x: torch.Tensor, stack: nn.Module) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return _plain(x, stack)


def _autocast_amp(x: torch.Tensor, stack: nn.Module) -> torch.Tensor:
    with torch.amp.autocast("cuda", dtype=torch.bfloat16):
        return _plain(x, stack)


@torch.autocast("cuda", dtype=torch.bfloat16)
def _autocast_decorator(x: torch.Tensor, stack: nn.Module) -> torch.Tensor:
    return _plain(x, stack)


class Stack(nn.Module):
    def __init__(self, forward: Callable[[torch.Tensor, nn.Module], torch.Tensor]) -> None:
        super().__init__()
        self.l1, self.ln, self.l2 = nn.Linear(D, D), nn.LayerNorm(D), nn.Linear(D, D)
        self.run = forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x, self)


class TwoStacks(nn.Module):
    def __init__(self, forward: Callable[[torch.Tensor, nn.Module], torch.Tensor]) -> None:
        super().__init__()
        self.s, self.t = Stack(forward), Stack(forward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.t(self.s(x))


@pytest.mark.parametrize("forward", [_autocast_torch, _autocast_amp])
def test_cuda_autocast_in_the_model_follows_cudas_op_lists(forward: Callable) -> None:
    # fp32 model, Linear -> LayerNorm -> softmax -> Linear under autocast("cuda", bf16), for an H100 target. By
    # CUDA's lists: linear in bf16, layer_norm in fp32 (its input cast up), softmax in fp32. The first stack keeps:
    # its fp32 input cast to bf16 (2 bytes per element; the first weight's cast is not kept, the input needs no
    # grad), layer_norm's fp32 input (4) and its fp32 mean and rstd (8 bytes per row), softmax's fp32 output (4),
    # its bf16 cast for the second linear (2) with that linear's bf16 weight (2*D*D), and the bf16 output (2).
    # The second stack's input is already bf16: the same without the first cast, plus its first weight's cast.
    with torch.device("meta"):
        model = TwoStacks(forward)
    x = torch.empty(N, D, device="meta")
    profile = profile_model(model, (x,), device="H100-SXM")
    first = N * D * (2 + 4 + 4 + 2 + 2) + N * 8 + 2 * D * D
    second = N * D * (4 + 4 + 2 + 2) + N * 8 + 2 * (2 * D * D)
    assert profile.modules["s"].activation_bytes == first
    assert profile.modules["t"].activation_bytes == second
    # For the CPU the region is off on this machine (no CUDA): all fp32, layer_norm's input, softmax's output (the
    # second linear's input too) and the output, 4 bytes each.
    assert profile_model(model, (x,), device="cpu").modules["s"].activation_bytes == N * D * 12 + N * 8


def test_a_cuda_autocast_decorator_built_without_cuda_is_reported() -> None:
    # torch disabled the decorator's region when this module was imported on a machine without CUDA, forgetting
    # whether it was asked to be enabled: the profile says so instead of guessing.
    with torch.device("meta"):
        model = TwoStacks(_autocast_decorator)
    with pytest.warns(UserWarning, match="built before profiling"):
        profile = profile_model(model, (torch.empty(N, D, device="meta"),), device="H100-SXM")
    assert profile.modules["s"].activation_bytes == N * D * 12 + N * 8


@pytest.mark.parametrize("fused", [False, True])
def test_adamw_step_counters_stay_on_the_host_for_a_gpu_target(fused: bool) -> None:
    # torch keeps AdamW's scalar `step` on the host unless the group is fused or capturable: on a GPU only the two
    # moments take device memory (each a parameter's size here: every tensor a multiple of 512 bytes).
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    profile = profile_model(
        model,
        (torch.randn(8, 256),),
        optimizer_factory=lambda ps: torch.optim.AdamW(ps, fused=fused),
        device="H100-SXM",
    )
    root = profile.modules[""]
    steps = 4 * 512 if fused else 0  # a fused group keeps each parameter's step on the device, one 512-byte block
    assert root.optimizer_state_bytes == 2 * root.parameter_bytes + steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_emulated_boolean_mask_runs_atens_own_conversion(dtype: torch.dtype) -> None:
    # GPU-found: the emulation converted a boolean mask with zeros_like and masked_fill, ATen (torch >= 2.6) with
    # two scalar_tensor calls and a where; the plan's wrapper met another op on the GPU and fell back. ATen's
    # convert_boolean_attn_mask is shared by every device, so a real CPU call shows the ops a GPU runs before the
    # kernel, on the torch installed.
    q = torch.randn(2, 4, 32, 64, dtype=dtype)
    mask = torch.ones(32, 32, dtype=torch.bool).tril()
    with SacOps() as real:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    kernel = next(i for i, n in enumerate(real.names) if "scaled_dot_product" in n)
    with FakeTensorMode() as fake, SacOps() as emulated:
        fq, fmask = fake.from_tensor(q), fake.from_tensor(mask)
        cuda_sdpa(get_device_spec("H100-SXM"), fq, fq, fq, attn_mask=fmask)
    assert real.names[:kernel] == ["aten.scalar_tensor.default", "aten.scalar_tensor.default", "aten.where.self"]
    assert emulated.names[:kernel] == real.names[:kernel]


BN_CASES = [
    # (input shape, input dtype, weight dtype, affine, eps, training, expected op)
    ((8, 4, 6, 6), torch.float32, torch.float32, True, 1e-5, True, "aten.cudnn_batch_norm.default"),
    ((8, 4, 6, 6), torch.float32, torch.float32, True, 1e-5, False, "aten.cudnn_batch_norm.default"),
    ((8, 4, 6), torch.float16, torch.float32, True, 1e-5, True, "aten.cudnn_batch_norm.default"),  # fp16, fp32 w
    ((8, 4, 6, 6), torch.bfloat16, torch.float32, True, 1e-5, True, "aten.native_batch_norm.default"),  # no bf16
    ((8, 4), torch.float32, torch.float32, True, 1e-5, True, "aten.native_batch_norm.default"),  # 2-D input
    ((8, 4, 6, 6), torch.float32, torch.float32, False, 1e-5, True, "aten.native_batch_norm.default"),  # no affine
    ((8, 4, 6, 6), torch.float32, torch.float32, True, 1e-6, True, "aten.native_batch_norm.default"),  # eps < 1e-5
]


@pytest.mark.parametrize(("shape", "dtype", "wdtype", "affine", "eps", "training", "expected"), BN_CASES)
def test_an_emulated_batch_norm_takes_the_kernel_cuda_takes(shape, dtype, wdtype, affine, eps, training, expected):
    # GPU-found: an H100 runs float32 BatchNorm as cudnn_batch_norm; a plan made on a CPU listed native_batch_norm
    # and fell back at run time. The emulation follows CUDA's _batch_norm_impl_index (Normalization.cpp).
    c = shape[1]
    with FakeTensorMode():
        x = torch.empty(shape, dtype=dtype)
        w, b = (torch.ones(c, dtype=wdtype), torch.zeros(c, dtype=wdtype)) if affine else (None, None)
        mean, var = torch.zeros(c, dtype=wdtype), torch.ones(c, dtype=wdtype)
        with CudnnBatchNormEmulation(), SacOps() as ops:
            torch.nn.functional.batch_norm(x, mean, var, w, b, training=training, eps=eps)
    kernels = [n for n in ops.names if "batch_norm" in n]
    assert kernels == [expected]
    if expected == "aten.native_batch_norm.default":  # the composite's own order: an empty reserve first
        assert ops.names == ["aten.empty.memory_format", expected]
    else:
        assert ops.names == [expected]


def test_a_resnet_planned_for_an_nvidia_gpu_lists_cudnn_batch_norm_as_stateful() -> None:
    family = resnet()
    stats = {}
    for device in ("H100-SXM", "MI300X"):
        profile = profile_model(family.model, family.batch, loss_fn=family.loss_fn, device=device)
        stats[device] = profile.modules["layer1.0"].op_stats
    h100, mi300 = stats["H100-SXM"], stats["MI300X"]
    assert [h100.func_names[i] for i in h100.stateful_ops] == ["aten.cudnn_batch_norm.default"] * 2
    # An AMD target keeps the native kernel: MIOpen's choice is not emulated.
    assert [mi300.func_names[i] for i in mi300.stateful_ops] == ["aten.native_batch_norm.default"] * 2
    # The emulation leaves the CPU's kernel in place after the dry run.
    with SacOps() as ops:
        torch.nn.BatchNorm2d(3)(torch.randn(2, 3, 4, 4))
    assert "aten.native_batch_norm.default" in ops.names
